"""What every tracing subcommand shares: options, spec parsing, the run loop, the summary.

``trace``, ``count``, ``latency`` and ``hist`` differ only in what they do with each event
(the sink) and what they print at the end. The loop here owns the rest: the backend and its
target (``--backend``/``--kernel``, ``-p``/``-c``: ``backends.py``), ``-d`` duration, ``-n``
max events, ``--filter``, SIGINT (Ctrl-C, or ``kill -INT``: the run ends at a safe point,
``sigint.py``), a live status line on stderr when it is a terminal, and the
summary that counts every missed hit and every dropped event.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence

from kprobes.cli.backends import Backend, Placed, add_backend_arguments, open_backend
from kprobes.cli.sigint import RunInterrupted, SafeInterrupt
from kprobes.cli.targets import add_target_arguments, say_pending
from kprobes.errors import SpecError
from kprobes.model import Event
from kprobes.output.status import format_status, format_summary
from kprobes.spec import FieldKind, ProbeSpec, compile_filter, parse, parse_filter
from kprobes.spec.render import render_location

STATUS_PERIOD = 0.5


class EnoughEvents(Exception):
    """Raised from a handler when ``-n`` events have been seen: ends the run after the hit."""


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, required=False)
    add_backend_arguments(parser)
    parser.add_argument("-d", "--duration", type=float, help="stop after SECONDS")
    parser.add_argument("-n", "--max-events", type=int, help="stop after N events")
    parser.add_argument("--filter", metavar="EXPR", help="the kernel's event filter syntax")


_COMMAND = re.compile(r"\s*(?:(?:p|r\d*)(?::\S*)?(?:\s|$)|-:)")


def parse_spec(text: str) -> ProbeSpec:
    """A probe line; a bare location (``libc:malloc size=%di``) means ``p LOCATION``."""
    if _COMMAND.match(text):
        return parse(text)
    try:
        return parse("p " + text)
    except SpecError as exc:
        raise SpecError(exc.message, column=max(exc.column - 2, 0), text=text) from exc


def event_fields(event: Event) -> dict[str, object]:
    fields: dict[str, object] = {
        "common_pid": event.tid,
        "comm": event.comm,
        "cpu": event.cpu,
    }
    for arg in event.args:
        fields[arg.name] = arg.value
    return fields


class Session:
    """One run of a tracing command against one process."""

    def __init__(self, args: argparse.Namespace, specs: Sequence[ProbeSpec]) -> None:
        self.args = args
        self.specs = list(specs)
        self.events = 0
        self.started = time.monotonic()
        self.handle: Callable[[Event], None] = lambda ev: None
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
        self._interrupt = SafeInterrupt()

    @staticmethod
    def _compile_filter(
        text: str | None, specs: Sequence[ProbeSpec]
    ) -> Callable[[dict[str, object]], bool] | None:
        if not text:
            return None
        fields: dict[str, FieldKind] = {}
        for spec in specs:
            fields.update(spec.filter_fields)
        return compile_filter(parse_filter(text, fields))

    @property
    def interrupted(self) -> bool:
        """SIGINT came: placing stops between two probes, the run ends at a safe point."""
        return self._interrupt.interrupted

    def sink(self, event: Event) -> None:
        if self._max is not None and self.events >= self._max:
            raise EnoughEvents  # a kernel backend delivers the rest of its batch
        if self._filter is None or self._filter(event_fields(event)):
            self.events += 1
            self.handle(event)
            if self._max is not None and self.events >= self._max:
                raise EnoughEvents  # from a handler: the tracer finishes the hit first

    def run(self) -> None:
        interrupt = self._interrupt
        with interrupt.installed():
            self.backend = backend = open_backend(
                self.args,
                self.sink,
                self.specs,
                entry_times=self.entry_times,
                patterns=self.patterns,
            )
            interrupt.end_run = backend.end_run
            interrupt.is_mid_hit = backend.is_mid_hit
            try:
                try:
                    if self.prepare is not None:
                        self.prepare(backend)
                    if not interrupt.interrupted:
                        placed = backend.place(self.specs)
                        say_pending(
                            (getattr(p, "probe", None) for p in placed),
                            (
                                render_location(p.spec.location) if p.spec.location else p.name
                                for p in placed
                            ),
                        )
                        for note in backend.placement_notes():
                            sys.stderr.write(f"kprobes: {note}\n")
                    interrupt.is_placing = False
                    if not interrupt.interrupted:
                        self._loop(backend)
                except (EnoughEvents, KeyboardInterrupt, RunInterrupted):
                    # -n, or SIGINT (sigint.py): the run ends with its summary, without the
                    # events still waiting to be read
                    backend.discard_backlog()
            finally:
                interrupt.quiet()
                try:
                    backend.close()
                finally:
                    backend.end_command()
                if self._status:
                    sys.stderr.write("\r\x1b[K")

    @property
    def placed(self) -> list[Placed]:
        return self.backend.placed if self.backend is not None else []

    def _loop(self, backend: Backend) -> None:
        deadline = None if self.args.duration is None else self.started + self.args.duration
        next_tick = None if self.interval is None else self.started + self.interval
        periodic = self._status or next_tick is not None
        try:
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
                if done or self.interrupted or (deadline is not None and now >= deadline):
                    return
                if not periodic and timeout is None:
                    return
        except (EnoughEvents, KeyboardInterrupt, RunInterrupted):
            backend.discard_backlog()  # what is still to be read is not wanted

    def _print_status(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        sys.stderr.write(
            format_status(self.events, self.events / elapsed, self.hits, self.missed, self.dropped)
        )
        sys.stderr.flush()

    @property
    def hits(self) -> int:
        return sum(p.hits for p in self.placed)

    @property
    def missed(self) -> int:
        return sum(p.missed for p in self.placed)

    @property
    def dropped(self) -> int:
        return self.backend.dropped if self.backend is not None else 0

    def summary(self) -> str:
        text = format_summary(
            events=self.events,
            hits=self.hits,
            misses=self.missed,
            dropped=self.dropped,
            duration=time.monotonic() - self.started,
            missed_by_probe={p.name: p.missed for p in self.placed},
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
