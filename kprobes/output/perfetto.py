"""Events as a trace that ui.perfetto.dev (and chrome://tracing) opens: calls become slices.

The format is Chrome's JSON Trace Event format, which the Perfetto UI imports directly: one
object ``{"traceEvents": [...], "displayTimeUnit": "ns"}`` whose ``ts``/``dur`` are
microseconds (floats here, so nanoseconds survive). Rejected: Perfetto's native protobuf format,
which needs a protobuf schema and library for what JSON already shows.

**What becomes what.**

* A function-entry event and the return event of the same function on the same thread become one
  complete slice (``"ph": "X"``) named after the function, from the entry's time to the
  return's, with both events' arguments (``args.entry``, ``args.return``).
* Every other event -- a probe in the middle of a function, a return whose entry was not seen,
  an entry of a function that never returns in the trace -- is a thread-scoped instant
  (``"ph": "i", "s": "t"``) named after the event, with its arguments.
* An event with a user stack (``trace --stack``) has it in its ``args`` as ``stack``, the
  frames' names innermost first (the marker last, if the walk stopped short): the Perfetto
  UI shows a slice's and an instant's args in its details panel. Rejected: the format's
  ``stackFrames``/``sf`` table, which chrome://tracing draws but which Perfetto's importer,
  for which this JSON format is legacy and "best effort" (its FAQ), does not document.
* Each process gets a ``process_name`` and each thread a ``thread_name`` metadata event from
  ``comm`` (again when a thread's comm changes, e.g. after exec).

**Pairing.** An entry event's function is the symbol of its ``location`` when the offset is 0
(``sym+0x0/0x..``, or a bare symbol or address); a return event's is ``func`` (or ``func_ip`` as
``0x...``); a `` [module]`` suffix is ignored on both. Open entries are kept on one stack per
``(tid, function)``, and a return closes the **newest** open entry of its function on its
thread -- so recursion pairs innermost first, and a missed return (kretprobe ``maxactive``
exhausted) costs one slice instead of shifting every later pair.

**Streaming.** Events are written as they complete; only open entries are held, that is the
live call stacks (bounded by depth x threads). Slices are therefore written when the call
*returns*, children before parents, not in ``ts`` order; the format allows this and importers
sort. A caller that knows which functions have return probes passes them as ``return_funcs``:
entries of other functions are written at once as instants. Without it, every function-entry
event is held until its return or the end, which for a busy plain kprobe grows with the trace.

**At close,** entries still open are written as slices ending at the last timestamp seen (with
``"unfinished": true``) when their function is known to return (declared in ``return_funcs`` or
seen returning during the trace) -- a thread still inside ``main`` shows as such -- and as
instants otherwise, since a function never seen returning is most likely not probed for returns.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Collection
from types import TracebackType
from typing import TextIO

from kprobes.errors import InternalError
from kprobes.model import Event
from kprobes.output.argtypes import JsonValue, json_value
from kprobes.values import dataclass

_ENTRY_LOCATION = re.compile(
    r"^(?P<sym>.+)\+(?P<off>0x[0-9a-fA-F]+|[0-9]+)(?:/(?:0x[0-9a-fA-F]+|[0-9]+))?$"
)
_MODULE_SUFFIX = re.compile(r" \[[^\]]*\]$")


def entry_function(ev: Event) -> str | None:
    """The function an entry event is at the start of; None if mid-function or a return."""
    if ev.is_return:
        return None
    where = _MODULE_SUFFIX.sub("", ev.location) or f"0x{ev.ip:x}"
    m = _ENTRY_LOCATION.match(where)
    if m is None:
        return where
    return m["sym"] if int(m["off"], 0) == 0 else None


def return_function(ev: Event) -> str:
    """The function a return event returned from."""
    return _MODULE_SUFFIX.sub("", ev.func) or f"0x{ev.func_ip:x}"


def _ns(timestamp: float) -> int:
    return round(timestamp * 1_000_000_000)


def _us(ns: int) -> float:
    return ns / 1000


def _args(ev: Event) -> dict[str, JsonValue]:
    return {a.name: json_value(a.type, a.value, hex_as_text=True) for a in ev.args}


def _describe(ev: Event) -> dict[str, object]:
    """The event's part of a slice's or instant's ``args``."""
    info: dict[str, object] = {"event": ev.name, "location": ev.location, "args": _args(ev)}
    if ev.is_return:
        info["func"] = ev.func
    if ev.stack is not None:
        frames = [f.text for f in ev.stack.frames]
        info["stack"] = [*frames, ev.stack.marker] if ev.stack.marker else frames
    return info


@dataclass(frozen=True, slots=True)
class _OpenCall:
    """An entry event waiting for its return."""

    event: Event
    ns: int


class WriterState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class PerfettoWriter:
    """Write events, in the order they happened, to ``stream`` as a Chrome JSON trace.

    The header is written at once, the closing bracket by :meth:`close` (or leaving the
    ``with`` block); the stream itself is the caller's and stays open.
    """

    def __init__(self, stream: TextIO, *, return_funcs: Collection[str] | None = None) -> None:
        self._stream = stream
        self._declared = frozenset(return_funcs) if return_funcs is not None else None
        self._returning: set[str] = set(self._declared or ())
        self._open: dict[tuple[int, str], list[_OpenCall]] = {}
        self._process_named: set[int] = set()
        self._thread_names: dict[int, str] = {}
        self._last_ns: int | None = None
        self._count = 0
        self.slices = 0
        self.instants = 0
        self.unfinished = 0
        self._state = WriterState.OPEN
        self._stream.write('{"traceEvents": [\n')

    @property
    def state(self) -> WriterState:
        return self._state

    @property
    def open_calls(self) -> int:
        """Entries currently waiting for their return."""
        return sum(len(stack) for stack in self._open.values())

    def write(self, ev: Event) -> None:
        """Take the next event; writes whatever it completes."""
        if self._state is not WriterState.OPEN:
            raise InternalError("PerfettoWriter.write() after close()")
        ns = _ns(ev.timestamp)
        self._last_ns = ns if self._last_ns is None else max(self._last_ns, ns)
        self._name_task(ev)
        if ev.is_return:
            func = return_function(ev)
            self._returning.add(func)
            stack = self._open.get((ev.tid, func))
            if stack:
                entry = stack.pop()
                if not stack:
                    del self._open[(ev.tid, func)]
                self._slice(func, entry, ns, ret=ev)
            else:
                self._instant(ev, ns)
            return
        entered = entry_function(ev)
        if entered is not None and (self._declared is None or entered in self._declared):
            self._open.setdefault((ev.tid, entered), []).append(_OpenCall(ev, ns))
        else:
            self._instant(ev, ns)

    def close(self) -> None:
        """Write the entries still open (module docstring) and end the JSON document."""
        if self._state is WriterState.CLOSED:
            return
        # Step 1: what is still open, oldest first so the file reads in time order.
        pending = sorted(
            ((func, call) for (_, func), stack in self._open.items() for call in stack),
            key=lambda item: item[1].ns,
        )
        self._open.clear()
        # Step 2: a slice to the end for functions known to return, an instant otherwise.
        end_ns = self._last_ns if self._last_ns is not None else 0
        for func, call in pending:
            if func in self._returning:
                self.unfinished += 1
                self._slice(func, call, end_ns, ret=None)
            else:
                self._instant(call.event, call.ns)
        # Step 3: the rest of the document.
        self._stream.write('\n], "displayTimeUnit": "ns"}\n')
        self._state = WriterState.CLOSED

    def __enter__(self) -> PerfettoWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _emit(self, obj: dict[str, object]) -> None:
        if self._count:
            self._stream.write(",\n")
        self._stream.write(json.dumps(obj))
        self._count += 1

    def _name_task(self, ev: Event) -> None:
        if ev.pid not in self._process_named:
            self._process_named.add(ev.pid)
            self._emit(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": ev.pid,
                    "tid": ev.pid,
                    "args": {"name": ev.comm},
                }
            )
        if self._thread_names.get(ev.tid) != ev.comm:
            self._thread_names[ev.tid] = ev.comm
            self._emit(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": ev.pid,
                    "tid": ev.tid,
                    "args": {"name": ev.comm},
                }
            )

    def _slice(self, func: str, entry: _OpenCall, end_ns: int, *, ret: Event | None) -> None:
        ev = entry.event
        args: dict[str, object] = {"entry": _describe(ev)}
        if ret is not None:
            args["return"] = _describe(ret)
        else:
            args["unfinished"] = True
        self.slices += 1
        self._emit(
            {
                "name": func,
                "cat": ev.group,
                "ph": "X",
                "ts": _us(entry.ns),
                "dur": _us(max(0, end_ns - entry.ns)),
                "pid": ev.pid,
                "tid": ev.tid,
                "args": args,
            }
        )

    def _instant(self, ev: Event, ns: int) -> None:
        self.instants += 1
        self._emit(
            {
                "name": ev.event,
                "cat": ev.group,
                "ph": "i",
                "s": "t",
                "ts": _us(ns),
                "pid": ev.pid,
                "tid": ev.tid,
                "args": _describe(ev),
            }
        )
