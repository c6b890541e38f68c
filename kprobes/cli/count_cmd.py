"""``kprobes count SPEC|PATTERN...``: hits per probe, like bcc's funccount.

A PATTERN is a glob over the function names of a library or of the program
(``'libc:str*'``, ``'work*'``); every matching function gets an entry probe. Functions that
cannot be probed (an instruction that cannot run out of line) are skipped and listed.
``-i SECONDS`` prints and resets the counts every interval; ``--json`` prints
``{"probe": ..., "hits": ...}`` lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from datetime import datetime
from typing import Any

from kprobes.cli.backends import Backend
from kprobes.cli.session import Session, add_common_arguments, parse_spec
from kprobes.errors import SpecError
from kprobes.model import Event
from kprobes.output.counts import format_counts, format_counts_json, format_interval_header
from kprobes.spec import FileOffsetLocation, ProbeSpec, SymbolLocation

_GLOB = set("*?[")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("count", help="count hits per probe (funccount)")
    p.add_argument("targets", nargs="+", metavar="SPEC|PATTERN", help="probe lines or globs")
    add_common_arguments(p)
    p.add_argument("-i", "--interval", type=float, help="print and reset every SECONDS")
    p.add_argument("--json", action="store_true", help='{"probe": ..., "hits": ...} lines')
    p.set_defaults(func=run)


def _is_pattern(text: str) -> bool:
    word = text.split()[0] if text.split() else text
    return not text.startswith(("p ", "p:", "r ", "r:")) and bool(_GLOB & set(word))


def run(args: argparse.Namespace) -> int:
    # Counting needs no event when nothing filters or stops on them: our own probes then
    # count in place (an optimized probe counts in the program, with no record at all).
    args.count_only = args.filter is None and args.max_events is None
    patterns = [t for t in args.targets if _is_pattern(t)]
    specs = [parse_spec(t) for t in args.targets if not _is_pattern(t)]
    session = Session(args, specs)
    session.verb = "counted"
    counts: Counter[str] = Counter()
    label: dict[str, str] = {}  # event name -> what the table shows
    file_of: dict[str, str | None] = {}  # event name -> the file it names (None: the own)
    for text, spec in zip((t for t in args.targets if not _is_pattern(t)), specs, strict=True):
        label[spec.effective_event] = text
        file_of[spec.effective_event] = _file_named(spec)
    skipped: list[str] = []

    def prepare(backend: Backend) -> None:
        expand(backend)
        _name_files(label, file_of, backend.own_file)

    def expand(backend: Backend) -> None:
        for pattern in patterns:
            found = backend.functions(pattern)
            if not found:
                raise SpecError(f"no function matches {pattern!r}", column=0, text=pattern)
            for where in found:
                if session.interrupted:
                    return  # SIGINT: count what is placed so far
                spec: ProbeSpec = parse_spec(where)
                try:
                    (placed,) = backend.place([spec])
                except backend.skippable as exc:
                    skipped.append(f"{where}: {exc}")
                    continue
                event = placed.name.rpartition("/")[2]
                module, _, label[event] = where.rpartition(":")
                file_of[event] = module or None

    def handle(ev: Event) -> None:
        counts[label.get(ev.event, ev.event)] += 1

    # Hits of in-place counters already counted, by placed probe (a followed child's copy of
    # a spec has the same name as the root's).
    shown: Counter[int] = Counter()

    def take_hits() -> None:
        """Probes that make no events (count_only): add their hits since the last call."""
        for p in session.placed:
            if getattr(p, "counts_in_place", False):
                new, shown[id(p)] = p.hits - shown[id(p)], p.hits
                event = p.name.rpartition("/")[2]
                counts[label.get(event, event)] += new
                session.events += new  # each hit is an event counted

    def table(when: datetime | None = None) -> str:
        if args.json:
            return format_counts_json(counts, when=when)
        return format_counts(counts)

    def tick() -> None:
        take_hits()
        now = datetime.now()
        if not args.json:
            sys.stdout.write("\n" + format_interval_header(now) + "\n")
        sys.stdout.write(table(now))
        sys.stdout.flush()
        counts.clear()

    session.prepare = prepare
    session.patterns = patterns
    session.handle = handle
    session.refresh = take_hits  # the status line's and the summary's events are the hits
    if args.interval:
        session.interval = args.interval
        session.on_interval = tick
    session.run()
    if not args.interval:
        take_hits()
    for line in skipped:
        sys.stderr.write(f"skipped {line}\n")
    for p in session.placed:  # every placed probe appears, with 0 if it never hit
        event = p.name.rpartition("/")[2]
        counts.setdefault(label.get(event, event), 0)
    if args.interval:
        tick()
    else:
        sys.stdout.write(table())
    sys.stderr.write(session.summary())
    return 0


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
