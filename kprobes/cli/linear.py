"""``--linear MIN,MAX,STEP``: linear buckets for ``latency`` and ``hist`` (bpftrace's
``lhist(value, min, max, step)``) in place of the log2 slots.

The buckets are ``output/hist.py``'s ``LinearHistogram``: ``[MIN, MIN+STEP)``, ... up to
``MAX``, plus one slot below ``MIN`` and one from ``MAX`` on, printed as bpftrace prints an
``lhist`` under ``@NAME:``. On every backend the events fill them; with the ptrace backend,
where the function's entry takes a jump, the program fills them itself at each return
(arch/x86_64/retstack.py, ``Linear``), as it does the log2 slots, when ``MIN`` >= 0 and
there are at most ``LHIST_SLOTS_MAX`` slots; otherwise each return is a record the tool adds.
"""

from __future__ import annotations

import argparse

from kprobes.output.hist import LinearHistogram, Log2Histogram


def parse_linear(text: str) -> tuple[int, int, int]:
    """``MIN,MAX,STEP`` → (min, max, step); an argparse error names what is wrong."""
    parts = text.split(",")
    try:
        low, high, step = (int(p, 0) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give MIN,MAX,STEP, three integers (e.g. 0,1000,100)"
        ) from None
    try:
        LinearHistogram(low, high, step)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return low, high, step


def add_linear_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--linear",
        type=parse_linear,
        metavar="MIN,MAX,STEP",
        help=f"linear buckets of {what} (bpftrace's lhist): [MIN, MIN+STEP), ... up to MAX, "
        "one for less than MIN and one for MAX and more; with the ptrace backend the "
        "program fills them itself where the function's entry takes a jump (MIN >= 0, at "
        "most 1022 buckets; else from each return's record). A negative MIN is written "
        "--linear=-50,100,10",
    )


def make_histogram(linear: tuple[int, int, int] | None) -> LinearHistogram | Log2Histogram:
    return Log2Histogram() if linear is None else LinearHistogram(*linear)


def format_histogram(hist: LinearHistogram | Log2Histogram, name: str) -> str:
    """The histogram's rows: bcc's log2 table with ``name`` over its values, or bpftrace's
    ``lhist`` rows under ``@name:`` (nothing when it is empty)."""
    if isinstance(hist, Log2Histogram):
        return hist.format(name)
    rows = hist.format()
    return f"@{name}:\n{rows}" if rows else ""
