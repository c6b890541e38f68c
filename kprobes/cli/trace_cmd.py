"""``kprobes trace SPEC...``: print every event, in the kernel's trace format or as JSON lines.

    kprobes trace -c ./prog 'p:alloc libc:malloc size=%di:u64' 'r libc:malloc ptr=$retval'

Each line is what the kernel's ``trace`` file shows for the same probe
(``comm-pid [cpu] timestamp: EVENT: (sym+off/size) name=value``; returns as
``(caller+off/size <- func)``), or with ``--json`` one object per line. A probe line may end
with its own line, printf style, as bcc's ``trace`` (``'p work i=%di "i=%d", i'``:
formats.py). ``-T`` prints the time as the wall clock's, ``HH:MM:SS.ffffff`` local time, in
place of the event clock's seconds (``"time"`` in ISO 8601 added to the JSON; before a
probe's own line, as bcc's ``-T`` adds its TIME column), as bcc's ``trace -T``: the hit's
time, through an offset measured once (wallclock.py). ``--perfetto FILE`` also writes a trace
for ui.perfetto.dev with entry/return pairs as slices per thread.

``-U``/``--stack`` adds each event's user stack, as the kernel's ``userstacktrace`` option
prints it after the event (output/stacks.py): in the text, a ``<user stack trace>`` line and
a `` => func+0xOFF/0xSIZE [module]`` line per frame; ``"stack"`` in the JSON; ``stack`` in
the args of the Perfetto trace. How each backend takes them: stack_options.py.

``--block`` keeps every event of a hot function: a hit that finds the ring full waits for the
reader to make room instead of being dropped (process/fast/recording.py), for as long as the
reader reads: the program runs at the reader's pace, and a tool that dies or is stopped
releases it within half a second (shared_area.py's lease).
"""

from __future__ import annotations

import argparse
import errno
import io
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, Protocol

from kprobes.cli.formats import Printer, parse_traced
from kprobes.cli.session import (
    Session,
    add_common_arguments,
    event_fields_source,
    output_closed,
)
from kprobes.cli.stack_options import add_stack_arguments, prepare_stacks
from kprobes.errors import SpecError, TargetError
from kprobes.model import Event
from kprobes.output.jsonl import format_json
from kprobes.output.perfetto import PerfettoWriter
from kprobes.output.rows import ReturnHead, json_line, text_line
from kprobes.output.stacks import USER_STACK, format_stack_lines
from kprobes.output.text import format_context, format_event, format_wallclock
from kprobes.spec import ProbeSpec, SymbolLocation

if TYPE_CHECKING:
    from kprobes.process.fast.batch import LineFormat, RowLayout


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("trace", help=help)
    add_trace_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    add_output_arguments(p)
    p.set_defaults(func=run)


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The probe lines and the options that choose the events (``trace``'s and
    ``record``'s)."""
    p.add_argument(
        "specs",
        nargs="+",
        metavar="SPEC",
        help='kprobe_events-style probe lines, each maybe ending with its own line: "FORMAT", '
        "NAME, ... as bcc's trace (%%d %%u %%x %%s %%c %%p %%f, flags, width, l/ll/h/hh); a "
        "NAME is an argument of the probe, tid, pid, comm, cpu, time, probe, func, arg1-arg6 "
        "(bcc's), $retval",
    )
    add_common_arguments(p)
    add_stack_arguments(p, optional=True)
    p.add_argument(
        "--block",
        action="store_true",
        help="lose no event: a hit that finds the ring full waits until the tool has read "
        "(by default it is dropped and counted, as perf's lost events). The program then "
        "runs at the tool's pace; if the tool dies or is stopped, the program goes on (and "
        "drops) within half a second. ptrace backend only",
    )


def check_block(args: argparse.Namespace) -> None:
    """``--block`` is our own backend's (``trace``'s and ``record``'s)."""
    if args.block and args.backend != "ptrace":
        raise TargetError(
            "--block makes our own optimized probes wait for room in their ring: the kernel's "
            "ring buffer drops (or overwrites) when full, and cannot make the program wait "
            "(give the ptrace backend)",
            errno=errno.EINVAL,
        )


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """How the events are printed besides ``--json`` (``trace``'s and ``script``'s)."""
    p.add_argument(
        "-T",
        "--timestamp",
        action="store_true",
        help="the time of each hit on the wall clock, HH:MM:SS.ffffff local time, in place "
        'of the seconds of the event clock (with --json, "time" in ISO 8601 is added)',
    )
    p.add_argument("--perfetto", metavar="FILE", help="also write a Perfetto (JSON) trace")


class EventCounts(Protocol):
    """What ``TraceRows`` counts its events in, and the filter it applies (a ``Session``)."""

    events: int
    filtered: int

    @property
    def event_filter(self) -> Callable[[dict[str, object]], bool] | None: ...


class TraceRows:
    """``trace``'s lines for the events our own backend's records give a batch at a time
    (process/fast/batch.py, output/rows.py): the bytes ``handle`` writes for them, written a
    batch at a time, and counted as the session's events."""

    def __init__(self, session: EventCounts, out: IO[str], *, json: bool) -> None:
        self.session = session
        self.out = out
        self.json = json

    def writer(self, layout: RowLayout) -> LineFormat | None:
        args = (layout.names, layout.types, layout.plain, layout.comm)
        returns = None
        if layout.is_return and layout.locate is not None:  # records of returns
            returns = ReturnHead(layout.func, layout.func_ip, layout.locate)
        if self.json:
            line = json_line(f"{layout.group}/{layout.event}", layout.pid, *args, returns)
        else:
            line = text_line(layout.event, *args, returns)
        if line is None:
            return None
        session, out, write = self.session, self.out, self.out.write
        names, keep = dict(line.names), ""
        if session.event_filter is not None:  # --filter, on the same fields as the sink's
            names["o_filter"], names["o_comm"] = session.event_filter, layout.comm
            keep = f"o_filter({event_fields_source(layout.pid, layout.names)})"

        def write_lines(text: str, printed: int, left_out: int) -> None:
            session.events += printed
            session.filtered += left_out
            try:
                write(text)
            except BrokenPipeError:  # | head: it has what it wanted
                raise output_closed(out) from None

        # the ptrace backend's, when it runs
        from kprobes.process.fast.batch import LineFormat
        from kprobes.process.fast.columns import ColumnFormat

        t, columns = line.template, None
        if t is not None and not keep:  # the same line, for a reader of columns
            columns = ColumnFormat(t.line, t.show, t.stamp)
        return LineFormat(
            line.expr, line.setup, line.context, names, write_lines, keep, columns, not keep
        )


def parse_specs(texts: Sequence[str], *, as_json: bool) -> TracedSpecs:
    """The probe lines, and each probe's own line by its event's name (refused with
    ``--json``: two outputs)."""
    parsed = [parse_traced(text) for text in texts]
    own = {spec.effective_event: printer for spec, printer in parsed if printer is not None}
    if own and as_json:
        text = next(t for t, (_, printer) in zip(texts, parsed, strict=True) if printer)
        raise SpecError(
            "a probe's own line and --json are two outputs: give one",
            column=text.index('"'),
            text=text,
        )
    return [spec for spec, _ in parsed], own


TracedSpecs = tuple[list[ProbeSpec], dict[str, Printer]]
# Seconds after a flush from which the next event written flushes too: where no poll of the
# rings flushes (every probe on the trap tier), a slow stream's lines still come one by one
# and a fast one's in blocks. Left: the last events of a burst wait for the next event (or
# the end): the tracer sleeps in waitpid, and a timed wait would cost every hit syscalls.
FLUSH_EVERY = 0.05


class TraceOutput:
    """What ``trace`` prints of its events (``handle``, and rows through ``batch``), for
    a session or for a record file (``script``); ``wall`` gives the wall clock's offset
    (``-T``) once it is known."""

    def __init__(
        self,
        args: argparse.Namespace,
        traced: TracedSpecs,
        counts: EventCounts,
        wall: Callable[[], int | None],
        out: IO[str],
    ) -> None:
        specs, self.own = traced
        self.out = out
        self.json = bool(args.json)
        self.wall = wall
        self.perfetto_file: IO[str] | None = None
        self.perfetto: PerfettoWriter | None = None
        if args.perfetto:
            self.perfetto_file = open(args.perfetto, "w")  # noqa: SIM115 - closed in close()
            returns = {
                s.location.symbol
                for s in specs
                if s.is_return and isinstance(s.location, SymbolLocation)
            }
            self.perfetto = PerfettoWriter(self.perfetto_file, return_funcs=returns)
        self.fmt = format_json if args.json else format_event
        # Events that need nothing but their line: our own backend's records, as rows.
        plain = not (args.timestamp or args.stack or self.perfetto is not None)
        self.rows = TraceRows(counts, out, json=args.json) if plain else None
        self._flush_due = 0.0  # an event written from then on flushes (``handle``)

    def handle(self, ev: Event) -> None:
        try:
            self._write(ev)
        except BrokenPipeError:  # | head: it has what it wanted
            raise output_closed(self.out) from None
        if time.monotonic() >= self._flush_due:  # no poll flushes (the trap tier alone)
            self.flush()

    def _write(self, ev: Event) -> None:
        out, wall = self.out, self.wall()
        printer = self.own.get(ev.event)
        if printer is None:
            out.write(self.fmt(ev, wall_offset_ns=wall) + "\n")
        elif wall is None:
            out.write(printer(ev) + "\n")
        else:  # bcc's -T: the time before the line
            out.write(f"{format_wallclock(ev.timestamp, wall)} {printer(ev)}\n")
        if ev.stack is not None and not self.json:
            lines = [format_context(ev, wall_offset_ns=wall) + USER_STACK]
            out.write("\n".join([*lines, *format_stack_lines(ev.stack)]) + "\n")
        if self.perfetto is not None:
            self.perfetto.write(ev)

    def batch(self, spec: ProbeSpec) -> TraceRows | None:
        """The rows output of ``spec``'s events, where they need nothing but their line."""
        return None if spec.effective_event in self.own else self.rows

    def flush(self) -> None:
        """What was written goes to the file (after each poll of the rings: a pipe's reader
        sees the events within a poll's time)."""
        try:
            self.out.flush()
        except BrokenPipeError:
            raise output_closed(self.out) from None
        self._flush_due = time.monotonic() + FLUSH_EVERY

    def close(self) -> None:
        try:
            self.out.flush()
        except BrokenPipeError:
            output_closed(self.out)
        if self.perfetto is not None and self.perfetto_file is not None:
            self.perfetto.close()
            self.perfetto_file.close()


def run(args: argparse.Namespace) -> int:
    traced = parse_specs(args.specs, as_json=args.json)
    check_block(args)
    header = prepare_stacks(args) if args.stack else ""
    session = Session(args, traced[0])
    session.wall_clock = args.timestamp
    out = event_stream()
    if header and not args.json:
        out.write(header)
    output = TraceOutput(args, traced, session, lambda: session.wall_offset_ns, out)
    session.handle = output.handle
    session.flush = output.flush
    if output.rows is not None:
        session.batch = output.batch
    try:
        session.run()
    finally:
        output.close()
    sys.stderr.write(session.summary())
    return session.exit_status()


def event_stream() -> IO[str]:
    """stdout for a stream of events: a terminal's as it is (a line at a time), a file's or
    a pipe's through a buffer of our own (64 KiB), flushed after each poll of the rings and
    at the end. Python's own writes each line by itself under ``PYTHONUNBUFFERED`` (``-u``):
    a syscall an event, a trace into a file took twice the time; without it, a pipe's
    reader saw nothing until 8 KiB had come."""
    stdout = sys.stdout
    try:
        if stdout.isatty():
            return stdout
        fd = stdout.fileno()
    except (AttributeError, io.UnsupportedOperation):
        return stdout  # not a file (a test's StringIO)
    stdout.flush()
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw, 1 << 16), encoding=stdout.encoding, errors=stdout.errors
    )
