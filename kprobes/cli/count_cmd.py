"""``kprobes count SPEC|PATTERN...``: hits per probe, like bcc's funccount.

A PATTERN is a glob over the function names of a library or of the program
(``'libc:str*'``, ``'work*'``); every matching function gets an entry probe, one per address:
the names of one function (``open``/``open64``) are one row, named by one of them
(symbols/aliases.py). Functions that cannot be probed (an instruction that cannot run out of
line) are skipped and listed. ``-i SECONDS`` prints and resets the counts every interval;
``--top N`` keeps the N busiest rows; ``--json`` prints ``{"probe": ..., "hits": ...}``
lines, the same rows as the table: probes with no hit are left out of both unless
``--zeros`` (docs/decisions.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kprobes.cli.backends import Backend, Glob, Placed
from kprobes.cli.notes import Progress, summarise
from kprobes.cli.session import (
    Session,
    add_common_arguments,
    add_interval_argument,
    exec_file,
    parse_spec,
    positive_int,
)
from kprobes.cli.spellings import read_glob
from kprobes.errors import NotMapped, ProbeError, SpecError
from kprobes.model import Event

if TYPE_CHECKING:  # imported by the first interval (-i) alone: a count starts without it
    from datetime import datetime
from kprobes.output.counts import format_counts, format_counts_json, format_interval_header
from kprobes.spec import FileOffsetLocation, ProbeSpec, SymbolLocation

_GLOB = set("*?[")
MAX_PROBES = 10_000  # every function of libc (~3,000) or libpython (~5,400) fits


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("count", help=help)
    p.add_argument(
        "targets",
        nargs="+",
        metavar="SPEC|PATTERN",
        help="probe lines or globs; a function a glob matches by several names (open, "
        "open64: one address) is one probe and one row",
    )
    add_common_arguments(p)
    add_interval_argument(p, "the counts")
    p.add_argument(
        "--json",
        action="store_true",
        help='{"probe": ..., "hits": ...} lines, the rows of the table ("aliases": the '
        "function's other names the glob matched)",
    )
    p.add_argument(
        "--top",
        type=positive_int,
        metavar="N",
        help="only the N rows with the most hits (each interval with -i), in the table's "
        "order: ascending, the busiest last",
    )
    p.add_argument(
        "--zeros",
        action="store_true",
        help="also the probes that had no hit, with 0 (by default the table and --json "
        "leave them out: a probe placed and absent had no hit)",
    )
    p.add_argument(
        "--max-probes",
        type=int,
        default=MAX_PROBES,
        metavar="N",
        help=f"refuse patterns that match more than N functions (default {MAX_PROBES:,}), "
        "as bpftrace's max_probes",
    )
    p.set_defaults(func=run)


def _is_pattern(text: str) -> bool:
    word = text.split()[0] if text.split() else text
    return not text.startswith(("p ", "p:", "r ", "r:")) and bool(_GLOB & set(word))


def _in_file(pattern: str, exe: str | None) -> str:
    """A bare glob (``work*``) as one of the file ``-x`` names (``PATH:work*``)."""
    return f"{exe}:{pattern}" if exe and ":" not in pattern else pattern


def run(args: argparse.Namespace) -> int:
    # Counting needs no event when nothing filters or stops on them: our own probes then
    # count in place (an optimized probe counts in the program, with no record at all).
    args.count_only = args.filter is None and args.max_events is None
    args.targets = [read_glob(t) if _is_pattern(t) else t for t in args.targets]
    exe = exec_file(args)
    patterns = [_in_file(t, exe) for t in args.targets if _is_pattern(t)]
    texts = [t for t in args.targets if not _is_pattern(t)]
    specs = [parse_spec(t) for t in texts]
    session = Session(args, specs)
    session.verb = "counted"
    tally = _Tally(args, session, patterns, zip(texts, specs, strict=True))
    session.prepare = tally.prepare
    session.patterns = patterns
    session.handle = tally.handle
    session.refresh = tally.refresh  # the status line's and the summary's events are the hits
    if args.interval:
        session.interval = args.interval
        session.on_interval = tally.tick
    session.report = tally.finish
    session.run()
    sys.stderr.write(session.summary())
    return session.exit_status()


class _Tally:
    """The counts of one ``count`` command, by row, and what each row is called.

    The session drives it: ``prepare`` places the patterns' probes, ``handle`` counts an
    event, ``take_hits`` adds the hits of probes that count in place, ``tick`` prints an
    interval's table; ``finish`` prints the last one.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        session: Session,
        patterns: list[str],
        specs: Iterable[tuple[str, ProbeSpec]],
    ) -> None:
        self.args = args
        self.session = session
        self.patterns = patterns
        self.counts: Counter[str] = Counter()
        self.label: dict[str, str] = {}  # event name -> what the table shows
        self.file_of: dict[str, str | None] = {}  # event name -> the file it names (None: the own)
        for text, spec in specs:
            self.label[spec.effective_event] = text
            self.file_of[spec.effective_event] = _file_named(spec)
        self.skipped: dict[str, str] = {}  # function -> why it was not placed
        self.aliases: dict[str, tuple[str, ...]] = {}  # event name -> its other names
        # Hits of in-place counters already counted, by placed probe (a followed child's copy of
        # a spec has the same name as the root's).
        self.shown: Counter[int] = Counter()
        self.hits = 0  # of every probe, when the rows were last brought up to date

    def prepare(self, backend: Backend) -> None:
        self.expand(backend)
        _name_files(self.label, self.file_of, backend.own_file)

    def expand(self, backend: Backend) -> None:
        """Place a probe on every function the patterns match, each function once: one
        probe on an address its names share (``open``/``open64``)."""
        found: dict[tuple[str, ...], None] = {}
        taken: set[str] = set()  # the names of those, over every pattern
        for pattern in self.patterns:
            try:
                names = backend.functions(pattern)
            except NotMapped as exc:
                # Not loaded yet: matched when it is (-c, --pending), else an error now.
                glob = Glob(pattern, parse_spec, self.took, self.args.max_probes)
                if backend.watch(glob):
                    continue
                if self.args.backend != "ptrace" or self.args.pids is None:
                    raise
                raise NotMapped(
                    f"{exc}; --pending waits until it loads it", errno=exc.errno
                ) from exc
            if not names:
                raise SpecError(f"no function matches {pattern!r}", column=0, text=pattern)
            for each in names:
                if taken.isdisjoint(each):  # ``open*`` and ``open``: once
                    found[each] = None
                    taken.update(each)
        cap = self.args.max_probes
        if len(found) > cap:
            text = " ".join(self.patterns)
            raise SpecError(
                f"{len(found):,} functions match, more than --max-probes allows ({cap:,})",
                column=0,
                text=text,
                hint=f"narrow the pattern, or raise the cap: --max-probes {len(found)}",
            )
        wheres = list(found)
        progress = Progress(len(wheres), "placing")
        results = backend.place_each([parse_spec(where[0]) for where in wheres])
        try:
            for where, (_spec, placed) in zip(wheres, results, strict=False):
                progress.tick()
                self.took(where, placed)
                if self.session.interrupted:
                    return  # SIGINT: count what is placed so far
        finally:
            results.close()
            progress.done()

    def took(self, where: tuple[str, ...], placed: Placed | ProbeError) -> None:
        """A function a glob matched (its names, ``lib:name``, the row's first) was placed,
        or skipped for a reason."""
        if isinstance(placed, ProbeError):
            self.skipped[where[0]] = str(placed)  # once, if skipped in several processes
            return
        event = placed.name.rpartition("/")[2]
        module, _, self.label[event] = where[0].rpartition(":")
        self.file_of[event] = module or None
        if len(where) > 1:
            self.aliases[event] = tuple(name.rpartition(":")[2] for name in where[1:])

    def handle(self, ev: Event) -> None:
        self.counts[self.label.get(ev.event, ev.event)] += 1

    def take_hits(self) -> int:
        """Probes that make no events (count_only): add their hits since the last call. The
        hits of every probe, read once for this (what the rows count)."""
        shown = self.shown
        total = 0
        for p in self.session.placed:
            hits = p.hits
            total += hits
            if getattr(p, "counts_in_place", False):
                new, shown[id(p)] = hits - shown[id(p)], hits
                event = p.name.rpartition("/")[2]
                self.counts[self.label.get(event, event)] += new
                self.session.events += new  # each hit is an event counted
        return total

    def table(self, when: datetime | None = None) -> str:
        """The rows of now: the busiest ``--top``, every placed probe with ``--zeros``."""
        if self.args.zeros:
            for p in self.session.placed:  # every placed probe appears, with 0 if no hit
                event = p.name.rpartition("/")[2]
                self.counts.setdefault(self.label.get(event, event), 0)
        top = self.args.top
        if self.args.json:
            aliases = {self.label.get(e, e): names for e, names in self.aliases.items()}
            return format_counts_json(
                self.counts, when=when, top=top, zeros=self.args.zeros, aliases=aliases
            )
        return format_counts(self.counts, top=top, zeros=self.args.zeros)

    def refresh(self) -> None:
        self.hits = self.take_hits()

    def tick(self) -> None:
        self.hits = self.take_hits()
        from datetime import datetime

        now = datetime.now()
        if not self.args.json:
            sys.stdout.write("\n" + format_interval_header(now) + "\n")
        sys.stdout.write(self.table(now))
        sys.stdout.flush()
        self.counts.clear()

    def finish(self) -> None:
        """The end: the skipped functions (and with -v the rows of several names), then the
        last table."""
        if not self.args.interval:
            self.hits = self.take_hits()
        verbose = self.args.verbose
        for line in summarise(
            list(self.skipped.items()), one="skipped", many="skipped", verbose=verbose
        ):
            sys.stderr.write(f"kprobes: {line}\n")
        for event, names in self.aliases.items() if verbose else ():
            row = self.label.get(event, event)
            sys.stderr.write(f"kprobes: {row} is also {', '.join(names)} (one address)\n")
        if self.args.interval:
            self.tick()
        else:
            sys.stdout.write(self.table())
        self.session.frozen_hits = self.hits  # what the rows counted: the summary's too


def _file_named(spec: ProbeSpec) -> str | None:
    """The file a spec names (a path or a library's short name); None for a bare symbol."""
    match spec.location:
        case SymbolLocation(module=module):
            return module
        case FileOffsetLocation(path=path):
            return path
    return None


def _name_files(label: dict[str, str], file_of: dict[str, str | None], own: str | None) -> None:
    """Rows of one function in two files name their files (``prog:work``, ``libc:strlen``):
    a bare ``work`` counted beside another file's ``work`` is not one row of both."""
    files_of_name: dict[str, set[str | None]] = {}
    for event, text in label.items():
        name = text.rpartition(":")[2]
        files_of_name.setdefault(name, set()).add(file_of.get(event) or own)
    for event, text in label.items():
        module, _, name = text.rpartition(":")
        if module or len(files_of_name[name]) < 2:
            continue
        where = file_of.get(event) or own
        if where is not None:
            label[event] = f"{os.path.basename(where)}:{name}"
