"""What the tracing commands say about their probes on stderr: one line per probe when there
are a few, or with ``-v``; one line with counts by reason when there are many.

``count 'libc:str*'`` used to print 22 lines "uses a breakpoint: the function's size is
unknown", and a glob over libpython 800; a ``-c`` run one "is pending" line per probe. A
reader wants to know how many and why, and the list when asked (bpftrace and bcc print
nothing at all; perf prints one line per probe it could not place).
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Sequence

FEW = 3  # up to this many notes of one kind are each said on a line of their own


def summarise(
    notes: Sequence[tuple[str, str]],
    *,
    one: str,
    many: str,
    verbose: bool,
    kinds: Sequence[str] | None = None,
    noun: str = "probes",
) -> list[str]:
    """Lines for ``notes``, (probe, reason) pairs: ``PROBE ONE: REASON`` each, with
    ``verbose`` or up to ``FEW`` of them; else ``N NOUN MANY: n1 KIND1; n2 KIND2``, where a
    note's kind is ``kinds[i]``, or its reason without the details (``kind_of``)."""
    if verbose or len(notes) <= FEW:
        return [f"{name} {one}: {reason}" for name, reason in notes]
    counted = Counter(kinds if kinds is not None else [kind_of(reason) for _, reason in notes])
    parts = "; ".join(f"{n:,} {kind}" for kind, n in counted.most_common())
    return [f"{len(notes):,} {noun} {many}: {parts} (-v lists them)"]


def kind_of(reason: str) -> str:
    """A reason without its details, so that reasons of one kind count together:
    ``a conditional jump in the region (`je 0x1234` at 0x1230)`` → ``a conditional jump in
    the region``; ``indirect jump at 0x7f3e2c`` → ``indirect jump``; numbers become N."""
    kind = reason.split(" (", 1)[0]
    kind = _AT_ADDRESS.sub("", kind)
    kind = _NUMBER.sub("N", kind).strip()
    return kind or reason


_AT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NUMBER = re.compile(r"\b(?:0x[0-9a-fA-F]+|\d+)\b")


class Progress:
    """``placing 5,426 probes… 1,200`` on a terminal's stderr while thousands of probes go
    in, or out (``removing``: the kernel's uprobes take one RCU grace period each)."""

    PERIOD = 0.2  # seconds between two updates

    def __init__(self, total: int, doing: str) -> None:
        self.total = total
        self.doing = doing
        self.count = 0
        self.is_shown = sys.stderr.isatty() and total > 1
        self._next = time.monotonic() + self.PERIOD

    def tick(self) -> None:
        self.count += 1
        if self.is_shown and time.monotonic() >= self._next:
            self._next = time.monotonic() + self.PERIOD
            line = f"kprobes: {self.doing} {self.total:,} probes… {self.count:,}"
            sys.stderr.write(f"\r\x1b[K{line}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.is_shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
