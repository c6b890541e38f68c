"""A bad pointer in a fetch of ours gives ``(fault)``, never a fault of the program.

Detour code evaluates fetch-args (``+0(%di):string``, ``+8(+16(%si)):u32``) inside the
program. The kernel reads user memory with ``copy_from_user_nofault``, whose faults its
exception tables turn into ``-EFAULT``; the program has no such tables, so detour code
follows a convention of its own (``FETCH_FAULT_MAGIC`` in arch/x86_64/abi.py): a load that may
fault runs with r11 = the magic and r10 = where to go on if it faults. A SIGSEGV or SIGBUS
that the kernel raised for an instruction (si_code > 0) whose rip lies in one of our
executable pages, with r11 = the magic, is ours: the thread goes on at r10 and the signal is
discarded. Anything else is the program's own and is delivered exactly as it came.

Two halves do this. While the tool lives, every signal stops its thread under ptrace first,
and the tracer fixes ours here: in the event loop (``signals.py``), for a stop held while the
world was stopping (handled when it is drained), and at detach (``detach.py``). When the tool
is dead, the rescue does it in the program (``rescue.c``), once it was made the SIGSEGV and
SIGBUS handler (``Rescue.activate_fetch_faults``), which is done lazily, before the first
detour that may fault goes in.

**A fault cannot be blocked.** A thread that blocks SIGSEGV (inside the program's own SIGSEGV
handler, or a thread that blocks every signal) still takes it: the kernel makes the action
SIG_DFL and unblocks the signal before ptrace sees the stop (``force_sig_info_to_task``). So
after fixing such a fault, while the rescue is the handler, the tracer sets the rescue's
action again (the reset kept its restorer: that tells it from a SIG_DFL the program set
itself) and blocks the signal again in the thread. When the tool is dead, nothing can: such a
thread dies of the fault (docs/decisions.md).

Rejected: checking each pointer before the load (a syscall per fetch, ``process_vm_readv`` or
``/proc/self/mem``: the detour's cost many times over); letting the rescue alone fix the faults
while the tool lives (every fault would stop under ptrace anyway, then be delivered for a
second trip through the kernel, and a program without the rescue, seccomp, would die of it).
"""

from __future__ import annotations

import bisect
import signal
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64.abi import FETCH_FAULT_MAGIC
from kprobes.linux import procfs, ptrace
from kprobes.process.engine.threads import siginfo_code
from kprobes.process.inject import calls

if TYPE_CHECKING:
    from kprobes.arch.x86_64.regs import Regs
    from kprobes.process.engine.rescue import Rescue
    from kprobes.process.engine.threads import Thread

FAULT_SIGNALS: Final = frozenset({signal.SIGSEGV, signal.SIGBUS})
_BUS_MCEERR_AO: Final = 5  # a machine check reported later, not the fault of an instruction
_SIGACTION_ROOM: Final = 64


class FetchFaults:
    """Our executable pages in one address space (followed fork children have copies), and
    the fetch faults taken in them while the tool lives."""

    def __init__(self, rescue: Rescue) -> None:
        self._rescue = rescue  # the program's SIGSEGV/SIGBUS handler once the tool is dead
        self._starts: list[int] = []  # sorted, disjoint ranges [start, end)
        self._ends: list[int] = []

    def note_code(self, start: int, end: int) -> None:
        """Code of ours at [start, end): a fault there may be a fetch of ours."""
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted([*zip(self._starts, self._ends, strict=True), (start, end)]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        self._starts = [lo for lo, _ in merged]
        self._ends = [hi for _, hi in merged]

    def forget(self) -> None:
        """The address space was replaced (exec): its pages went with it."""
        self._starts.clear()
        self._ends.clear()

    def is_ours(self, addr: int) -> bool:
        index = bisect.bisect_right(self._starts, addr) - 1
        return index >= 0 and addr < self._ends[index]

    def continuation(self, t: Thread, sig: int, regs: Regs) -> int | None:
        """Where ``t``, stopped for ``sig`` with these registers, goes on if the signal is a
        fault of a fetch of ours (r10); None if it is the program's own."""
        if sig not in FAULT_SIGNALS or regs.r11 != FETCH_FAULT_MAGIC or not self.is_ours(regs.rip):
            return None
        code = siginfo_code(ptrace.getsiginfo(t.tid))
        if code <= 0 or (sig == signal.SIGBUS and code == _BUS_MCEERR_AO):
            return None  # sent by a process (kill, tgkill, sigqueue), or not a fault
        return regs.r10

    def fix(self, t: Thread, sig: int) -> bool:
        """``t`` is in the signal-delivery stop of ``sig``, its registers loaded: if the
        signal is a fetch fault of ours, send the thread on at r10 (True; the caller resumes
        it without the signal)."""
        regs = t.regs
        at = self.continuation(t, sig, regs)
        if at is None:
            return False
        # Step 1: on at r10 first: a tool killed from here on leaves the thread past the load.
        regs.rip = at
        t.store_regs()
        # Step 2: the kernel's reset of the action, if the thread blocked the signal.
        bit = 1 << (sig - 1)
        rescue = self._rescue
        if rescue.is_fetch_faults_active and not procfs.caught_signals(t.tracee.pid) & bit:
            scratch = calls.scratch_below(regs.rsp, _SIGACTION_ROOM)
            if rescue.retake_fetch_fault(
                t.tracee,
                lambda nr, *args: calls.run_syscall(t, 0, nr, *args, rescue=rescue),
                scratch,
                sig,
            ):
                ptrace.setsigmask(t.tid, ptrace.getsigmask(t.tid) | bit)
        return True
