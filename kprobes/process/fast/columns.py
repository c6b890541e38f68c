"""Runs of records turned into text a column at a time: the fast reader's decoder for lines
of plain values.

batch.py's decoder runs a few lines of Python for each record: unpack it, compute its
timestamp, build its line (~0.7 µs an event on this project's machine, a third of it the
timestamp). When each of a probe's values is a word of the record cut to an integer type,
most of that is the same from one event to the next: a run of one thread's records on one
CPU share their line but for the values and the timestamp, and a hot function's events
share their microsecond by the dozen. Here a run is read as columns instead (a
``memoryview`` cast to the value's type, strided over the records, ``tolist()``: the cut
to the type is the cast), each value column is printed with one ``map`` of the output's
function (``hex``, ``int.__repr__``), and the lines are the output's template (``Column
Format.line``: texts and the names of the fields between them) repeated, the columns
assigned into it by slices and joined once. What is left in Python is a step per
microsecond: the timestamp's text changes there.

**Exact or not at all.** The bytes are batch.py's for the same records. An event's
microsecond (``format_timestamp``: the ns rounded, then rounded to the microsecond) is a
non-decreasing function of its tick within a clock segment (each step of the arithmetic
is), so on ticks in order the events of one microsecond are a slice: the next one's first
tick is guessed from the clock's rate, found with ``bisect`` and then checked, the last
event of the slice and the first after it computed as batch.py computes them (stepping
back or on where the guess was wrong). A piece of a run this cannot read plainly goes to
batch.py's decoder as it is: ticks out of order or outside the clock's segment, fewer
than ``DENSE`` events a microsecond (the step per microsecond would cost more than the
loop per event), a thread, CPU or caller held for fewer than ``MIN_SPAN`` records.

Rejected: one ``%`` template repeated over a run (``(line * n) % values``): the format is
parsed again for every event, 1.5 times the join's time (133 against 87 ns an event for
``i=%di``'s line); numpy, not a dependency.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from itertools import chain, repeat
from typing import Any, Final, Literal

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.values import dataclass

# (a run of records, its clock segment: start tick, ns, ticks per ns, the next's start
# tick; the site's address and its location) → the events' text, and how many it holds
Decoder = Callable[[memoryview, int, float, float, float, int, str], tuple[str, int]]

Code = Literal["B", "b", "H", "h", "I", "i", "Q", "q"]  # a ``memoryview`` format
Parts = tuple[tuple[str, ...], tuple[str, ...]]  # a line's texts, and its fields between them
DENSE: Final = 3  # events a microsecond, at least, for a piece to be stepped by microsecond
MIN_SPAN: Final = 16  # records of one thread, CPU and caller, at least, to take as columns
_THREAD: Final = sa.REC_THREAD // 8
_META: Final = sa.REC_META // 8
_TSC: Final = sa.REC_TSC // 8


@dataclass(frozen=True, slots=True)
class Column:
    """Where a value is read: the element of ``memoryview`` format ``code`` at byte
    ``offset`` of each record (``"i"`` at a register's word: the word cut to s32), or
    ``constant``, the same for every event."""

    code: Code = "Q"
    offset: int = 0
    constant: int | None = None


@dataclass(frozen=True, slots=True)
class ColumnFormat:
    """How an output prints a probe's events as columns: ``line(tid, cpu, ip, location)``
    is the line of the events of thread ``tid`` on ``cpu`` at ``ip`` (the site, or a
    return's caller) named ``location``, as texts with the names of its fields between
    them (``(text, name, text, ..., text)``); a name is ``stamp`` (the event's
    microsecond, printed by the ``%`` format ``stamp`` over its seconds and microseconds:
    at most once, before any other), ``ts`` (the timestamp, seconds) or ``v0``, ``v1``...
    (the values, ints), printed by ``show[name]``."""

    line: Callable[[int, int, int, str], tuple[str, ...]]
    show: dict[str, Callable[[Any], str]]
    stamp: str | None = None


class ColumnDecoder:
    """The decoder (``Decoder``) of a probe's runs of records of ``size`` bytes whose values
    are ``columns``; ``caller`` is the offset of a return's caller (each event's ``ip``),
    ``per_event`` batch.py's decoder of the same records and line."""

    def __init__(
        self,
        fmt: ColumnFormat,
        columns: tuple[Column, ...],
        size: int,
        caller: int | None,
        per_event: Decoder,
        tid_of: Callable[[int], int],
    ) -> None:
        self.fmt = fmt
        self.columns = columns
        self.size = size
        self.caller = caller
        self.per_event = per_event
        self.tid_of = tid_of  # a thread pointer's tid
        self._lines: dict[tuple[int, int, int, str], Parts] = {}

    def __call__(
        self, view: memoryview, start: int, ns: float, per: float, end: float, ip: int, where: str
    ) -> tuple[str, int]:
        size = self.size
        q = view.cast("Q")
        n = len(q) // (size // 8)
        heads = [q[_THREAD :: size // 8], q[_META :: size // 8]]
        if self.caller is not None:
            heads.append(q[self.caller // 8 :: size // 8])
        if all(map(_same, heads)):
            spans = [(0, n, n >= MIN_SPAN)]  # the usual run: one thread on one CPU (one caller)
        else:
            spans = _spans(list(zip(*(h.tolist() for h in heads), strict=True)))
        clock = (start, ns, per, end)
        texts, printed = [], 0
        for a, b, one in spans:
            piece = view[a * size : b * size]
            text = self._piece(piece, b - a, clock, ip, where) if one else None
            if text is None:
                text, count = self.per_event(piece, *clock, ip, where)
            else:
                count = b - a
            texts.append(text)
            printed += count
        return "".join(texts), printed

    def _piece(
        self, view: memoryview, n: int, clock: tuple[int, float, float, float], ip: int, where: str
    ) -> str | None:
        """The text of ``n`` records of one thread, CPU and caller, the site at ``ip`` named
        ``where``; None if they are not plain to read as columns."""
        start, _, _, end = clock
        q = view.cast("Q")
        ticks = q[_TSC :: self.size // 8].tolist()
        if ticks[0] < start or ticks[-1] >= end or ticks != sorted(ticks):
            return None  # out of order, or another segment of the clock: batch.py's
        texts, fields = self._parts(
            q[_THREAD], q[_META], ip if self.caller is None else q[self.caller // 8], where
        )
        stamps = None
        if fields[:1] == ("stamp",):  # each line starts with its microsecond's text
            assert self.fmt.stamp is not None
            stamps = _stamps(ticks, clock, self.fmt.stamp, texts[0], texts[1])
            if stamps is None:
                return None
            fields, texts = fields[1:], texts[1:]
        elif not fields:
            return texts[0] * n
        # Each event's pieces: (its stamp), then each field's text and the text after it.
        pattern: list[Any] = [] if stamps is None else [None]
        for f, t in zip(fields, texts[1:], strict=True):
            pattern += [f, t]
        width = len(pattern)
        if stamps is not None:
            out = pattern * n
            out[0::width] = stamps
        else:  # a line's end and the next one's start are one piece
            pattern[-1] += texts[0]
            out = [texts[0], *pattern * n]
            out[-1] = texts[-1]
        first = 1
        for name in fields:
            out[first::width] = self._column(name, view, ticks, clock)
            first += 2
        return "".join(out)

    def _column(
        self, name: str, view: memoryview, ticks: list[int], clock: tuple[int, float, float, float]
    ) -> Iterable[str]:
        """The text of field ``name`` (``ts``, ``v0``...) of each record in ``view``."""
        show = self.fmt.show[name]
        if name == "ts":
            start, ns, per, _ = clock
            return map(show, [(ns + (t - start) / per) / 1e9 for t in ticks])
        column = self.columns[int(name[1:])]
        if column.constant is not None:
            return [show(column.constant)] * len(ticks)
        typed = view.cast(column.code)
        size = typed.itemsize
        return map(show, typed[column.offset // size :: self.size // size].tolist())

    def _parts(self, thread: int, meta: int, ip: int, where: str) -> Parts:
        """The texts of the line of thread pointer ``thread`` on the CPU of ``meta`` at ``ip``
        named ``where``, and the names of its fields (made once)."""
        tid = self.tid_of(thread)  # looked up each time: a thread pointer may be reused
        cpu = meta >> sa.META_CPU_SHIFT & sa.META_CPU_MASK
        key = tid, cpu, ip, where
        parts = self._lines.get(key)
        if parts is None:
            line = self.fmt.line(tid, -1 if cpu == sa.META_CPU_MASK else cpu, ip, where)
            parts = self._lines[key] = line[0::2], line[1::2]
        return parts


def _same(column: memoryview) -> bool:
    """Whether the words of ``column`` are all one."""
    data = column.tobytes()
    return data == data[:8] * len(column)


def _spans(keys: list[tuple[int, int, int]]) -> list[tuple[int, int, bool]]:
    """The runs of equal keys (thread, meta, caller) in ``keys``: (start, end, whether it
    is one key's); runs shorter than ``MIN_SPAN`` next to each other are one range, not one
    key's (batch.py reads them)."""
    spans: list[tuple[int, int, bool]] = []
    a = 0
    for i in range(1, len(keys) + 1):
        if i < len(keys) and keys[i] == keys[i - 1]:
            continue
        one = i - a >= MIN_SPAN
        if not one and spans and not spans[-1][2]:
            spans[-1] = (spans[-1][0], i, False)  # short ones together: one range
        else:
            spans.append((a, i, one))
        a = i
    return spans


def _stamps(
    ticks: list[int], clock: tuple[int, float, float, float], stamp: str, before: str, after: str
) -> list[str] | None:
    """The text of each event's microsecond (the ``%`` format ``stamp``), between ``before``
    and ``after``, its ticks ``ticks`` in order in ``clock``'s segment; None if they are
    too sparse."""
    start, ns, per, _ = clock
    n = len(ticks)
    fround = float.__round__  # a timestamp is a float: ``round`` without its look-up

    def micro(tick: int) -> int:  # batch.py's timestamp, then format_timestamp's rounding
        return (fround((ns + (tick - start) / per) / 1e9 * 1000000000) + 500) // 1000

    first, last = micro(ticks[0]), micro(ticks[-1])
    if n < DENSE * (last - first + 1):
        return None
    form = before.replace("%", "%%") + stamp + after.replace("%", "%%")
    edge, ticks_per_us = start + (499.5 - ns) * per, 1000 * per  # where u + 1 starts: guessed
    texts, counts = [], []
    i, u = 0, first
    while i < n:
        # Step 1: guess the first tick of the next microsecond (its ns are u * 1000 + 500).
        j = bisect_left(ticks, int(edge + u * ticks_per_us), i + 1)
        # Step 2: check the guess on both sides (one microsecond: a slice, ticks in order).
        while j > i + 1 and micro(ticks[j - 1]) != u:
            j -= 1
        following = u
        while j < n and (following := micro(ticks[j])) == u:
            j += 1
        texts.append(form % divmod(u, 1000000))
        counts.append(j - i)
        i, u = j, following
    return list(chain.from_iterable(map(repeat, texts, counts)))
