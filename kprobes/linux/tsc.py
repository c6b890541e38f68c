"""The time stamp counter, read by the tool, and ticks turned into ``time.monotonic()`` seconds.

Records of optimized probes carry ``rdtsc`` ticks (arch/x86_64/record.py): the detour has no
clock of its own that costs less. The tool places them on the clock its trap events use,
``time.monotonic()``, from pairs of (monotonic, tsc) it takes itself, with ``rdtsc`` run from
a page of four instructions mapped executable in the tool (Python has no other way to run
it). The mapping never goes back (``TscClock``), so records keep their order. The
machines this runs on have an invariant TSC (``constant_tsc nonstop_tsc``), synchronised
across CPUs by the kernel. Rejected: the perf mmap page's ``time_mult``/``time_shift``
(perf's clock is ``sched_clock``, not ``CLOCK_MONOTONIC``, and it needs a perf event open).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import time
from typing import Final

# rdtsc; shl rdx, 32; or rax, rdx; ret
_CODE: Final = bytes.fromhex("0f3148c1e2204809d0c3")
_SEGMENT_NS: Final = 200_000_000  # a new segment at most every 0.2 s


class _Rdtsc:
    def __init__(self) -> None:
        self._page = mmap.mmap(
            -1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
        )
        self._page.write(_CODE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        self.read = ctypes.CFUNCTYPE(ctypes.c_uint64)(addr)


_rdtsc: _Rdtsc | None = None


def read_tsc() -> int:
    """The TSC now, on whichever CPU the tool runs."""
    global _rdtsc
    if _rdtsc is None:
        _rdtsc = _Rdtsc()
    return int(_rdtsc.read())


def ticks_per_second() -> int:
    """The TSC's nominal rate (the CPU's clock in /proc/cpuinfo): good to a few per cent,
    for a deadline; ``TscClock`` measures the real one."""
    return int(_nominal_hz())


def _nominal_hz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":")[1]) * 1e6
    except OSError:
        pass
    return 1e9


class TscClock:
    """Ticks to ``time.monotonic()`` seconds; ``sample()`` now and then (each read).

    The mapping is a chain of line segments, each continuous with the one before, so that it
    never goes back: the records of one thread keep their order however late they are read.
    A segment starts at a sample at least ``SEGMENT`` apart from the last, with the rate
    measured over the segment before it (the first uses the nominal frequency); each new
    segment also takes up a tenth of the distance to the real clock, so an early error does
    not stay."""

    def __init__(self) -> None:
        ns, tsc = self._pair()
        self._starts: list[int] = [tsc]  # tsc where each segment starts
        self._segments: list[tuple[int, float, float]] = [(tsc, ns, _nominal_hz() / 1e9)]
        self._last_pair = (ns, tsc)

    @classmethod
    def from_segments(cls, segments: list[tuple[int, float, float]]) -> TscClock:
        """The clock another ``TscClock`` had, from its ``segments`` (a record file's: the
        mapping of its ticks is then the recording's, to the last bit); never sampled."""
        if not segments:
            raise ValueError("a clock needs at least one segment")
        clock = cls.__new__(cls)
        clock._starts, clock._segments = [], []
        clock.extend(segments)
        return clock

    def extend(self, segments: list[tuple[int, float, float]]) -> None:
        """More of another clock's segments, after those it has (``from_segments``)."""
        for start, ns, per_ns in segments:
            if self._starts and start <= self._starts[-1]:
                raise ValueError(f"a segment at tick {start} is not after the last")
            self._starts.append(start)
            self._segments.append((start, ns, per_ns))
        self._last_pair = (int(self._segments[-1][1]), self._segments[-1][0])

    @property
    def segments(self) -> list[tuple[int, float, float]]:
        """The mapping so far: (start tick, its ns, ticks per ns) a segment, in order (a
        copy; segments are only ever added at its end)."""
        return list(self._segments)

    @staticmethod
    def _pair() -> tuple[int, int]:
        a = time.monotonic_ns()
        tsc = read_tsc()
        b = time.monotonic_ns()
        return (a + b) // 2, tsc

    def _ns(self, tsc: int) -> float:
        i = max(bisect.bisect_right(self._starts, tsc) - 1, 0)
        start, ns, per_ns = self._segments[i]
        return ns + (tsc - start) / per_ns

    def sample(self) -> None:
        ns1, t1 = self._pair()
        ns0, t0 = self._last_pair
        if ns1 - ns0 < _SEGMENT_NS or t1 <= t0 or t1 <= self._starts[-1]:
            return
        per_ns = (t1 - t0) / (ns1 - ns0)  # ticks per ns, measured
        here = self._ns(t1)  # where the chain is now: the new segment starts there
        # Aim to meet the real clock over the next segment, a tenth of the way at a time.
        ahead = (here - ns1) / 10
        per_ns *= _SEGMENT_NS / max(_SEGMENT_NS - ahead, _SEGMENT_NS / 2)
        self._starts.append(t1)
        self._segments.append((t1, here, per_ns))
        self._last_pair = (ns1, t1)

    def segment_of(self, tsc: int) -> tuple[int, float, float, float]:
        """The segment that maps ``tsc``: (its start tick, its ns, ticks per ns, the tick
        where the next starts, or infinity). For a tick from its start to the next,
        ``seconds(tick)`` is ``(ns + (tick - start) / per) / 1e9``, which a batch reader
        computes inline (a tick before the first segment is not in it)."""
        i = max(bisect.bisect_right(self._starts, tsc) - 1, 0)
        start, ns, per_ns = self._segments[i]
        end = self._starts[i + 1] if i + 1 < len(self._starts) else float("inf")
        return start, ns, per_ns, end

    def seconds(self, tsc: int) -> float:
        return self._ns(tsc) / 1e9
