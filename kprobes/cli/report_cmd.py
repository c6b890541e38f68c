"""``kprobes report [FILE]``: a record file summed up as ``count``, ``hist`` or ``latency`` would.

    kprobes report                      # events per probe (count's table)
    kprobes report --hist i -H          # a log2 histogram of the argument i (hist -H)
    kprobes report --hist size          # how often each value occurs (hist)
    kprobes report --latency -u         # the durations of the recorded return probes

perf report's place beside ``record`` and ``script``: the events are the file's (the
recording's ``--filter`` applied, replay.py), each summed where its values come out of the
decoder (the records of the batch path: no ``Event`` made, no line formatted; the others,
and the trap tier's events, one by one), and the summary printed as the live command
prints it. A command of its own rather than options of ``script``: ``script``'s options are
``trace``'s output options, these are what the aggregating commands print, and neither
set means anything to the other.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kprobes.cli.latency_cmd import UNITS
from kprobes.cli.script_cmd import FilteredEvents, add_file_argument, say_damage, say_end
from kprobes.cli.session import event_fields_source
from kprobes.errors import RecordFileError
from kprobes.model import Event
from kprobes.output.argtypes import format_value
from kprobes.output.counts import FrequencyTable, format_counts
from kprobes.output.hist import LatencyStats, Log2Histogram, format_average
from kprobes.spec import ProbeSpec

if TYPE_CHECKING:
    from kprobes.process.fast.batch import LineFormat, RowLayout


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("report", help=help, description=__doc__.split("\n\n")[0])
    add_file_argument(p)
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--count", action="store_true", help="events per probe, as count prints (the default)"
    )
    what.add_argument(
        "--hist", metavar="ARG", help="how often each value of the argument ARG occurs (hist)"
    )
    what.add_argument(
        "--latency", action="store_true", help="a log2 histogram of the return probes' durations"
    )
    p.add_argument("-H", "--log2", action="store_true", help="with --hist: a log2 histogram")
    unit = p.add_mutually_exclusive_group()
    unit.add_argument("-u", "--microseconds", action="store_true", help="--latency in µs")
    unit.add_argument("-m", "--milliseconds", action="store_true", help="--latency in ms")
    p.set_defaults(func=run)


class _Summary:
    """One summary over the file's events: ``handle`` for each event, ``writer`` for the
    rows of a probe's records (``BatchOutput``), ``text()`` at the end."""

    def __init__(self, args: argparse.Namespace, counts: FilteredEvents) -> None:
        self.args = args
        self.counts = counts
        self.per_probe: dict[str, int] = {}
        self.table = FrequencyTable()
        self.hist = Log2Histogram()
        self.stats = LatencyStats()
        self.unit = "msecs" if args.milliseconds else "usecs" if args.microseconds else "nsecs"

    def batch(self, spec: ProbeSpec) -> _Summary:
        return self

    def _take(self, name: str, type_text: str, value: Any) -> None:
        self.per_probe[name] = self.per_probe.get(name, 0) + 1
        if self.args.hist is None:
            return
        if not self.args.log2:
            self.table.add(format_value(type_text, value))
        elif isinstance(value, int):
            self.hist.add(value)

    def handle(self, ev: Event) -> None:
        if self.args.latency:
            if ev.is_return and ev.entry_timestamp:
                delta = int((ev.timestamp - ev.entry_timestamp) * UNITS[self.unit])
                self.hist.add(delta)
                self.stats.add(delta)
            return
        key = self.args.hist
        arg = next((a for a in ev.args if a.name == key), None)
        if key is None or arg is not None:
            self._take(ev.name, arg.type if arg else "", arg.value if arg else None)

    def writer(self, layout: RowLayout) -> LineFormat | None:
        """The decoder's line: nothing printed, each event's value taken (``_take``); the
        events of no interest (a probe without the argument, an entry for ``--latency``)
        left out uncounted."""
        from kprobes.process.fast.batch import LineFormat  # the reader's, when it reads

        key = self.args.hist
        if self.args.latency and layout.is_return:
            return None  # its duration is its Event's (entry_timestamp): ``handle`` takes it
        if self.args.latency or (key is not None and key not in layout.names):
            return LineFormat("''", "pass", "pass", {}, lambda *_: None, keep="False")
        i = layout.names.index(key) if key is not None else -1
        names: dict[str, Any] = {
            "o_take": self._take,
            "o_name": f"{layout.group}/{layout.event}",
            "o_type": layout.types[i] if key is not None else "",
        }
        counts = self.counts

        def write(text: str, printed: int, left_out: int) -> None:
            counts.events += printed
            counts.filtered += left_out

        keep = ""
        if counts.event_filter is not None:
            names["o_filter"], names["o_comm"] = counts.event_filter, layout.comm
            keep = f"o_filter({event_fields_source(layout.pid, layout.names)})"
        value = f"v{i}" if key is not None else "None"
        return LineFormat(
            f"(o_take(o_name, o_type, {value}), '')[1]", "pass", "pass", names, write, keep
        )

    def text(self) -> str:
        if self.args.latency:
            out = self.hist.format(self.unit)
            if self.stats.count:
                out += "\n" + format_average(self.stats, self.unit) + "\n"
            return out
        if self.args.hist is None:
            return format_counts(self.per_probe)
        if self.args.log2:
            return self.hist.format(self.args.hist)
        return self.table.format(self.args.hist)


def run(args: argparse.Namespace) -> int:
    # The file's reader is the engine's own ring reader: imported to read, not for --help.
    from kprobes.cli.replay import Replay, open_file, reading

    with reading(args.file) as f:
        meta, chunks = open_file(f)
        counts = FilteredEvents(meta)
        summary = _Summary(args, counts)
        counts.handle = summary.handle
        replay = Replay(counts.sink, summary.batch)
        try:
            replay.read(chunks)
        except RecordFileError as exc:
            sys.stdout.write(summary.text())
            return say_damage(args.file, exc, counts, "read")
    sys.stdout.write(summary.text())
    say_end(args.file, replay, counts, "read")
    return 0
