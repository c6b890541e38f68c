"""``trace -T``: each event's time on the wall clock, from the clock that stamped it.

The events of a session carry the time of the hit on one clock (``Backend.event_clock``):
CLOCK_MONOTONIC on our own backend (the trap tier reads it, the fast tier's TSC ticks are
turned into it: linux/tsc.py), the instance's trace clock on the kernel's (``mono``, set by
tracefs/session.py wherever the kernel has it). The offset of CLOCK_REALTIME from that clock
is measured once, when the session starts, and added to every event: the time printed is the
hit's, not the printing's (a reader minutes behind a busy program prints the right time), and
a step of the wall clock during the run (NTP, a date change) moves no event against another,
as perf's ``--clockid``/``-T`` and bcc's ``-T`` (a monotonic stamp plus an offset) do.
Rejected: ``time.time()`` when the event is printed (wrong by the reader's lag).
"""

from __future__ import annotations

import errno
import time

from kprobes.errors import TargetError

# The kernel's trace clocks that are a POSIX clock too (Documentation/trace/ftrace.rst):
# ``local``, ``global``, ``counter``, ``x86-tsc``, ``perf`` are not, and have no offset here.
TRACE_CLOCKS = {
    "mono": time.CLOCK_MONOTONIC,
    "mono_raw": time.CLOCK_MONOTONIC_RAW,
    "boot": time.CLOCK_BOOTTIME,
}
_TRIES = 5  # readings of the offset; the one with the shortest bracket is kept


def trace_clock_id(name: str) -> int:
    """The POSIX clock of the kernel's trace clock ``name``, or a ``TargetError`` that says
    why its events cannot be put on the wall clock."""
    try:
        return TRACE_CLOCKS[name]
    except KeyError:
        raise TargetError(
            f"-T: the kernel's trace clock here is {name!r}, which no clock of ours reads "
            f"(it needs one of {', '.join(TRACE_CLOCKS)}): leave -T out",
            errno=errno.EINVAL,
        ) from None


def realtime_offset_ns(clock: int) -> int:
    """CLOCK_REALTIME minus ``clock``, in ns, now: the wall clock read between two readings
    of ``clock`` and set against their midpoint, the closest-bracketed of a few tries."""
    best_width, best = None, 0
    for _ in range(_TRIES):
        before = time.clock_gettime_ns(clock)
        wall = time.clock_gettime_ns(time.CLOCK_REALTIME)
        after = time.clock_gettime_ns(clock)
        if best_width is None or after - before < best_width:
            best_width, best = after - before, wall - (before + after) // 2
    return best
