"""``kprobes latency FUNC``: a log2 histogram of each call's duration, like bcc's funclatency.

Entry and return are paired per call by the return probe's instances (per thread, nested
calls included), so recursion and threads do not mix durations up. With a kernel backend the
kernel records each entry as a second event, paired with the returns per thread
(``TraceTarget.place_spec(entry_times=True)``).

With the ptrace backend, where the function's entry takes a jump (the optimized tier), no
call traps: the program keeps each call's entry time on a shadow stack, times the return in
its trampoline and adds it to a log2 histogram in memory shared with the tool, which reads it
when it reports (process/fast/returns.py). What such an interval still holds of ours: the
entry detour after its ``rdtsc`` (the hook, a few stores) and the trampoline up to its own
``rdtsc`` (the registers saved, the shadow stack searched): some tens of ns a call, measured
in docs/performance.md. A function whose entry keeps its int3 (``--no-optimize``, or a site
the jump cannot take: stderr says why) is timed at its traps, and then each interval holds
two ptrace stops of ours.

``--linear MIN,MAX,STEP`` makes the histogram bpftrace's ``lhist`` (cli/linear.py), filled
the same ways.

``-i SECONDS`` prints the histogram and its average line every interval and starts afresh,
as funclatency ``-i`` does, each interval under its ``HH:MM:SS`` (funclatency's ``-T``
line, always printed here, as ``count -i`` does); the last, partial, at the end. A call
belongs to the interval its return is read in.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import Any

from kprobes.cli.linear import add_linear_argument, format_histogram, make_histogram
from kprobes.cli.session import (
    Session,
    add_common_arguments,
    add_interval_argument,
    parse_spec,
    take_program_hist,
)
from kprobes.errors import SpecError
from kprobes.model import Event
from kprobes.output.counts import format_interval_header
from kprobes.output.hist import LatencyStats, format_average
from kprobes.spec.parser import KRETPROBE_MAXACTIVE_MAX

UNITS = {"nsecs": 1e9, "usecs": 1e6, "msecs": 1e3}


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser(
        "latency",
        help=help,
        description=f"{help}. With the ptrace backend, where the function's entry takes a jump, "
        "the program times each call itself (no trap); what an interval still holds of ours "
        "is the entry detour after its clock read and the trampoline before its own, some "
        "tens of ns a call. A function whose entry keeps its breakpoint (--no-optimize, or a "
        "site the jump cannot take: stderr says why) is timed at its traps, two ptrace stops "
        "of ours inside each interval.",
    )
    p.add_argument("function", metavar="FUNC", help="the function: func, lib:func, /path:func")
    add_common_arguments(p)
    unit = p.add_mutually_exclusive_group()
    unit.add_argument("-u", "--microseconds", action="store_true", help="in microseconds")
    unit.add_argument("-m", "--milliseconds", action="store_true", help="in milliseconds")
    p.add_argument(
        "--maxactive",
        type=int,
        default=0,
        help="calls followed at once, every thread's (default: as many as needed with the "
        "ptrace backend, up to 16384 nested in each thread where the program times them; "
        "the kernel's default with --kernel)",
    )
    add_linear_argument(p, "the durations (ns, or the unit -u or -m chooses)")
    add_interval_argument(p, "the histogram")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    unit = "msecs" if args.milliseconds else "usecs" if args.microseconds else "nsecs"
    scale = UNITS[unit]
    if not 0 <= args.maxactive <= KRETPROBE_MAXACTIVE_MAX:
        raise SpecError(
            f"--maxactive {args.maxactive}: give 1 to {KRETPROBE_MAXACTIVE_MAX} instances (the "
            "kernel's limit), or leave it out: the ptrace backend then makes as many as there "
            "are calls in flight",
            column=0,
        )
    maxactive = str(args.maxactive) if args.maxactive > 0 else ""
    spec = parse_spec(f"r{maxactive} {args.function}")
    # The program times the calls itself, in this unit (ns per unit), unless each call must
    # be an event of its own (a filter to apply, a number of events to stop at): then its
    # trampoline writes a record of each return, with the entry's time (fast/returns.py).
    in_place = args.filter is None and args.max_events is None
    args.durations_unit = int(1e9 / scale) if in_place else 0
    session = Session(args, [spec])
    session.verb = "counted"
    session.entry_times = True  # the kernel's return events need their entry recorded too
    hist = make_histogram(args.linear)
    stats = LatencyStats()

    def handle(ev: Event) -> None:
        if ev.entry_timestamp:
            delta = int((ev.timestamp - ev.entry_timestamp) * scale)
            hist.add(delta)
            stats.add(delta)

    timed: dict[int, tuple[tuple[int, ...], int]] = {}  # what the program had timed, shown

    def take_timed() -> None:
        """The calls the program timed itself since the last report (optimized tier)."""
        slots, total = take_program_hist(session.placed, timed, len(hist.slots))
        hist.add_slots(slots)
        stats.count += sum(slots)
        stats.total += total
        session.events += sum(slots)  # each call timed is an event counted, as at a trap

    def show(when: datetime | None) -> None:
        """The histogram and its average (under the interval's time, with -i), reset."""
        take_timed()
        out = sys.stdout
        if when is not None:
            out.write("\n" + format_interval_header(when))
        out.write(format_histogram(hist, unit))
        if stats.count:
            out.write("\n" + format_average(stats, unit) + "\n")
        out.flush()
        hist.clear()
        stats.clear()

    session.handle = handle
    if args.interval:
        session.interval = args.interval
        session.on_interval = lambda: show(datetime.now())
    sys.stderr.write(f'Tracing 1 functions for "{args.function}"... Hit Ctrl-C to end.\n')
    session.run()
    show(datetime.now() if args.interval else None)
    sys.stderr.write(session.summary())
    return session.exit_status()
