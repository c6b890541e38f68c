"""Events as JSON lines: one self-contained object per event, for jq, pandas and other programs.

The text format is for people and mirrors the kernel; this one is for programs, so every field
is typed rather than pre-formatted: numbers stay numbers (``x64`` values too: hex is a way to
print, not a type), arrays are lists and a fetch that faulted is ``null`` instead of the text
``(fault)``. Values are cut to their type's width by :mod:`kprobes.output.argtypes`, so a ``u8``
of -1 is 255 here exactly as in the text output.

Keys (entry and return events)::

    event      "GROUP/EVENT"
    pid, tid   process id (tgid) and thread id
    comm       thread name
    cpu        cpu number, null when unknown (negative in the Event)
    timestamp  seconds, float, on the session's clock
    ip         probed address (entry) or the caller's return address (return), int
    location   "sym+off/size" text of ip
    args       {name: value} in spec order
    time       with -T only: the hit's wall-clock time, ISO 8601 local time with its UTC
               offset, to the microsecond ("2026-11-27T11:12:32.123456+00:00"), as
               ``count -i --json``'s "time"

    return     true                  (return events only)
    func       name of the returning function
    func_ip    its address, int

    stack       with trace --stack only: the user stack, innermost first, one object a frame:
                {"ip", "func", "offset", "size", "module", "text"} (func and module null
                when unknown; module null in the program's own file)
    stack_stop  when the walk stopped before the outermost frame: why ("no unwind info")
"""

from __future__ import annotations

import json

from kprobes.model import Event
from kprobes.output.argtypes import JsonValue, json_value
from kprobes.output.stacks import stack_to_json
from kprobes.output.text import wall_time


def event_to_json(ev: Event, *, wall_offset_ns: int | None = None) -> dict[str, object]:
    """The event as a JSON-ready dict (see the module docstring for the keys);
    ``wall_offset_ns`` (CLOCK_REALTIME minus the event clock) adds ``time``."""
    args: dict[str, JsonValue] = {a.name: json_value(a.type, a.value) for a in ev.args}
    obj: dict[str, object] = {
        "event": ev.name,
        "pid": ev.pid,
        "tid": ev.tid,
        "comm": ev.comm,
        "cpu": ev.cpu if ev.cpu >= 0 else None,
        "timestamp": ev.timestamp,
        **({} if wall_offset_ns is None else {"time": _iso(ev.timestamp, wall_offset_ns)}),
        "ip": ev.ip,
        "location": ev.location,
        "args": args,
    }
    if ev.is_return:
        obj["return"] = True
        obj["func"] = ev.func
        obj["func_ip"] = ev.func_ip
    if ev.stack is not None:
        obj["stack"] = stack_to_json(ev.stack)
        if ev.stack.stop:
            obj["stack_stop"] = ev.stack.stop
    return obj


def _iso(timestamp: float, offset_ns: int) -> str:
    return wall_time(timestamp, offset_ns).isoformat(timespec="microseconds")


def format_json(ev: Event, *, wall_offset_ns: int | None = None) -> str:
    """The event as one line of JSON, without the newline.

    Non-ASCII text is escaped (``ensure_ascii``) so that bytes a target's strings carry that are
    not valid UTF-8 can never make the writer fail.
    """
    return json.dumps(event_to_json(ev, wall_offset_ns=wall_offset_ns), separators=(", ", ": "))
