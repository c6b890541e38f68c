"""Signals for a traced thread: delivered, held while it runs an out-of-line copy, or
mapped back to the original code.

A signal that arrives while a thread executes an out-of-line copy is held and delivered, with
its original siginfo, when the copy has finished (a fault in the copy itself restarts the
instruction at the probed address and is delivered there). A thread is never sent back to
the probed address to take a signal first: the copy goes on (a boosted one single-stepped),
so that a hit ends in a bounded number of stops however fast signals come. A ``syscall``
copy is the exception: a signal that came before the syscall began is held only until the
syscall's entry and sent again there, so that a blocking syscall is still interrupted by it;
one that interrupts the syscall is delivered at once, its rip mapped back first.

A SIGSEGV or SIGBUS of a fetch of ours (detour code that read through a bad pointer) is not
delivered: the thread goes on where the fetch says (``faults.py``).

``SignalDelivery`` is a part of ``Tracer`` (tracer.py), kept apart as a mechanism of its own.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from kprobes.arch.x86_64.plan import PlanKind
from kprobes.linux import ptrace
from kprobes.process.engine.threads import Thread, ThreadState, siginfo_code
from kprobes.process.engine.tracee import TraceeKind

if TYPE_CHECKING:
    from kprobes.core.table import ProbeSite
    from kprobes.process.engine.breakpoints import Breakpoints
    from kprobes.process.engine.contracts import FaultFixer, Guardian
    from kprobes.process.engine.rescue import Rescue
    from kprobes.process.engine.trampoline import Trampoline
    from kprobes.process.engine.xol import XolArea

S = ThreadState
_SYNC_FAULTS: dict[int, int] = {
    signal.SIGSEGV: 14,  # page fault (13, general protection, when si_code is SI_KERNEL)
    signal.SIGBUS: 17,
    signal.SIGFPE: 0,
    signal.SIGILL: 6,
}


class SignalDelivery:
    """The signal stops of ``Tracer``."""

    xol: XolArea | None
    slot_owner: dict[int, ProbeSite]
    fetch_faults: FaultFixer
    rescue: Rescue
    hold_all: bool
    _stop_depth: int
    sites: dict[int, ProbeSite]
    breakpoints: Breakpoints
    trampoline: Trampoline
    trap_guard: Guardian | None
    guarding: bool

    if TYPE_CHECKING:

        def _return_hit(self, t: Thread) -> None: ...
        def _after_handler(self, t: Thread) -> None: ...

    def _on_signal(self, t: Thread, sig: int) -> None:
        was = t.state
        t.to(S.STOPPED)
        if t.reraised and int.from_bytes(t.reraised[0][0:4], "little") == sig:
            ptrace.setsiginfo(t.tid, t.reraised.pop(0))  # a held signal sent again: its own
        if t.tracee.kind is TraceeKind.RELEASE:
            t.held_signals.append((sig, ptrace.getsiginfo(t.tid)))
            return
        regs = t.load_regs()
        if was is S.STEPPING:
            self._signal_while_stepping(t, sig)
        elif self.fetch_faults.fix(t, sig):
            t.resume()  # without the signal: the fetch gives (fault)
        elif self.xol is not None and self.xol.contains(regs.rip):
            self._signal_in_slot(t, sig)
        else:
            t.resume(sig)

    def _signal_while_stepping(self, t: Thread, sig: int) -> None:
        site = t.step_site
        assert site is not None
        x: Any = t.step_prep
        regs = t.regs
        info = ptrace.getsiginfo(t.tid)
        off = regs.rip - x.slot
        trapnr = _fault_trapnr(sig, info)
        if trapnr is not None and off == 0:
            # The copy itself faulted: restart the instruction where it belongs.
            t.step_site = None
            t.to_syscall_entry = False
            self._fault_in_copy(t, site, sig, trapnr)
        elif x.kind is PlanKind.SINGLESTEP and off != 0:
            # The instruction has run (a syscall the signal interrupted): deliver it now, at
            # the original code.
            t.step_site = None
            t.to_syscall_entry = False
            if 0 < off <= x.plan.length:
                regs.rip = site.addr + off
                t.store_regs()
            ptrace.cont(t.tid, sig)
            t.to(S.RUNNING)
        else:
            # The copy has not begun, or cannot block: the signal waits for its end, and
            # the copy goes on from where it is. Never back to the probed address: a retry
            # is a new chance for the next signal to land first, and under a timer as fast
            # as our stops every retry lost (issue 18).
            _hold(t, sig, info)
            if x.kind is PlanKind.STEP:
                ptrace.cont(t.tid, 0)
            elif x.plan.is_syscall:
                t.to_syscall_entry = True  # see _entered_step_syscall
                ptrace.syscall_cont(t.tid, 0)
            else:
                ptrace.singlestep(t.tid, 0)
            t.to(S.STEPPING)

    def _entered_step_syscall(self, t: Thread) -> None:
        """``t`` stopped at the entry of its step's ``syscall`` (a syscall stop), with the
        signals that came before the syscall began held by us.

        They are sent again (tgkill; their own siginfo goes back when they are reported), so
        that they are pending while the syscall runs: one that blocks returns at once, as it
        would have had they come a moment later, and each is delivered after the step, at
        the original code. The single-step goes on from here.
        """
        t.to(S.STOPPED)
        t.to_syscall_entry = False
        for sig, info in t.held_signals:
            t.reraised.append(info)
            ptrace.tgkill(t.tracee.pid, t.tid, sig)
        t.held_signals.clear()
        if self.hold_all or self._stop_depth or t.busy:
            t.event_stopped = True
            t.resume_stepping = True  # by PTRACE_CONT: the slot's guard int3 ends the step
            return
        ptrace.singlestep(t.tid, 0)
        t.to(S.STEPPING)

    def _signal_in_slot(self, t: Thread, sig: int) -> None:
        """A signal for a thread running a boosted copy: map it back to the original code."""
        assert self.xol is not None
        regs = t.regs
        page = self.xol.page_of(regs.rip)
        assert page is not None
        slot = page.start + (regs.rip - page.start) // 32 * 32
        site = self.slot_owner.get(slot)
        if site is None:
            t.resume(sig)
            return
        x: Any = site.ainsn
        off = regs.rip - x.slot
        info = ptrace.getsiginfo(t.tid)
        trapnr = _fault_trapnr(sig, info)
        if off == 0 and trapnr is not None:
            self._fault_in_copy(t, site, sig, trapnr)
            return
        if off == 0 and x.plan.text.startswith("pushf"):
            # Single-stepped, pushf would store the trap flag: the signal is taken at the
            # probed address, and the re-hit does not run the handlers twice.
            regs.rip = site.addr
            t.skip_hit = (site.addr, regs.rsp)
            t.store_regs()
        elif off == 0:
            # The copy has not begun: it is single-stepped, and the signal waits for its end
            # (as for a STEP copy). Sent back to the probed address to take the signal first,
            # the thread met the next signal there again under a timer as fast as two stops.
            _hold(t, sig, info)
            t.step_site = site
            t.step_prep = x
            ptrace.singlestep(t.tid, 0)
            t.to(S.STEPPING)
            return
        elif off == x.plan.length:
            regs.rip = site.addr + x.plan.length
            t.store_regs()
        t.resume(sig)

    def _fault_in_copy(self, t: Thread, site: ProbeSite, sig: int, trapnr: int) -> None:
        regs = t.regs
        regs.rip = site.addr
        t.busy = True
        try:
            handled = site.run_fault(regs, trapnr)
        finally:
            t.busy = False
        t.store_regs()
        t.resume(0 if handled else sig)

    def _foreign_trap(self, t: Thread, info: bytes | None = None) -> None:
        """A SIGTRAP that is not a live breakpoint of ours (or our return trampoline);
        ``info``: its siginfo, when it was read before the reap (``_hold_trap``)."""
        regs = t.regs
        rip = regs.rip
        if rip - 1 == self.trampoline.addr and self.trampoline.addr:
            self._return_hit(t)
            return
        if info is None:
            info = ptrace.getsiginfo(t.tid)
        if siginfo_code(info) == ptrace.SI_KERNEL and self.breakpoints.is_stale_trap(rip - 1):
            # It hit an int3 we removed before we saw the trap: run the real instruction.
            regs.rip = rip - 1
            t.store_regs()
            site = self.sites.get(rip - 1)
            if site is not None:
                site.miss()
            self._after_handler(t)
            return
        if self.trap_guard is not None and not self.trap_guard.is_armed:
            self.trap_guard.arm_if_needed(t)
            self.guarding = self.trap_guard.is_armed
            ptrace.setsiginfo(t.tid, info)  # the injection replaced the stop's siginfo
        t.resume(signal.SIGTRAP)  # the program's own trap: deliver it


def _hold(t: Thread, sig: int, info: bytes) -> None:
    """Keep a signal to deliver after the copy. A standard signal already kept is not kept
    twice: waiting in the kernel's queue, the two would have been one."""
    if sig < signal.SIGRTMIN and any(held == sig for held, _ in t.held_signals):
        return
    t.held_signals.append((sig, info))


def _fault_trapnr(sig: int, info: bytes) -> int | None:
    """The x86 trap number of a synchronous fault, or None for any other signal."""
    trapnr = _SYNC_FAULTS.get(sig)
    if trapnr is None or siginfo_code(info) <= 0:
        return None
    if sig == signal.SIGSEGV and siginfo_code(info) == ptrace.SI_KERNEL:
        return 13
    return trapnr
