"""The reader gives way to the program: a poll of the rings is read at nice 19.

A record costs the program a few nanoseconds in its detour; reading it back and handing it to
a handler costs the tool half a microsecond or more. Where the tool and a busy program share
a CPU (``taskset``, a container given one CPU, a machine with every CPU busy), the scheduler
splits that CPU evenly between them, and while the reader caught up with a backlog the
program ran at half its speed: a record with a 10-frame stack cost it 186 ns with both on one
CPU against 106 ns apart (docs/performance.md). A tool that is to be pointed at production
programs must not take their CPU to read about them. So while ``run()`` waits for stops, each
poll of the rings runs at the lowest priority (``LOWEST``, nice 19), for at most
``FOR_AT_MOST`` seconds: on a CPU it shares with one busy thread the reader then has about
1.5% of it (the scheduler's weights, 15 against 1024), the ring holds what the reader has
not read yet, and what overflows it is dropped and counted, as the kernel's own rings do.
But only while every ring is less than half full (``HALF``, looked at before each slice of
1,024 records): past that, the reader takes its full share again, as the peers' readers
do, rather than let the ring overflow. The tool's priority is its own
again before it looks at stops (a trap-tier hit waits for the tool) and for every read that
is not a poll (the end of a run reads the rest at full speed).

Only where the priority can be put back: lowering it is always allowed, raising it again
needs ``CAP_SYS_NICE`` (root's) or an ``RLIMIT_NICE`` that allows it; without either, the
reader reads at the tool's priority as before. Never with ``--block``: there the program's
threads spin in their detours until the reader makes room, and a reader that gives way to
them would hardly ever run. Nor for ``record``'s tee, which only copies the records to its
file (a few ns each, not a handler's half microsecond) and must keep up with a busy
program: with a machine's every CPU busy (three ``yes`` beside two busy threads on two
CPUs), a recording that gave way had nothing in its file after a second, one time in six.

Rejected: ``SCHED_IDLE`` (no share at all on a CPU the program keeps busy, and the same
permission to come back); nice 10 (a tenth of the CPU by the scheduler's weights, but a
poll that wakes every 2 ms took more: 164 ns pinned for the 10-frame stack, loaded,
against 101 at nice 19); a reading thread of its own kept at a low priority (the GIL:
the tracer would wait on a low-priority thread holding it); reading less often (the same
work later, in the same CPU time of a program that stays busy).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from typing import Final, Protocol

LOWEST: Final = 19  # a poll's nice value
HALF: Final = 0.5  # a ring fuller than this is read at the tool's own priority
FOR_AT_MOST: Final = 0.01  # seconds a poll reads at it, then stops are looked at again
_CAP_SYS_NICE: Final = 23


class Drains(Protocol):
    """A ring reader (reader.py): its reads stop between two records once ``until`` passes."""

    until: float | None

    def drain(self, *, everything: bool = True, below: float | None = None) -> None: ...

    def fill(self) -> float: ...


class GiveWay:
    """The calling thread's polls at ``LOWEST``, when its own priority can be had back."""

    def __init__(self) -> None:
        self._is_on: bool | None = None  # known at the first poll
        self._own = 0  # the thread's own nice value

    @property
    def is_on(self) -> bool:
        if self._is_on is None:
            self._own = os.getpriority(os.PRIO_PROCESS, 0)
            self._is_on = self._own < LOWEST and _may_raise_to(self._own)
        return self._is_on

    def poll(self, reader: Drains, *, may: bool) -> None:
        """A poll's batch of ``reader``: at ``LOWEST`` for ``FOR_AT_MOST`` while its rings
        are less than ``HALF`` full, if ``may``."""
        if not may or not self.is_on or reader.fill() >= HALF:
            reader.drain(everything=False)
            return
        until = reader.until
        soon = time.monotonic() + FOR_AT_MOST
        reader.until = ours = soon if until is None else min(until, soon)
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST)
        try:
            reader.drain(everything=False, below=HALF)
        finally:
            if reader.until == ours:  # else a deadline set meanwhile stands
                reader.until = until
            try:
                os.setpriority(os.PRIO_PROCESS, 0, self._own)
            except OSError:
                self._is_on = False  # a capability dropped since: at least no second time


def _may_raise_to(nice: int) -> bool:
    """May this thread set its nice value back to ``nice`` once it is lower?"""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - nice <= soft:
        return True
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    return False
