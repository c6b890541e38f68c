"""``kprobes hist SPEC --key ARG``: how often each value of a fetched arg occurs (argdist -C),
or with ``-H`` a log2 histogram of it (argdist -H), or with ``--linear MIN,MAX,STEP``
linear buckets (bpftrace's lhist: cli/linear.py).

    kprobes hist -c ./prog 'libc:malloc size=%di:u64' --key size -H

``-i SECONDS`` prints the table (or histogram) every interval and starts afresh, each
interval under ``[HH:MM:SS]`` as argdist ``-i`` prints it; the last, partial, at the end.
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
from kprobes.output.argtypes import format_value
from kprobes.output.counts import FrequencyTable, format_interval_header
from kprobes.spec import ProbeSpec
from kprobes.spec.types import ReturnValue

# The types of $retval whose value is the register's low bits as they are, as the program
# aggregates them (a signed 32-bit value would be negative in an event).
_RETVAL_BITS = {"u64": 64, "x64": 64, "s64": 64, "u32": 32, "x32": 32}


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("hist", help=help)
    p.add_argument("spec", metavar="SPEC", help="a probe line with the arg to aggregate")
    p.add_argument("--key", required=True, metavar="ARG", help="the arg's name (e.g. arg1)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("-H", "--log2", action="store_true", help="log2 histogram (numbers only)")
    add_linear_argument(shape, "the values (numbers only)")
    add_common_arguments(p)
    add_interval_argument(p, "the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec = parse_spec(args.spec)
    fields = dict(spec.fields)
    if args.key not in fields:
        known = ", ".join(fields) or "none"
        raise SpecError(
            f"--key {args.key}: the probe has no arg {args.key!r} (its args: {known})",
            column=0,
            text=args.spec,
        )
    ftype = fields[args.key]
    histogram = args.log2 or args.linear is not None
    if histogram and (ftype.is_string or ftype.is_array):
        option = "-H" if args.log2 else "--linear"
        raise SpecError(f"--key {args.key}: {option} needs a number, not {ftype.name}", column=0)
    type_text = ftype.name if ftype.count is None else f"{ftype.name}[{ftype.count}]"
    args.retval_bits = _retval_bits(args, spec)
    session = Session(args, [spec])
    session.verb = "counted"
    table = FrequencyTable()
    hist = make_histogram(args.linear)
    faults = 0

    def handle(ev: Event) -> None:
        nonlocal faults
        value = ev.arg(args.key)
        if value is None:
            faults += 1
        if histogram:
            if isinstance(value, int):
                hist.add(value)
        else:
            table.add(format_value(type_text, value))

    aggregated: dict[int, tuple[tuple[int, ...], int]] = {}  # the program's, shown

    def show(when: datetime | None) -> None:
        """The table (under the interval's time, with -i), reset."""
        slots, _ = take_program_hist(session.placed, aggregated, len(hist.slots))  # in the program
        hist.add_slots(slots)
        session.events += sum(slots)  # each return aggregated is an event counted
        out = sys.stdout
        if when is not None:
            out.write(format_interval_header(when, brackets=True))
        if histogram:
            out.write(format_histogram(hist, args.key))
            hist.clear()
        else:
            out.write(table.format(f"{spec.effective_event}:{args.key}"))
            table.clear()
        out.flush()

    session.handle = handle
    if args.interval:
        session.interval = args.interval
        session.on_interval = lambda: show(datetime.now())
    session.run()
    show(datetime.now() if args.interval else None)
    if faults:
        sys.stderr.write(f"{faults} values could not be fetched (fault)\n")
    sys.stderr.write(session.summary())
    return session.exit_status()


def _retval_bits(args: argparse.Namespace, spec: ProbeSpec) -> int:
    """A log2 (or linear) histogram of a return spec's one fetch-arg, ``$retval`` of a type
    above, with each return not an event of its own (no filter, no -n): aggregated in the
    program where the function's entry takes a jump (fast/returns.py); its bits, or 0."""
    if not ((args.log2 or args.linear is not None) and spec.is_return and len(spec.args) == 1):
        return 0
    (arg,) = spec.args
    if not isinstance(arg.fetch, ReturnValue) or args.filter or args.max_events is not None:
        return 0
    kind = arg.effective_type
    if kind.bitfield is not None or kind.count is not None:
        return 0
    return _RETVAL_BITS.get(kind.name, 0)
