"""The time stamp counter, read by the tool, and ticks turned into ``time.monotonic()`` seconds.

Records of optimized probes carry ``rdtsc`` ticks (arch/x86_64/record.py): the detour has no
clock of its own that costs less. The tool places them on the clock its trap events use,
``time.monotonic()``, from pairs of (monotonic, tsc) it takes itself, with ``rdtsc`` run from
a page of four instructions mapped executable in the tool (Python has no other way to run
it). The rate is the slope between the first pair and the newest one once they are 20 ms
apart, and until then the nominal frequency of ``/proc/cpuinfo``; every record's time is
taken from the newest pair, so an error in the rate only scales the distance to it. The
machines this runs on have an invariant TSC (``constant_tsc nonstop_tsc``), synchronised
across CPUs by the kernel. Rejected: the perf mmap page's ``time_mult``/``time_shift``
(perf's clock is ``sched_clock``, not ``CLOCK_MONOTONIC``, and it needs a perf event open).
"""

from __future__ import annotations

import ctypes
import mmap
import time
from typing import Final

# rdtsc; shl rdx, 32; or rax, rdx; ret
_CODE: Final = bytes.fromhex("0f3148c1e2204809d0c3")
_SETTLE_NS: Final = 20_000_000


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
    """Ticks to ``time.monotonic()`` seconds; call ``sample()`` now and then (each read)."""

    def __init__(self) -> None:
        self._first = self._pair()
        self._last = self._first
        self._hz = _nominal_hz()

    @staticmethod
    def _pair() -> tuple[int, int]:
        a = time.monotonic_ns()
        tsc = read_tsc()
        b = time.monotonic_ns()
        return (a + b) // 2, tsc

    def sample(self) -> None:
        self._last = self._pair()
        ns0, t0 = self._first
        ns1, t1 = self._last
        if ns1 - ns0 >= _SETTLE_NS and t1 > t0:
            self._hz = (t1 - t0) * 1e9 / (ns1 - ns0)

    def seconds(self, tsc: int) -> float:
        ns, ref = self._last
        return (ns + (tsc - ref) * 1e9 / self._hz) / 1e9
