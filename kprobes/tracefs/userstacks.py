"""The kernel's user stacks on the events of our instance: ``options/userstacktrace``.

With the option set in an instance, the kernel follows every event it records there with a
record of its own (``ftrace/user_stack``: the task's pid and ``caller[8]``), taken by
``ftrace_trace_userstack()`` on the same CPU right after the event: the task's ip, then
the return addresses found by following the frame-pointer chain (``arch_stack_walk_user``),
at most 8, the unused entries 0. So the kernel's stacks are only as good as the frame
pointers: on code built without them (``-O2``, the distributions' default) frames go
missing, or wrong ones appear; and a function's caller is missing at its first instruction
(its frame pointer is not pushed yet). The command line says so (cli/stack_options.py);
our own backend unwinds with the unwind tables instead.

Decoding: each ``user_stack`` record becomes a marker event while the pages are walked
(``records.py`` keeps page order within a CPU, and the merge by time is stable), and
``attach()`` then gives each marker's addresses to the event just before it on its CPU, if
it is the same thread's, and drops the markers. A marker after a record that made no event
(another process's event, a watcher's record such as ``task_newtask``) finds none and goes.
The frames are named in the event's process by ``name`` (the target's symbols).

A read can fall between an event and its marker (the kernel commits them one after the
other): the event would go out with no stack and its marker, in the next read, find no
event (``[no stack]`` in one ``stackcount`` of ten under the test suite). So ``Pairing``
holds back, from each read, the events from the first one that is the last record of its
CPU and not a marker, to be paired in the next read, once only; a final read (the end of a
run) holds nothing back.

Rejected: reading ``trace`` with ``options/sym-userobj`` (text to scrape, and only
``path[+0xoff]``, no function names).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Final

from kprobes.model import Event, StackFrame, UserStack
from kprobes.symbols.resolve import SymbolResolver
from kprobes.tracefs.control import TraceFs
from kprobes.tracefs.eventformat import EventFormat
from kprobes.tracefs.records import Builder
from kprobes.tracefs.session import Session

FORMAT: Final = ("events", "ftrace", "user_stack", "format")
_MARKER: Final = "<user stack trace>"
_END: Final = (0, (1 << 64) - 1)  # an unused entry (0; ULONG_MAX in older kernels)

# Names a stack's addresses in the process of the thread (tid) that made it.
NameStack = Callable[[Sequence[int], int], UserStack]


def enable(fs: TraceFs, session: Session, builders: dict[int, Builder]) -> None:
    """Set ``options/userstacktrace`` in the instance and decode its records as markers."""
    fmt = EventFormat.parse(fs.read(*FORMAT))  # the event id is the same in every instance
    caller = fmt.field("caller")
    count = max(caller.size // 8, 1)
    unpack_callers = struct.Struct(f"<{count}Q").unpack_from
    unpack_tid = struct.Struct("<i").unpack_from
    tid_at, caller_at = fmt.field("common_pid").offset, caller.offset

    def build(page: bytes, start: int, ts: int, cpu: int) -> Event:
        tid = unpack_tid(page, start + tid_at)[0]
        addrs = unpack_callers(page, start + caller_at)
        used = next((i for i, a in enumerate(addrs) if a in _END), len(addrs))
        frames = tuple(StackFrame(a) for a in addrs[:used])
        stop = "depth limit" if used == len(addrs) else ""  # the kernel's 8 are all used
        stack = UserStack(frames, stop)
        return Event("ftrace", _MARKER, 0, tid, "", cpu, ts / 1e9, 0, "", stack=stack)

    builders[fmt.id] = build
    session.write("options/userstacktrace", "1")


def attach(events: list[Event], name: NameStack, depth: int) -> list[Event]:
    """``events`` with each marker's stack given to the event before it on its CPU (the
    same thread's), named by ``name`` and cut to ``depth`` frames; the markers dropped."""
    out: list[Event] = []
    last: dict[int, int] = {}  # cpu -> index in out of the event a marker may follow
    for event in events:
        if event.event != _MARKER or event.group != "ftrace":
            last[event.cpu] = len(out)
            out.append(event)
            continue
        at = last.pop(event.cpu, None)
        if at is None or out[at].tid != event.tid or event.stack is None:
            continue
        addrs = [frame.addr for frame in event.stack.frames]
        stack = name(addrs[:depth], event.tid)
        stop = "depth limit" if len(addrs) > depth else event.stack.stop
        out[at] = out[at]._replace(stack=UserStack(stack.frames, stop))
    return out


class Pairing:
    """``attach`` across reads: what may still get its marker waits for the next read."""

    def __init__(self, name: NameStack, depth: int) -> None:
        self._name = name
        self._depth = depth
        self._held: list[Event] = []

    @property
    def is_holding(self) -> bool:
        return bool(self._held)

    def __call__(self, events: list[Event], *, final: bool = False) -> list[Event]:
        held, self._held = self._held, []
        if held:  # older than the new ones on their CPUs; the merge by time is stable
            events = sorted([*held, *events], key=lambda ev: ev.timestamp)
        if not final:
            cut = _first_unpaired(events, {id(ev) for ev in held})
            events, self._held = events[:cut], events[cut:]
        return attach(events, self._name, self._depth)


def _first_unpaired(events: Sequence[Event], held: set[int]) -> int:
    """The index of the first event that is the last record of its CPU in ``events``, is
    not a marker, and was not held back before (len(events) if none)."""
    last: dict[int, int] = {}
    for i, ev in enumerate(events):
        last[ev.cpu] = i
    cuts = [
        i
        for i in last.values()
        if not (events[i].event == _MARKER and events[i].group == "ftrace")
        and id(events[i]) not in held
    ]
    return min(cuts, default=len(events))


def name_frames(
    addrs: Sequence[int], resolver: SymbolResolver | None, main: str | None
) -> UserStack:
    """The frames of ``addrs`` (the ip, then return addresses) named in ``resolver``'s
    process; ``module`` left empty in the file ``main`` (the program's own)."""
    frames = []
    for i, addr in enumerate(addrs):
        at = addr if i == 0 else addr - 1  # a return address follows its call
        module = None if resolver is None else resolver.get_module_at(at)
        if module is None:
            frames.append(StackFrame(addr))
            continue
        lib = "" if module.path == main else module.name
        found = module.image.function_at(at - module.bias)
        if found is None:
            frames.append(StackFrame(addr, module=lib))
        else:
            symbol, offset = found
            frames.append(StackFrame(addr, symbol.name, offset + addr - at, symbol.size, lib))
    return UserStack(tuple(frames))
