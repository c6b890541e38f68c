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

``Signals`` is a part the tracer holds (``Tracer.signals``); what it may ask of the tracer
is ``SignalHost``, below. A SIGTRAP is not among its stops: a trap is the hit path's
(tracer.py), which tells ours from the program's own.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any, Protocol

from kprobes.arch.x86_64.plan import PlanKind
from kprobes.linux import ptrace
from kprobes.process.engine.threads import Thread, ThreadState, siginfo_code
from kprobes.process.engine.tracee import TraceeKind

if TYPE_CHECKING:
    from kprobes.core.table import ProbeSite
    from kprobes.process.engine.contracts import FaultFixer
    from kprobes.process.engine.xol import XolArea

S = ThreadState
_SYNC_FAULTS: dict[int, int] = {
    signal.SIGSEGV: 14,  # page fault (13, general protection, when si_code is SI_KERNEL)
    signal.SIGBUS: 17,
    signal.SIGFPE: 0,
    signal.SIGILL: 6,
}


class SignalHost(Protocol):
    """What ``Signals`` may read and call on the tracer that holds it (tracer.py): the
    out-of-line area (``xol``, None before the first slot) and whether a thread may be
    resumed now (``is_free``: not while the world is stopped, nor a thread a handler
    holds). It may assume a thread given to it is in a signal-delivery or syscall stop,
    its registers not loaded yet."""

    @property
    def xol(self) -> XolArea | None: ...
    def is_free(self, t: Thread) -> bool: ...


class Signals:
    """The signal stops of the tracer's threads (``Tracer.signals``): ``on_signal`` for a
    signal-delivery stop, ``entered_step_syscall`` for the syscall-entry stop of a step."""

    def __init__(
        self,
        host: SignalHost,
        *,
        slot_owner: dict[int, ProbeSite],
        fetch_faults: FaultFixer,
    ) -> None:
        self._host = host
        self._slot_owner = slot_owner  # the slot's address → the site whose copy it holds
        self._fetch_faults = fetch_faults

    def on_signal(self, t: Thread, sig: int) -> None:
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
        elif self._fetch_faults.fix(t, sig):
            t.resume()  # without the signal: the fetch gives (fault)
        elif (xol := self._host.xol) is not None and xol.contains(regs.rip):
            self._signal_in_slot(t, xol, sig)
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

    def entered_step_syscall(self, t: Thread) -> None:
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
        if not self._host.is_free(t):
            t.event_stopped = True
            t.resume_stepping = True  # by PTRACE_CONT: the slot's guard int3 ends the step
            return
        ptrace.singlestep(t.tid, 0)
        t.to(S.STEPPING)

    def _signal_in_slot(self, t: Thread, xol: XolArea, sig: int) -> None:
        """A signal for a thread running a boosted copy: map it back to the original code."""
        regs = t.regs
        page = xol.page_of(regs.rip)
        assert page is not None
        slot = page.start + (regs.rip - page.start) // 32 * 32
        site = self._slot_owner.get(slot)
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
