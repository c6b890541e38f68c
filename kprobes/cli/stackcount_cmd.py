"""``kprobes stackcount SPEC...``: hits counted by user stack, like bcc's stackcount.

    kprobes stackcount -c 'zstd -q -f -o /tmp/x.zst file' libc:malloc
    kprobes stackcount -p 4242 -d 10 --folded work > work.folded
    kprobes stackcount -c ./prog --svg prog.svg 'libc:malloc'

Each probe's stacks, the most frequent first, each as its frames (innermost first) and its
count, as bcc prints them; a stack is its frames as they print (two call sites of one
function are two stacks). ``--folded`` prints the folded lines instead (``main;a;leaf 3``,
outermost first, one line per distinct chain of functions), which flamegraph.pl, inferno
and speedscope read; ``--svg FILE`` writes them as an interactive flame graph that opens in a
browser from disk (output/flamegraph.py). How the stacks are taken on each backend:
stack_options.py. On our own backend an entry probe that takes a jump counts its hits by
stack in the program (a table of ``--max-stacks`` stack ids: process/fast/stackcounts.py),
with no record per hit; with ``-n``, ``--filter`` or a return spec every probe stays on
its breakpoint (each hit is an event there, and none can be dropped).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kprobes.cli.session import Session, add_common_arguments, parse_spec, positive_int
from kprobes.cli.stack_options import (
    BACKENDS_HELP,
    WHY_COUNTS,
    WHY_RETURNS,
    add_stack_arguments,
    prepare_stacks,
)
from kprobes.model import Event
from kprobes.output.flamegraph import flame_graph_svg
from kprobes.output.stacks import StackCounts, format_folded

MAX_STACKS = 4096  # stack ids a shared area counts (each ~1 KiB at the default depth)
MAX_STACKS_LIMIT = 1 << 20


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
    p.add_argument(
        "--max-stacks",
        type=_stack_ids,
        default=MAX_STACKS,
        metavar="N",
        help=f"distinct stacks the program counts at most (default {MAX_STACKS}, a power of "
        "two: rounded up); hits of stacks past a full table are reported as dropped",
    )
    p.set_defaults(func=run)


def _stack_ids(text: str) -> int:
    value = positive_int(text)
    if value > MAX_STACKS_LIMIT:
        raise argparse.ArgumentTypeError(f"at most {MAX_STACKS_LIMIT}, not {value}")
    return 1 << (value - 1).bit_length()


def run(args: argparse.Namespace) -> int:
    texts: list[str] = args.specs
    specs = [parse_spec(text) for text in texts]
    # In the program, where every hit counts the same; else each hit is an event, and a
    # record could be dropped where a breakpoint's event cannot.
    each = args.filter is not None or args.max_events is not None
    returns = any(spec.is_return for spec in specs)
    on_traps = WHY_RETURNS if returns else WHY_COUNTS if each else ""
    header = prepare_stacks(args, on_traps=on_traps)
    label = {spec.effective_event: text for text, spec in zip(texts, specs, strict=True)}
    session = Session(args, specs)
    session.verb = "counted"
    counts = StackCounts()

    def handle(ev: Event) -> None:
        counts.add(label.get(ev.event, ev.event), ev)

    def handle_counted(ev: Event, n: int) -> None:
        counts.add(label.get(ev.event, ev.event), ev, n)

    if not on_traps:
        session.handle_counted = handle_counted

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
