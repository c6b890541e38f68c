"""The records of several probes that interleave in a block, decoded a probe at a time.

The batch path decodes a run of one probe's records with one call of that probe's decoder
(batch.py). When two probes' records alternate in the ring (an entry and a return probe
of one function, a caller and its callee, two return probes at one site) each run is one
record long, and each record paid a decoder call of its own, a clock look-up and a write:
~10 µs an event where one probe's long runs cost ~1 µs (docs/performance.md).

Here a block's runs of each probe (each record id and size) are gathered, copied back to
back and decoded with one call; the reader then hands each run its own lines, in the
block's order, so the output is the same text in the same order. That needs one line per
record and a decoder that does nothing else (``LineFormat.lines``: ``trace``'s lines
without ``--filter``; not ``report``'s counts); a value with a newline of its own (a
string) leaves that probe's runs to be decoded run by run, again, as before (``take``
says None). Rejected: merging the probes' outputs by their timestamps (the text would have to
be parsed again, and equal times make the order ambiguous); one decoder for several
layouts (a decoder per combination of probes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import shared_area as sa

if TYPE_CHECKING:
    from kprobes.arch.x86_64.ring_block import Block, Run
    from kprobes.process.fast.reader import Batcher

RUNS_MIN: Final = 4  # runs in a block before decoding a probe's runs together pays
_Key = tuple[int, int]  # a run's record id and slots


class Interleaved:
    """Each gathered probe's lines, handed out run by run (``take``)."""

    def __init__(self) -> None:
        self._lines: dict[_Key, list[str]] = {}  # without their newlines
        self._next: dict[_Key, int] = {}

    def keep(self, key: _Key, lines: list[str]) -> None:
        self._lines[key] = lines
        self._next[key] = 0

    def take(self, run: Run) -> str | None:
        """The text of ``run``'s records, the next of its probe's lines; None: decode the
        run by itself."""
        key = (run.probe, run.slots)
        lines = self._lines.get(key)
        if lines is None:
            return None
        at = self._next[key]
        self._next[key] = end = at + run.count
        return "\n".join(lines[at:end]) + "\n"


def decode_interleaved(
    block: Block,
    batcher_of: Callable[[Run], Batcher | None],
    segment_of: Callable[[int], tuple[int, float, float, float]],
) -> Interleaved | None:
    """The lines of each probe whose records come in two runs or more of ``block``, its
    runs decoded with one call (None: the block is not worth it)."""
    runs = block.runs
    if len(runs) < RUNS_MIN:
        return None
    gathered: dict[_Key, list[Run]] = {}
    for run in runs:
        gathered.setdefault((run.probe, run.slots), []).append(run)
    view = memoryview(block.data)
    out = Interleaved()
    for key, its in gathered.items():
        if len(its) < 2:
            continue
        batcher = batcher_of(its[0])
        if batcher is None or not batcher.lines:
            continue
        lines = _lines(batcher, view, its, segment_of)
        if lines is not None:
            out.keep(key, lines)
    return out


def _lines(
    batcher: Batcher,
    view: memoryview,
    runs: Sequence[Run],
    segment_of: Callable[[int], tuple[int, float, float, float]],
) -> list[str] | None:
    """The runs' records back to back through the decoder: a line a record, or None."""
    records = b"".join(view[run.start : run.end] for run in runs)
    first_tsc = int.from_bytes(records[sa.REC_TSC : sa.REC_TSC + 8], "little")
    text, printed = batcher.decode(
        memoryview(records), *segment_of(first_tsc), batcher.addr, batcher.location
    )
    count = sum(run.count for run in runs)
    if printed != count or text.count("\n") != count or not text.endswith("\n"):
        return None
    return text[:-1].split("\n")
