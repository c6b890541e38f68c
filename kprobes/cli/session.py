"""What every tracing subcommand shares: options, spec parsing, the run loop, the summary.

``trace``, ``count``, ``latency`` and ``hist`` differ only in what they do with each event
(the sink) and what they print at the end. The loop here owns the rest: the backend and its
target (``--backend``/``--kernel``, ``-p``/``-c``: ``backends.py``), ``-d`` duration, ``-n``
max events, ``--filter``, SIGINT, SIGTERM and SIGHUP (the run ends at a safe point,
``sigint.py``), a live status line on stderr when it is a terminal, and the
summary that counts every missed hit and every dropped event.

**Ending on time.** A busy program writes records faster than Python prints them, so the
reader may be seconds -- or, on a loaded machine, minutes -- behind. Every ending (``-d``,
``-n``, a signal) therefore goes the same way, in this order: the probes are disabled first
(the program stops writing, and our jumps leave it), what is left is read until
``READ_AFTER_END`` after the end was asked (none after ``-n``), the rest is released and
counted as unread, and only then are the probes removed. Reads during the run stop at each
``run()`` deadline, so ``-d`` and the status line are looked at while the backlog is still
being read. Rejected: reading the whole backlog before ending (``-d 1`` ran for 16 minutes
on a 2-thread program of the test suite, and a SIGKILL after ``timeout`` then left our
jumps in it).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING

from kprobes.cli import startup
from kprobes.cli.backends import Backend, Placed, Sink, add_backend_arguments
from kprobes.cli.notes import summarise
from kprobes.cli.ownfile import in_file
from kprobes.cli.sigint import RunInterrupted, SafeInterrupt
from kprobes.cli.spellings import read_spelling
from kprobes.cli.targets import add_target_arguments, say_pending
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import SpecError, TargetError
from kprobes.model import Event
from kprobes.output.status import format_status, format_summary
from kprobes.spec import FieldKind, ProbeSpec, compile_filter, parse, parse_filter
from kprobes.spec.render import render_location

if TYPE_CHECKING:
    from kprobes.process.specs import BatchOutputs, StackSink

STATUS_PERIOD = 0.5
# How long after the end was asked the events left are still read (the rest is counted
# unread): the whole ending, probes disabled and removed too, must fit in about a second.
READ_AFTER_END = 0.3


class EnoughEvents(Exception):
    """Raised from a handler when ``-n`` events have been seen: ends the run after the hit."""


class OutputClosed(EnoughEvents):
    """The reader of the command's output went away (``| head`` has its lines): the run ends
    as after ``-n``, and what is left is written nowhere."""


def output_closed(stream: IO[str]) -> OutputClosed:
    """``stream``'s reader is gone: its file becomes /dev/null (later writes and the last
    flush go nowhere, quietly), and the exception that ends the run."""
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(fd, stream.fileno())
    finally:
        os.close(fd)
    return OutputClosed()


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, required=False)
    add_backend_arguments(parser)
    parser.add_argument(
        "-x",
        "--exec",
        metavar="PATH",
        help="a bare function name is one of the file PATH (perf probe's -x): 'work' is "
        "'PATH:work', and with --backend uprobes and no -p/-c every process that runs it",
    )
    parser.add_argument("-d", "--duration", type=float, help="stop after SECONDS")
    parser.add_argument("-n", "--max-events", type=int, help="stop after N events")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say each probe that is pending, keeps a breakpoint or is skipped, on a line "
        "of its own (by default, more than 3 of a kind are one line of counts by reason)",
    )
    parser.add_argument(
        "--filter",
        metavar="EXPR",
        help="keep the events EXPR, in the kernel's event filter syntax, accepts "
        "(e.g. 'pid == 42 && comm ~ \"wo*\"'); fields: the probe's arguments, tid (the "
        "thread id, as the kernel's common_pid), pid (the process id), comm and cpu",
    )


def positive_int(text: str) -> int:
    """An option's whole number of 1 or more (``--top N``), for argparse."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # a NaN is not either
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def add_interval_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``-i SECONDS``: print and reset ``what`` every interval (``Session.interval``), as
    bcc's tools do; each interval opens with its time, the last, partial, at the end."""
    parser.add_argument(
        "-i",
        "--interval",
        type=_seconds,
        metavar="SECONDS",
        help=f"print and reset {what} every SECONDS, each interval under its time "
        "(HH:MM:SS); the last, partial, at the end",
    )


_COMMAND = re.compile(r"\s*(?:(?:p|r\d*)(?::\S*)?(?:\s|$)|-:)")


def exec_file(args: argparse.Namespace) -> str | None:
    """The file ``-x PATH`` names (a bare function name is one of it), checked, or None."""
    path: str | None = getattr(args, "exec", None)
    if path is None:
        return None
    if not os.path.isfile(path):
        raise TargetError(f"-x {path}: no such file", errno=errno.ENOENT)
    return os.path.realpath(path)


def parse_spec(text: str) -> ProbeSpec:
    """A probe line; a bare location (``libc:malloc size=%di``) means ``p LOCATION``; a
    peer's spelling is read as ours (spellings.py)."""
    given, text = text, read_spelling(text)
    if text != given:
        try:
            return parse_spec(text)
        except SpecError as exc:  # the column of the line as written is unknown
            raise SpecError(exc.message, column=0, text=given, hint=exc.hint) from exc
    if _COMMAND.match(text):
        return parse(text)
    try:
        return parse("p " + text)
    except SpecError as exc:
        raise SpecError(
            exc.message, column=max(exc.column - 2, 0), text=text, hint=exc.hint
        ) from exc


# What --filter may name besides the kernel's common fields (common_pid, comm, cpu) and the
# probe's arguments (which win over a field of the same name, as in the kernel): the
# spellings of bpftrace and perf. The filter runs here, on every backend, so the kernel's
# filter grammar need not know them.
CLI_FIELDS: dict[str, FieldKind] = {"tid": FieldKind.NUMBER, "pid": FieldKind.NUMBER}


def event_fields(event: Event) -> dict[str, object]:
    fields: dict[str, object] = {
        "common_pid": event.tid,
        "tid": event.tid,
        "pid": event.pid,
        "comm": event.comm,
        "cpu": event.cpu,
    }
    for arg in event.args:
        fields[arg.name] = arg.value
    return fields


def event_fields_source(pid: int, names: Sequence[str]) -> str:
    """``event_fields`` as the source of a dict display over ``tid``, ``cpu``,
    ``o_comm(tid)`` and the values ``v0``, ``v1``... of an event of process ``pid`` whose
    arguments are ``names``: what the batch path's filter reads (the same keys in the same
    order, an argument over a common field of its name)."""
    parts = ['"common_pid": tid', '"tid": tid', f'"pid": {int(pid)}']
    parts += ['"comm": o_comm(tid)', '"cpu": cpu']
    parts += [f"{name!r}: v{i}" for i, name in enumerate(names)]
    return "{" + ", ".join(parts) + "}"


_CLOSED = "its output closed"  # ended_by when the output's reader went away


def _enough(exc: EnoughEvents, max_events: int | None) -> str:
    """What ended a run that had enough events: ``-n``, or its output's reader."""
    return _CLOSED if isinstance(exc, OutputClosed) else f"-n {max_events}"


def compile_event_filter(
    text: str | None, specs: Sequence[ProbeSpec]
) -> Callable[[dict[str, object]], bool] | None:
    """``--filter TEXT`` over the events of ``specs`` (``event_fields``), compiled; None
    without a filter."""
    if not text:
        return None
    fields = dict(CLI_FIELDS)
    for spec in specs:
        fields.update(spec.filter_fields)
    return compile_filter(parse_filter(text, fields))


def take_program_hist(
    placed: Sequence[Placed], seen: dict[int, tuple[tuple[int, ...], int]], nslots: int = 65
) -> tuple[list[int], int]:
    """What the optimized return probes among ``placed`` aggregated in the program since
    the last call (``seen`` keeps where each was): its slots' counts (the 65 log2 ones, or
    ``nslots`` linear ones) and its sum."""
    slots, total = [0] * nslots, 0
    for p in placed:
        rp = getattr(p, "probe", None)
        if not isinstance(rp, Kretprobe) or len(rp.hist_slots) != nslots:
            continue
        before, before_total = seen.get(id(rp), ((0,) * len(rp.hist_slots), 0))
        for i, (now, was) in enumerate(zip(rp.hist_slots, before, strict=True)):
            slots[i] += now - was
        total += rp.hist_total - before_total
        seen[id(rp)] = (rp.hist_slots, rp.hist_total)
    return slots, total


class Session:
    """One run of a tracing command against its processes (or the kernel)."""

    def __init__(self, args: argparse.Namespace, specs: Sequence[ProbeSpec]) -> None:
        self.args = args
        exe = exec_file(args)
        self.specs = [in_file(spec, exe) for spec in specs] if exe else list(specs)
        self.events = 0
        self.filtered = 0  # did not pass --filter
        self.unprinted = 0  # read after -n was reached
        self.ended_by = ""  # what ended the run early: "-n 100", "-d 1", "SIGTERM"
        self.verb = "printed"  # what the command does with an event (the summary says it)
        # Called before the status line and the summary: brings ``events`` up to date
        # (count's in-place counters).
        self.refresh: Callable[[], None] = lambda: None
        # The hits a result counted (count's last table): the summary says the same, not the
        # hits the program made while the probes were taken out, which are past the end.
        self.frozen_hits: int | None = None
        self.started = time.monotonic()
        self.ended: float | None = None  # when the run ended (the probes' removal is not in it)
        self.program_ended = False  # the traced program ended by itself (not -d, -n, a signal)
        self.nothing_placed = False  # with -c: no probe was ever placed (say_never_placed)
        self.handle: Callable[[Event], None] = lambda ev: None
        self.report: Callable[[], None] = lambda: None  # the command's result, at the end
        self.on_interval: Callable[[], None] | None = None
        self.interval: float | None = None
        self._filter = self._compile_filter(args.filter, self.specs)
        self._max = args.max_events
        self._status = sys.stderr.isatty()
        self.backend: Backend | None = None
        # Called with the open backend before the specs are placed: may place more itself
        # (glob patterns, one by one, skipping those that cannot be placed).
        self.prepare: Callable[[Backend], None] | None = None
        self.patterns: list[str] = []  # the globs ``prepare`` places (they may name the file)
        self.entry_times = False  # return events must carry entry_timestamp (latency)
        self.wall_clock = False  # the events are wanted on the wall clock (trace -T)
        # CLOCK_REALTIME minus the events' clock, measured once as the run starts
        # (wallclock.py); None until then, and without ``wall_clock``.
        self.wall_offset_ns: int | None = None
        # Takes a spec's events as rows, a batch at a time, in place of ``sink`` and
        # ``handle`` (our own backend's record probes, process/fast/batch.py): what ``trace``
        # gives where nothing is asked of each event but its line and ``event_filter``;
        # never with -n, which the sink applies. Its writer counts the events it is given
        # and those the filter left out.
        self.batch: BatchOutputs | None = None
        # Takes an event that stands for ``count`` hits of its stack, where our own backend
        # counts hits by stack in the program (``stackcount``: process/fast/stackcounts.py);
        # never with -n or --filter, which need each hit as an event.
        self.handle_counted: StackSink | None = None
        # Called after each poll of our own backend's rings: the events' stream flushed.
        self.flush: Callable[[], None] = lambda: None
        self._interrupt = SafeInterrupt()

    @staticmethod
    def _compile_filter(
        text: str | None, specs: Sequence[ProbeSpec]
    ) -> Callable[[dict[str, object]], bool] | None:
        return compile_event_filter(text, specs)

    @property
    def event_filter(self) -> Callable[[dict[str, object]], bool] | None:
        """``--filter``, compiled: over ``event_fields`` of an event, keep it or not."""
        return self._filter

    @property
    def interrupted(self) -> bool:
        """SIGINT came: placing stops between two probes, the run ends at a safe point."""
        return self._interrupt.interrupted

    def sink(self, event: Event) -> None:
        if self._max is not None and self.events >= self._max:
            self.unprinted += 1
            raise EnoughEvents  # a kernel backend delivers the rest of its batch
        if self._filter is None or self._filter(event_fields(event)):
            self.events += 1
            self.handle(event)
            if self._max is not None and self.events >= self._max:
                raise EnoughEvents  # from a handler: the tracer finishes the hit first
        else:
            self.filtered += 1

    def _sink_counted(self, event: Event, count: int) -> None:
        assert self.handle_counted is not None and self._max is None and self._filter is None
        self.events += count
        self.handle_counted(event, count)

    def run(self) -> None:
        interrupt = self._interrupt
        with interrupt.installed():
            self.backend = backend = open_backend(
                self.args,
                self.sink,
                self.specs,
                entry_times=self.entry_times,
                patterns=self.patterns,
                batch=self.batch if self._max is None else None,
                stack_counts=self._sink_counted if self.handle_counted is not None else None,
                flush=self.flush,
            )
            interrupt.end_run = backend.end_run
            interrupt.is_mid_hit = backend.is_mid_hit
            interrupt.on_late_signal = lambda: backend.set_reading_deadline(
                time.monotonic() + READ_AFTER_END
            )
            asked: float | None = time.monotonic()  # a failure: nothing more is read
            try:
                asked = self._run(backend)
            finally:
                interrupt.is_over = True  # before any call (sigint.py)
                interrupt.quiet()
                try:
                    self.ended = time.monotonic()
                    self._end(backend, asked)
                    self.say_never_placed(backend)
                    self.report()  # before the probes go: the kernel's take minutes by the 1,000
                finally:
                    try:
                        backend.close()
                        for line in backend.left_behind():
                            sys.stderr.write(f"kprobes: {line}\n")
                    finally:
                        backend.end_command()
                    if self._status:
                        sys.stderr.write("\r\x1b[K")

    def _run(self, backend: Backend) -> float | None:
        """Place the probes and run; when the end was asked (None: the program ended)."""
        interrupt = self._interrupt
        asked: float | None
        try:
            if self.wall_clock:
                from kprobes.cli.wallclock import realtime_offset_ns  # -T's alone

                self.wall_offset_ns = realtime_offset_ns(backend.event_clock)
            if self.prepare is not None:
                self.prepare(backend)
            if not interrupt.interrupted:
                placed = backend.place(self.specs)
                verbose = bool(getattr(self.args, "verbose", False))
                say_pending(
                    (getattr(p, "probe", None) for p in placed),
                    (
                        render_location(p.spec.location) if p.spec.location else p.name
                        for p in placed
                    ),
                    verbose=verbose,
                )
                notes = backend.placement_notes()
                for line in summarise(
                    notes, one="uses a breakpoint", many="use a breakpoint", verbose=verbose
                ):
                    sys.stderr.write(f"kprobes: {line}\n")
            interrupt.is_placing = False
            asked = interrupt.asked_at if interrupt.interrupted else self._loop(backend)
            interrupt.is_over = True  # each way out of the loop says so first (sigint.py)
        except EnoughEvents as exc:
            interrupt.is_over = True
            self.ended_by = _enough(exc, self._max)
            asked = time.monotonic()
        except (KeyboardInterrupt, RunInterrupted):
            interrupt.is_over = True
            asked = time.monotonic()
        if interrupt.interrupted:  # SIGINT/TERM/HUP, whatever part of the run saw it
            self.ended_by = interrupt.signal.name if interrupt.signal else "SIGINT"
            asked = interrupt.asked_at
        return asked

    def _end(self, backend: Backend, asked: float | None) -> None:
        """The way out of a run (see the module's docstring): the probes disabled, what is
        left read until ``READ_AFTER_END`` after ``asked`` (none after ``-n``), the rest
        counted unread. With ``asked`` None (the program ended) everything left is read."""
        if self.ended_by.startswith(("-n", _CLOSED)):
            backend.discard_backlog()  # and what comes until the probes are removed
            return
        backend.stop()
        if asked is None and self._interrupt.interrupted:  # came while the probes went
            asked = self._interrupt.asked_at
        until = float("inf") if asked is None else asked + READ_AFTER_END
        try:
            backend.read_rest(until)  # a signal now brings ``until`` nearer (on_late_signal)
        except EnoughEvents as exc:
            self.ended_by = self.ended_by or _enough(exc, self._max)
            backend.discard_backlog()
        signal = self._interrupt.signal
        if signal is not None and not self.ended_by:
            self.ended_by = signal.name  # it came while the rest was being read

    @property
    def _runs_command(self) -> bool:
        return getattr(self.args, "command", None) is not None

    def exit_status(self) -> int:
        """The command's: 0, or with ``-c``, when the program ended by itself, its exit code
        (128 + the signal that killed it), as strace and ``bpftrace -c`` do; 1 when no probe
        was ever placed (``say_never_placed``). Call after ``run()``."""
        backend = self.backend
        if self.nothing_placed:
            return 1
        if not self.program_ended or backend is None or not self._runs_command:
            return 0
        code = backend.command_exit
        if code is None:
            return 0
        return code if code >= 0 else 128 - code

    def say_never_placed(self, backend: Backend) -> None:
        """With ``-c``, at the end: each probe that was never placed, and why."""
        if not self._runs_command:
            return
        never = backend.never_placed()
        for name, why in never:
            sys.stderr.write(f"kprobes: {name} was never placed: {why}\n")
        specs = {id(p.spec) for p in backend.placed}  # a followed child's copies: one spec
        wanted = len(specs) + len(backend.watched)  # and the globs still waiting
        self.nothing_placed = bool(never) and len(never) == wanted

    @property
    def placed(self) -> list[Placed]:
        return self.backend.placed if self.backend is not None else []

    def _loop(self, backend: Backend) -> float | None:
        """Run until the program ends (None) or ``-d`` passes (the deadline); ``-n`` and the
        signals end it by an exception."""
        # -d counts from the probes' going live: attaching to a busy program on a loaded
        # machine can take seconds, and they are not the tracing asked for.
        live = self.started = time.monotonic()  # rates and the summary's time from here
        duration: float | None = self.args.duration
        deadline = None if duration is None else live + duration
        next_tick = None if self.interval is None else live + self.interval
        periodic = self._status or next_tick is not None
        while True:
            now = time.monotonic()
            waits = [t - now for t in (deadline, next_tick) if t is not None]
            if self._status:
                waits.append(STATUS_PERIOD)
            timeout = max(min(waits), 0.0) if waits else None
            done = backend.run(timeout)
            now = time.monotonic()
            if self._status:
                self._print_status(now)
            if next_tick is not None and now >= next_tick and self.on_interval is not None:
                self.on_interval()
                next_tick += self.interval or 0.0
            if done:
                self.program_ended = True
                ended = backend.how_it_ended()
                if ended:
                    clear = "\r\x1b[K" if self._status else ""  # the status line first
                    sys.stderr.write(f"{clear}kprobes: {ended}\n")
                return None
            if deadline is not None and now >= deadline:
                self.ended_by = f"-d {duration:g}"
                return deadline
            if self.interrupted or (not periodic and timeout is None):
                return now

    def _print_status(self, now: float) -> None:
        self.refresh()
        elapsed = max(now - self.started, 1e-9)
        hits, dropped = self.hits, self.dropped
        behind = hits - self.events - self.filtered - dropped - self.unread
        if any(p.spec.is_return for p in self.placed):
            behind = 0  # entries count as hits, and calls in flight have no event yet
        sys.stderr.write(
            format_status(
                self.events, self.events / elapsed, hits, self.missed, dropped, behind=behind
            )
        )
        sys.stderr.flush()

    @property
    def hits(self) -> int:
        if self.frozen_hits is not None:
            return self.frozen_hits
        return sum(p.hits for p in self.placed)

    @property
    def missed(self) -> int:
        return sum(p.missed for p in self.placed)

    @property
    def dropped(self) -> int:
        return self.backend.dropped if self.backend is not None else 0

    @property
    def unread(self) -> int:
        return self.backend.unread if self.backend is not None else 0

    def summary(self) -> str:
        if self.frozen_hits is None:
            self.refresh()
        text = format_summary(
            events=self.events,
            hits=self.hits,
            misses=self.missed,
            dropped=self.dropped,
            duration=(self.ended or time.monotonic()) - self.started,
            missed_by_probe={p.name: p.missed for p in self.placed},
            unprinted=self.unprinted,
            unread=self.unread,
            filtered=self.filtered,
            ended_by=self.ended_by,
            verb=self.verb,
        )
        for p in self.placed:
            if p.spec.is_return and p.missed:
                text += _return_miss_hint(p)
        return text


def _return_miss_hint(placed: Placed) -> str:
    """What to do about a return probe's misses: most are calls that found no free instance."""
    n = placed.spec.maxactive
    if n:
        return (
            f"hint: {placed.name} follows at most {n} calls at once (r{n}) and missed "
            f"{placed.missed}: give a larger N, or leave rN out (latency: --maxactive N)\n"
        )
    return (
        f"hint: {placed.name} missed {placed.missed} calls: give more instances with rN in "
        "the probe line (latency: --maxactive N)\n"
    )


def open_backend(
    args: argparse.Namespace,
    sink: Sink,
    specs: Sequence[ProbeSpec],
    *,
    entry_times: bool = False,
    patterns: Sequence[str] = (),
    batch: BatchOutputs | None = None,
    stack_counts: StackSink | None = None,
    flush: Callable[[], None] = lambda: None,
) -> Backend:
    """The backend the options ask for (``--backend``/``--kernel``, ``-p``/``-c``);
    ``patterns`` are the globs that will be placed too (``count``); ``batch``, the outputs
    that take a spec's events as rows (our own backend's records: ``Session.batch``);
    ``stack_counts``, what takes the stacks our own backend counts in the program; ``flush``,
    called after each poll of our own backend's rings."""
    if args.backend == "ptrace":
        if args.pids is None and args.command is None:
            raise TargetError(
                "the ptrace backend probes processes: give -p PID[,PID...] or -c CMD (or "
                "--kernel, or --backend uprobes with /PATH:SYMBOL specs)",
                errno=errno.EINVAL,
            )
        # Each backend is imported when chosen: ``--help`` needs neither, the ptrace
        # backend's commands need none of tracefs, and the kernel's none of the engine.
        from kprobes.cli.ptrace_backend import PtraceBackend

        startup.settled()
        return PtraceBackend(args, sink, batch, stack_counts, flush)
    from kprobes.cli.tracefs_backend import TraceFsBackend

    startup.settled()
    return TraceFsBackend(args, sink, specs, entry_times=entry_times, patterns=patterns)
