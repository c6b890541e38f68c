"""``kprobes script [FILE]``: a record file's events, printed as ``trace`` would have printed them.

    kprobes record -c './loop 2000000' 'p work i=%di'     # kprobes.data
    kprobes script > work.txt                              # trace's text
    kprobes script --json kprobes.data                     # trace --json's lines

perf script's place beside ``record``: the output is ``trace``'s, byte for byte (the same
decoders and lines on the same records, replay.py), with ``trace``'s output options
(``--json``, ``-T``, ``--perfetto``); the probe lines' own formats and ``--filter`` are the
recording's. A damaged or cut file prints every event before the damage, then says where
it is (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kprobes.cli.record_cmd import DEFAULT_FILE
from kprobes.cli.session import OutputClosed, compile_event_filter, event_fields
from kprobes.cli.trace_cmd import TraceOutput, add_output_arguments, event_stream, parse_specs
from kprobes.errors import RecordFileError
from kprobes.model import Event

if TYPE_CHECKING:
    from kprobes.cli.replay import Replay


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("script", help=help, description=__doc__.split("\n\n")[0])
    add_file_argument(p)
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    add_output_arguments(p)
    p.set_defaults(func=run)


def add_file_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "file",
        nargs="?",
        default=DEFAULT_FILE,
        metavar="FILE",
        help=f"what kprobes record wrote (default {DEFAULT_FILE})",
    )


class FilteredEvents:
    """The recording's ``--filter`` over the file's events, and their counts (what
    ``Session.sink`` does live; ``TraceRows`` counts the rows here too)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        specs, _ = parse_specs(meta["specs"], as_json=False)
        self._filter = compile_event_filter(meta.get("filter"), specs)
        self.handle: Callable[[Event], None] = lambda ev: None  # what takes the events kept
        self.events = 0
        self.filtered = 0

    @property
    def event_filter(self) -> Callable[[dict[str, object]], bool] | None:
        return self._filter

    def sink(self, ev: Event) -> None:
        if self._filter is None or self._filter(event_fields(ev)):
            self.events += 1
            self.handle(ev)
        else:
            self.filtered += 1


def say_end(path: str, replay: Replay, counts: FilteredEvents, verb: str) -> None:
    """stderr: the events shown, and what the recording said of its own."""
    line = f"kprobes: {counts.events} events {verb}"
    if counts.filtered:
        line += f", {counts.filtered} filtered out"
    end = replay.end
    if end is not None:
        line += (
            f"; recorded: {end['events']} events, {end['hits']} hits, {end['missed']} "
            f"missed, {end['dropped']} dropped"
        )
        if end.get("ended_by"):
            line += f" (ended by {end['ended_by']})"
    sys.stderr.write(line + "\n")
    for changed in replay.changed:
        sys.stderr.write(
            f"kprobes: {changed} is not the file recorded (its build-id): the addresses "
            "in it are printed in hex\n"
        )


def say_damage(path: str, exc: RecordFileError, counts: FilteredEvents, verb: str) -> int:
    sys.stderr.write(
        f"kprobes: {path}: {exc} (at byte {exc.offset:,}); the {counts.events} events "
        f"before it were {verb}\n"
    )
    return 1


def run(args: argparse.Namespace) -> int:
    # The file's reader is the engine's own ring reader: imported to read, not for --help.
    from kprobes.cli.replay import Replay, open_file, reading

    with reading(args.file) as f:
        meta, chunks = open_file(f)
        traced = parse_specs(meta["specs"], as_json=args.json)
        args.stack = bool(meta.get("stack"))
        out = event_stream()  # as trace's: PYTHONUNBUFFERED wrote each run by itself
        if meta.get("header") and not args.json:
            out.write(meta["header"])
        wall = meta.get("wall_offset_ns") if args.timestamp else None
        counts = FilteredEvents(meta)
        output = TraceOutput(args, traced, counts, lambda: wall, out)
        counts.handle = output.handle
        replay = Replay(counts.sink, output.batch if output.rows is not None else None)
        try:
            replay.read(chunks)
            output.close()
        except RecordFileError as exc:
            output.close()
            return say_damage(args.file, exc, counts, "printed")
        except OutputClosed:  # | head: the reader has what it wanted (its file is /dev/null)
            return 0
        except BrokenPipeError:  # the same, found by a write of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    say_end(args.file, replay, counts, "printed")
    return 0
