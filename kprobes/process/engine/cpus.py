"""CPU placement: the threads that stop often run on the tool's CPU.

Every trap-tier hit is a round trip: the thread stops and wakes the tool, the tool resumes the
thread. On one CPU these are two plain context switches. On two CPUs each is a wake-up of the
other CPU, and when that CPU is idle the wake-up pays its way out of idle: in a VM guest an
idle vCPU has halted into the host. Measured on a 2-vCPU AMD EPYC guest (docs/performance.md):
12.9 µs a hit with the tool and the program on one CPU, 52.9 µs on two. Left alone, the
scheduler wakes each side on its previous CPU while that one is idle, so it keeps the two
apart for a whole run, or together: 38 of 46 unpinned runs cost 4x the others.

So a thread whose stops come faster than one every ``PIN_BELOW_NS`` (over a window of
``WINDOW`` stops) is pinned to the tool's CPU, and the tool to one CPU, where the first such
thread was running. It is let go, its own mask given back, when its stops come slower than
one every ``LET_GO_ABOVE_NS``, when ``Process.pin_hot_threads`` is turned off, and at detach;
with the last one, the tool is let go too. A thread that stops rarely is left where the
scheduler puts it: the wake-ups are small beside its own work between two stops, and a
CPU-bound program keeps every CPU it had. Crowding corrects itself: threads squeezed onto one
CPU stop less often and are let go. Threads and processes created by a pinned thread would
inherit the pin: they get its own mask back. Nothing is changed for a thread whose mask does
not allow the tool's CPU, nor for one the program re-pinned itself meanwhile (at let-go its
mask is no longer ours to restore).

``Process.colocate()`` is the explicit form: the tool and every thread on one CPU, new
threads included, until detach. The policy keeps out of its way.

Rejected (measured, docs/decisions.md): the tool following the CPU of the thread that
trapped (the scheduler then wakes the thread on the CPU the tool left idle, and the two
swap CPUs at every look: 55 µs a hit); pinning every spawned program to the tool's CPU (four
threads that work between hits run 1.7x slower, four that are never hit 2x); waiting with a
short spin of ``waitpid(WNOHANG)`` (saves one wake-up of the two, 17.7 µs a hit, and takes the
CPU from a program that has work of its own).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from kprobes.linux import procfs

if TYPE_CHECKING:
    from kprobes.process.engine.threads import Thread

WINDOW: Final = 32  # stops of one thread between two looks at its pace
PIN_BELOW_NS: Final = 100_000  # stops faster than this: the wake-ups are most of its time
LET_GO_ABOVE_NS: Final = 200_000  # slower than this: it has work of its own to spread out


class _ToolCpu:
    """The tracing thread's own placement, shared by every Process it traces: one CPU, the
    same for all of them, chosen by the first that needs it and given back by the last."""

    def __init__(self) -> None:
        self.cpu: int | None = None
        self.own_mask: set[int] = set()
        self.users = 0

    def take(self, preferred: int, allowed: set[int]) -> int | None:
        """Hold the tool on one CPU (``preferred`` if it may); None if none suits ``allowed``."""
        if self.cpu is not None:
            if self.cpu not in allowed:
                return None
            self.users += 1
            return self.cpu
        mask = os.sched_getaffinity(0)
        choices = mask & allowed
        if not choices:
            return None
        cpu = preferred if preferred in choices else min(choices)
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            return None
        self.cpu, self.own_mask, self.users = cpu, mask, 1
        return cpu

    def give_back(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.cpu is not None:
            self.cpu, self.users = None, 0
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.own_mask)


_TOOLS: dict[int, _ToolCpu] = {}  # native thread id → its placement (ptrace is per thread)


def _tool() -> _ToolCpu:
    return _TOOLS.setdefault(threading.get_native_id(), _ToolCpu())


class Placement:
    """The masks we changed, per thread, and the pace of each thread's stops."""

    def __init__(self) -> None:
        self.is_on = True  # the policy; Process.pin_hot_threads
        self.is_colocated = False  # Process.colocate(): everything on one CPU until detach
        self.pins = 0  # threads pinned so far (the tests read it)
        self._tool: _ToolCpu | None = None  # while we hold the tool on one CPU
        self._masks: dict[int, set[int]] = {}  # tid → its own mask, while we pin it
        self._since: dict[int, int] = {}  # tid → when its current window began (ns)
        self._unsuited: set[int] = set()  # threads whose masks keep them off the tool's CPU

    @property
    def cpu(self) -> int | None:
        """The tool's CPU, once a thread was pinned to it (None before)."""
        return self._tool.cpu if self._tool is not None else None

    # -- the policy: the tracer calls check() every WINDOW traps of a thread ------------------

    def count(self, t: Thread) -> None:
        """One more trap of ``t`` (the tracer's hot path counts inline, then calls check())."""
        t.stops_to_check -= 1
        if not t.stops_to_check:
            self.check(t)

    def check(self, t: Thread) -> None:
        """``t`` has made another ``WINDOW`` stops: pin it or let it go by their pace."""
        t.stops_to_check = WINDOW
        self.check_pace(t.tracee.pid, t.tid)

    def check_pace(self, pid: int, tid: int) -> None:
        """The look itself: the time since the last one, over ``WINDOW`` stops."""
        now = time.monotonic_ns()
        start = self._since.get(tid)
        self._since[tid] = now
        if start is None or not self.is_on or self.is_colocated:
            return
        per_stop = (now - start) // WINDOW
        if tid in self._masks:
            if per_stop > LET_GO_ABOVE_NS:
                self._let_go(tid)
        elif per_stop < PIN_BELOW_NS and tid not in self._unsuited:
            self._pin(pid, tid)

    def _pin(self, pid: int, tid: int) -> None:
        try:
            own = os.sched_getaffinity(tid)
        except OSError:
            return
        cpu = self._take_tool(procfs.task_cpu(pid, tid), own)
        if cpu is None or own == {cpu}:
            self._unsuited.add(tid)  # not asked again while the tool keeps its CPU
            return
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            return
        self._masks[tid] = own
        self.pins += 1

    def _take_tool(self, preferred: int, allowed: set[int]) -> int | None:
        if self._tool is None:
            tool = _tool()
            if tool.take(preferred, allowed) is None:
                return None
            self._tool = tool
        cpu = self._tool.cpu
        return cpu if cpu in allowed else None

    def _let_go(self, tid: int) -> None:
        """Give ``tid`` its own mask back, unless the program changed the pin meanwhile.
        The last one out lets the tool go too: the next thread pinned chooses the CPU
        again (the tool's may have become a busy one)."""
        own = self._masks.pop(tid)
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(tid) == {self.cpu}:
                os.sched_setaffinity(tid, own)
        self._free_tool_if_idle()

    def _free_tool_if_idle(self) -> None:
        if not self._masks and not self.is_colocated and self._tool is not None:
            self._tool.give_back()
            self._tool = None
            self._unsuited.clear()

    # -- colocate(): the explicit form -------------------------------------------------------

    def colocate(self, tids: Iterable[int], cpu: int | None) -> int:
        """The tool and every thread in ``tids`` on one CPU (the tool's, by default)."""
        tids = list(tids)
        if cpu is None:
            cpu = self.cpu if self.cpu is not None else min(os.sched_getaffinity(0))
        if self._tool is not None and self._tool.cpu != cpu:
            self.release(list(self._masks))  # the last one out lets the tool go
        if self._tool is not None and self._tool.cpu != cpu:
            self._tool.give_back()
            self._tool = None
        if self._tool is None:
            tool = _tool()
            if tool.cpu is not None and tool.cpu != cpu:
                raise ValueError(f"this thread already traces on CPU {tool.cpu}")
            if tool.take(cpu, {cpu}) != cpu:
                raise ValueError(f"CPU {cpu} is not one this thread may run on")
            self._tool = tool
        self.is_colocated = True
        for tid in tids:
            with contextlib.suppress(OSError):
                own = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {cpu})
                self._masks.setdefault(tid, own)
        return cpu

    # -- threads and processes that come and go ------------------------------------------------

    def on_new_task(self, parent: int, tid: int, *, is_thread: bool) -> None:
        """``parent`` created ``tid`` (a thread, or a process's first thread): it inherited
        the parent's mask, which is ours if we pinned the parent."""
        own = self._masks.get(parent)
        if own is None:
            return
        if self.is_colocated and is_thread:
            self._masks[tid] = own  # stays with the others; its own mask back at detach
            return
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, own)

    def on_renamed(self, former: int, tid: int) -> None:
        """A thread that exec'd took the id of its leader."""
        if former in self._masks:
            self._masks[tid] = self._masks.pop(former)

    def forget(self, tid: int) -> None:
        """``tid`` is gone."""
        self._since.pop(tid, None)
        self._unsuited.discard(tid)
        if self._masks.pop(tid, None) is not None:
            self._free_tool_if_idle()

    def release(self, tids: Iterable[int]) -> None:
        """Give these threads their own masks back: we let them go, or the policy is off."""
        for tid in tids:
            if tid in self._masks:
                self._let_go(tid)
            self._since.pop(tid, None)

    def close(self) -> None:
        """Give every pinned thread its own mask back, and the tool its own."""
        self.release(list(self._masks))
        self.is_colocated = False
        if self._tool is not None:
            self._tool.give_back()
            self._tool = None
