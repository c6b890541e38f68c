"""Histograms and summary statistics, printed exactly as the tools people compare us with.

Latency and size distributions are read at a glance only in a layout the reader already knows,
so each histogram reproduces its reference byte for byte instead of inventing a new one:

* :class:`Log2Histogram` is bcc's ``BPF_HISTOGRAM`` filled with ``bpf_log2l()`` and printed by
  ``print_log2_hist()`` (src/python/bcc/table.py): slot ``i`` holds ``[2**(i-1), 2**i - 1]``,
  values 0 and 1 share slot 1, printed ``0 -> 1``; slot 0 is never printed; rows run from slot 1
  to the last non-empty slot (trailing empty slots trimmed, leading ones kept unless
  ``strip_leading_zero``); a 40-star bar scaled to the largest count; and the wide layout
  (``%20d``, 20 stars) once a slot above 32 (values of 2**32 and more) is used. Values are
  64-bit unsigned as in the BPF program: a negative int is taken modulo 2**64.
* :class:`LinearHistogram` is bpftrace's ``lhist(v, min, max, step)`` and its text output
  (src/output.cpp ``lhist_to_str``): ``(..., min)``, ``[a, b)`` and ``[max, ...)`` rows with
  1024/1048576 multiples shortened to ``K``/``M``, trimmed to the first and last non-empty
  row, a 52-character ``@`` bar computed in single precision as bpftrace's C++ does.
* :class:`LatencyStats` and :func:`format_average` are funclatency's closing line
  ``avg = %ld %s, total: %ld %s, count: %ld``.

Buckets come out as :class:`HistBucket` values with a half-open ``[low, high)`` range whatever
the printed convention, so programs need not parse the text.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kprobes.values import dataclass

LOG2_SLOTS = 65  # bcc's log2_index_max: slot 64 holds values up to 2**64 - 1
STARS_MAX = 40  # bcc's stars_max
BAR_MAX = 52  # bpftrace's max_width
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class HistBucket:
    """One histogram row: ``count`` values in ``[low, high)``; None is an open end."""

    low: int | None
    high: int | None
    count: int


def _stars(val: int, val_max: int, width: int) -> str:
    """bcc's ``_stars()``: the bar of a row, in the same float arithmetic."""
    n = 0
    while not (n > (width * val / val_max) - 1 or n > width - 1):
        n += 1
    text = "*" * n
    if val > val_max:
        text = text[:-1] + "+"
    return text


class Log2Histogram:
    """Power-of-two histogram of unsigned 64-bit values, bcc's layout (module docstring)."""

    def __init__(self) -> None:
        self._slots = [0] * LOG2_SLOTS

    @staticmethod
    def slot_of(value: int) -> int:
        """``bpf_log2l(value)``: 0 and 1 go to slot 1, otherwise the bit length."""
        return max(1, (value & _U64).bit_length())

    def add(self, value: int, count: int = 1) -> None:
        self._slots[self.slot_of(value)] += count

    def merge(self, other: Log2Histogram) -> None:
        for i, n in enumerate(other._slots):
            self._slots[i] += n

    def add_slots(self, counts: Sequence[int]) -> None:
        """Counts by slot, as a BPF map (or the program, for an optimized return probe)
        holds them: ``counts[i]`` values in slot ``i``."""
        for i, n in enumerate(counts[:LOG2_SLOTS]):
            self._slots[i] += n

    def clear(self) -> None:
        self._slots = [0] * LOG2_SLOTS

    @property
    def slots(self) -> tuple[int, ...]:
        """The raw slot counts, index = ``bpf_log2l`` value (what a BPF map would hold)."""
        return tuple(self._slots)

    @property
    def total(self) -> int:
        return sum(self._slots)

    def _last_slot(self) -> int:
        return max((i for i, n in enumerate(self._slots) if n > 0), default=-1)

    def buckets(self) -> list[HistBucket]:
        """The rows bcc prints (slot 1 to the last non-empty slot), as ``[low, high)``."""
        return [
            HistBucket(0 if i == 1 else 1 << (i - 1), 1 << i, self._slots[i])
            for i in range(1, self._last_slot() + 1)
        ]

    def format(self, val_type: str = "value", *, strip_leading_zero: bool = False) -> str:
        """``print_log2_hist(val_type)``'s output, newline-terminated ("" when empty)."""
        idx_max = self._last_slot()
        val_max = max(self._slots)
        if idx_max <= 32:
            header = f"     {val_type:<19} : count     distribution"
            low_w, stars = 10, STARS_MAX
        else:
            header = f"               {val_type:<29} : count     distribution"
            low_w, stars = 20, STARS_MAX // 2
        lines = [header] if idx_max > 0 else []
        for i in range(1, idx_max + 1):
            low, high = (1 << i) >> 1, (1 << i) - 1
            if low == high:
                low -= 1
            val = self._slots[i]
            if strip_leading_zero and not val:
                continue
            strip_leading_zero = False
            bar = _stars(val, val_max, stars)
            lines.append(f"{low:{low_w}d} -> {high:<{low_w}d} : {val:<8d} |{bar:<{stars}}|")
        return "".join(line + "\n" for line in lines)

    def to_json(self, val_type: str = "value") -> dict[str, object]:
        """bcc's ``print_json_hist`` object without its wall-clock ``ts``."""
        data = [
            {"interval-start": b.low, "interval-end": (b.high or 0) - 1, "count": b.count}
            for b in self.buckets()
        ]
        return {"val_type": val_type, "data": data}


def _f32(x: float) -> float:
    """Round to IEEE single precision, as a C++ ``float`` holds it."""
    value: float = struct.unpack("f", struct.pack("f", x))[0]
    return value


def _lhist_label(number: int) -> str:
    """bpftrace's ``lhist_index_label``: exact multiples of 1 Mi or 1 Ki shortened."""
    if number == 0:
        return "0"
    if number % 1048576 == 0:
        return f"{number // 1048576}M"
    if number % 1024 == 0:
        return f"{number // 1024}K"
    return str(number)


class LinearHistogram:
    """bpftrace ``lhist(value, low, high, step)``: fixed-width buckets plus two open ends.

    Slot 0 counts values below ``low``, slot ``n + 1`` values of ``high`` and above (``n`` =
    ``(high - low) // step`` buckets), slot ``i`` in between ``[low + (i-1)*step, low +
    i*step)``.
    """

    def __init__(self, low: int, high: int, step: int) -> None:
        if step < 1:
            raise ValueError(f"lhist step must be >= 1, not {step}")
        if high <= low:
            raise ValueError(f"lhist max ({high}) must be greater than min ({low})")
        self.low, self.high, self.step = low, high, step
        self.nbuckets = (high - low) // step
        self._slots = [0] * (self.nbuckets + 2)

    def slot_of(self, value: int) -> int:
        if value < self.low:
            return 0
        if value >= self.high:
            return self.nbuckets + 1
        return min((value - self.low) // self.step + 1, self.nbuckets + 1)

    def add(self, value: int, count: int = 1) -> None:
        self._slots[self.slot_of(value)] += count

    def add_slots(self, counts: Sequence[int]) -> None:
        """Counts by slot (``counts[i]`` values in slot ``i``), as the program of an
        optimized return probe aggregates them (arch/x86_64/retstack.py, ``Linear``)."""
        for i, n in enumerate(counts[: len(self._slots)]):
            self._slots[i] += n

    def merge(self, other: LinearHistogram) -> None:
        if (other.low, other.high, other.step) != (self.low, self.high, self.step):
            raise ValueError("cannot merge linear histograms with different buckets")
        for i, n in enumerate(other._slots):
            self._slots[i] += n

    def clear(self) -> None:
        self._slots = [0] * (self.nbuckets + 2)

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(self._slots)

    @property
    def total(self) -> int:
        return sum(self._slots)

    def _bounds(self, i: int) -> tuple[int | None, int | None]:
        if i == 0:
            return None, self.low
        if i == self.nbuckets + 1:
            return self.high, None
        return self.low + (i - 1) * self.step, self.low + i * self.step

    def _trimmed(self) -> range:
        used = [i for i, n in enumerate(self._slots) if n > 0]
        return range(used[0], used[-1] + 1) if used else range(0)

    def buckets(self) -> list[HistBucket]:
        """The rows bpftrace prints (first to last non-empty slot)."""
        return [HistBucket(*self._bounds(i), self._slots[i]) for i in self._trimmed()]

    def _label(self, i: int) -> str:
        low, high = self._bounds(i)
        if low is None:
            return f"(..., {_lhist_label(self.low)})"
        if high is None:
            return f"[{_lhist_label(self.high)}, ...)"
        return f"[{_lhist_label(low)}, {_lhist_label(high)})"

    def format(self) -> str:
        """bpftrace's ``lhist`` rows, newline-terminated ("" when empty). The ``@name:`` line
        that bpftrace prints above them is the caller's."""
        val_max = max(self._slots)
        lines = []
        for i in self._trimmed():
            val = self._slots[i]
            width = int(_f32(_f32(_f32(val) / _f32(val_max)) * BAR_MAX))
            lines.append(f"{self._label(i):<16}{val:>8} |{'@' * width:<{BAR_MAX}}|")
        return "".join(line + "\n" for line in lines)


class LatencyStats:
    """Count, sum, min, max and mean of a stream of values (latencies in one unit)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)

    def clear(self) -> None:
        self.count = self.total = 0
        self.min = self.max = None

    def merge(self, other: LatencyStats) -> None:
        self.count += other.count
        self.total += other.total
        if other.min is not None:
            self.min = other.min if self.min is None else min(self.min, other.min)
        if other.max is not None:
            self.max = other.max if self.max is None else max(self.max, other.max)

    @property
    def avg(self) -> float | None:
        return self.total / self.count if self.count else None

    def to_json(self) -> dict[str, object]:
        return {
            "count": self.count,
            "total": self.total,
            "min": self.min,
            "max": self.max,
            "avg": self.avg,
        }


def format_average(stats: LatencyStats, unit: str = "nsecs") -> str:
    """funclatency's ``avg = %ld %s, total: %ld %s, count: %ld`` line, without newline.

    The average is truncated as bcc's ``%ld`` of ``total/count`` is; "" when nothing was
    counted (funclatency prints nothing then either).
    """
    if not stats.count:
        return ""
    avg = int(stats.total / stats.count)
    return f"avg = {avg} {unit}, total: {stats.total} {unit}, count: {stats.count}"
