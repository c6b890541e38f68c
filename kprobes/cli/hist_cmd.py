"""``kprobes hist SPEC --key ARG``: how often each value of a fetched arg occurs (argdist -C),
or with ``-H`` a log2 histogram of it (argdist -H).

    kprobes hist -c ./prog 'libc:malloc size=%di:u64' --key size -H
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kprobes.cli.session import Session, add_common_arguments, parse_spec
from kprobes.errors import SpecError
from kprobes.model import Event
from kprobes.output.argtypes import format_value
from kprobes.output.counts import FrequencyTable
from kprobes.output.hist import Log2Histogram


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("hist", help=help)
    p.add_argument("spec", metavar="SPEC", help="a probe line with the arg to aggregate")
    p.add_argument("--key", required=True, metavar="ARG", help="the arg's name (e.g. arg1)")
    p.add_argument("-H", "--log2", action="store_true", help="log2 histogram (numbers only)")
    add_common_arguments(p)
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
    if args.log2 and (ftype.is_string or ftype.is_array):
        raise SpecError(f"--key {args.key}: -H needs a number, not {ftype.name}", column=0)
    type_text = ftype.name if ftype.count is None else f"{ftype.name}[{ftype.count}]"
    session = Session(args, [spec])
    session.verb = "counted"
    table = FrequencyTable()
    hist = Log2Histogram()
    faults = 0

    def handle(ev: Event) -> None:
        nonlocal faults
        value = ev.arg(args.key)
        if value is None:
            faults += 1
        if args.log2:
            if isinstance(value, int):
                hist.add(value)
        else:
            table.add(format_value(type_text, value))

    session.handle = handle
    session.run()
    if args.log2:
        sys.stdout.write(hist.format(args.key))
    else:
        sys.stdout.write(table.format(f"{spec.effective_event}:{args.key}"))
    if faults:
        sys.stderr.write(f"{faults} values could not be fetched (fault)\n")
    sys.stderr.write(session.summary())
    return session.exit_status()
