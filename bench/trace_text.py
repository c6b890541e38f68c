"""The peer of our binary decoding: the kernel's ``trace_pipe`` text, parsed back into events.

This is what a tool that scrapes ftrace's text does. The kernel formats every record when
``trace_pipe`` is read (``print_uprobe_event``/``print_kprobe_event`` after the context
columns of ``trace_print_context``)::

    decode_target-29225 [000] DBZff 5087.652355: p_decode_work_0x0: (0x5573ff7b1330) n=0 s="a b"
    <comm>-<tid> [<cpu>] <flags> <seconds.microseconds>: <event>: (<place>) <name>=<value> ...

and the parser here turns each line back into the ``Event`` value our decoder makes from the
binary record: one regular expression per line, the arguments split into name=value pairs
(a quoted string may hold spaces), each value converted by its fetch type. The place is an
address for a uprobe and ``sym+off/size`` for a kprobe; what the line lacks (the process id,
the other half of the place) comes from the registration, as our decoder has it. Events are
built the way ours are (``tuple.__new__``, the collector paused), so the two paths differ only
in what they read.

The text is lossy where the binary is not: timestamps are rounded to the microsecond
(``ns2usecs``), and a string holding ``"`` or `` x=`` cannot be split back reliably.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kprobes.model import ArgValue, Event, EventArg
from kprobes.tracefs.control import TraceFs

_LINE = re.compile(
    r"^\s*(?P<comm>.+)-(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+"
    r"(?P<event>\w+):\s+\((?P<where>[^)]*)\)(?P<args>.*)$",
    re.MULTILINE,
)
_ARG = re.compile(r'(\w+)=("[^"]*"|\{[^}]*\}|\S+)')
FAULT = "(fault)"

Converter = Callable[[str], ArgValue]


def _hex(text: str) -> int:
    return int(text, 16)


def _string(text: str) -> str:
    return text[1:-1]


def _char(text: str) -> int:
    return ord(text[1])


def converter(typ: str) -> Converter:
    """How a value of fetch type ``typ`` is printed, undone."""
    if "[" in typ:
        one = converter(typ.split("[")[0])

        def array(text: str) -> ArgValue:
            return tuple(None if v == FAULT else one(v) for v in text[1:-1].split(","))

        return array
    if typ in ("string", "ustring", "symstr", "symbol"):
        return _string if typ != "symbol" else str
    if typ == "char":
        return _char
    if typ.startswith("x"):
        return _hex
    return int


@dataclass(frozen=True, slots=True)
class EventText:
    """What the parser needs to know of one event besides its lines."""

    arg_names: tuple[str, ...]
    arg_types: tuple[str, ...]
    location: str  # used when the line shows an address (uprobes)
    ip: int  # used when the line shows sym+off/size (kprobes)


class TextParser:
    """``trace_pipe`` text of one session's events → ``Event`` values."""

    def __init__(
        self, group: str, events: dict[str, EventText], who: Callable[[int], tuple[int, str]]
    ) -> None:
        self.group = group
        self.events = {
            name: (e, tuple(converter(t) for t in e.arg_types)) for name, e in events.items()
        }
        self.who = who

    def parse(self, text: str) -> list[Event]:
        new = tuple.__new__
        group, events, who = self.group, self.events, self.who
        pids: dict[int, int] = {}
        out: list[Event] = []
        append = out.append
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            for m in _LINE.finditer(text):
                comm, tid_text, cpu, ts, name, where, rest = m.groups()
                known = events.get(name)
                if known is None:
                    continue
                spec, converters = known
                tid = int(tid_text)
                pid = pids.get(tid)
                if pid is None:
                    pid = pids[tid] = who(tid)[0]
                if where.startswith("0x"):
                    ip, location = int(where, 16), spec.location
                else:
                    ip, location = spec.ip, where
                found = dict(_ARG.findall(rest))
                names, types = spec.arg_names, spec.arg_types
                args = tuple(
                    new(EventArg, (n, t, None if (v := found[n]) == FAULT else convert(v)))
                    for n, t, convert in zip(names, types, converters, strict=True)
                )
                fields = (group, name, pid, tid, comm, int(cpu), float(ts), ip, location, args)
                append(new(Event, (*fields, False, "", 0, 0.0, None, None, None)))
        finally:
            if collecting:
                gc.enable()
        return out


@contextlib.contextmanager
def text_instance(fs: TraceFs, name: str, event: str, *, buffer_kb: int) -> Iterator[str]:
    """A second tracefs instance recording ``event`` (GROUP/EVENT) for the text peer; yields the
    path of its ``trace_pipe``. Made and removed in reverse order; control files are written
    in append mode (never O_TRUNC)."""
    instance = fs.path("instances", name)
    os.mkdir(instance)
    try:
        rel = os.path.join("instances", name)
        if "mono" in fs.read(rel, "trace_clock"):
            fs.write(f"{rel}/trace_clock", "mono")  # our instance's clock: same timestamps
        fs.write(f"{rel}/buffer_size_kb", str(buffer_kb))
        enable = f"{rel}/events/{event}/enable"
        fs.write(enable, "1")
        try:
            yield os.path.join(instance, "trace_pipe")
        finally:
            fs.write(enable, "0")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(instance)


def read_trace_pipe(path: str, chunk: int = 1 << 16) -> str:
    """Everything ``trace_pipe`` holds now (consumed), as the kernel formats it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    parts = []
    try:
        while True:
            try:
                data = os.read(fd, chunk)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    break
                raise
            if not data:
                break
            parts.append(data)
    finally:
        os.close(fd)
    return b"".join(parts).decode("utf-8", "replace")
