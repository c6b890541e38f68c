"""``kprobes stackcount SPEC...``: hits counted by user stack, like bcc's stackcount.

    kprobes stackcount -c 'zstd -q -f -o /tmp/x.zst file' libc:malloc
    kprobes stackcount -p 4242 -d 10 --folded work > work.folded
    kprobes stackcount -c ./prog --svg prog.svg 'libc:malloc'

Each probe's stacks, the most frequent first, each as its frames (innermost first) and its
count, as bcc prints them; a stack is its frames as they print (two call sites of one
function are two stacks). ``--folded`` prints the folded lines instead (``main;a;leaf 3``,
outermost first, one line per distinct chain of functions), which flamegraph.pl, inferno
and speedscope read; ``--svg FILE`` writes them as an interactive flame graph that opens in a
browser from disk (output/flamegraph.py). How the stacks are taken on each backend, and why
our own keeps its probes on breakpoints here: stack_options.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kprobes.cli.session import Session, add_common_arguments, parse_spec, positive_int
from kprobes.cli.stack_options import (
    BACKENDS_HELP,
    WHY_COUNTS,
    add_stack_arguments,
    prepare_stacks,
)
from kprobes.model import Event
from kprobes.output.flamegraph import flame_graph_svg
from kprobes.output.stacks import StackCounts, format_folded


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("stackcount", help=help, description=f"{help}. Stacks: {BACKENDS_HELP}.")
    p.add_argument(
        "specs",
        nargs="+",
        metavar="SPEC",
        help="probe lines (a bare location is an entry probe: 'libc:malloc', 'work')",
    )
    add_common_arguments(p)
    add_stack_arguments(p, optional=False)
    p.add_argument(
        "--folded",
        action="store_true",
        help="print folded stacks (main;a;leaf 3: outermost first, one line per chain of "
        "functions), what flamegraph.pl, inferno and speedscope read",
    )
    p.add_argument(
        "--svg",
        metavar="FILE",
        help="also write an interactive flame graph (search, zoom on click, counts in "
        "tooltips) that a browser opens from disk",
    )
    p.add_argument(
        "--top", type=positive_int, metavar="N", help="only each probe's N busiest stacks"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    texts: list[str] = args.specs
    specs = [parse_spec(text) for text in texts]
    header = prepare_stacks(args, on_traps=WHY_COUNTS)
    label = {spec.effective_event: text for text, spec in zip(texts, specs, strict=True)}
    session = Session(args, specs)
    session.verb = "counted"
    counts = StackCounts()

    def handle(ev: Event) -> None:
        counts.add(label.get(ev.event, ev.event), ev)

    def report() -> None:
        if header:  # a folded file has no place for comments
            (sys.stderr if args.folded else sys.stdout).write(header)
        folded = counts.folded()
        if args.folded:
            sys.stdout.write(format_folded(folded.items()))
        else:
            sys.stdout.write(counts.format(top=args.top))
        sys.stdout.flush()
        if args.svg:
            title = f"stackcount {' '.join(texts)}"
            with open(args.svg, "w") as f:
                f.write(flame_graph_svg(folded.items(), title))

    session.handle = handle
    session.report = report
    session.run()
    sys.stderr.write(session.summary())
    return session.exit_status()
