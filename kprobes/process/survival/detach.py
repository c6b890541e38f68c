"""Leave the program exactly as if we had never been there.

Detaching must work from any state the tracer can be caught in: a SIGINT between two lines of
a hit, threads half-way through an out-of-line copy, stops received but not yet handled. So it
reads the truth from the threads themselves rather than trusting our bookkeeping:

Step 1: hold every thread (PTRACE_INTERRUPT, wait, trust /proc for stragglers).
Step 2: write back every byte we ever patched, in every address space with its own copy;
        real return addresses back in hooked frames; the program's own SIGTRAP action back
        (and its SIGSEGV and SIGBUS actions, unless a thread is left in detour code that may
        still fault on a fetch: then the rescue stays their handler, see faults.py).
Step 3: turn the int3 that ends each stepping slot into a ``jmp`` back to the original code,
        so a thread that is inside a slot, or returns into one from a signal handler, later,
        finds its way home without us. Slots are never unmapped.
Step 4: put each thread's rip back on original code: a thread stopped on one of our int3s
        re-executes the (restored) instruction; one inside a slot continues where the copy was;
        one stopped by a fault of a fetch of ours goes on past it, without the signal.
Step 4a: when every thread has a stop of its own pending, one has it handled first: the
        last one, lent for Step 6, must have none.
Step 5: release each thread, delivering a signal it was stopped for (or that we held).
Step 6: through the last thread, give the pages our jumps were on their protection back
        (``shield.py``), and unmap every page of ours no thread was let go in
        (``unmapping.py``); the rescue's own mapping once it handles no signal any more.
"""

from __future__ import annotations

import contextlib
import os
import signal

from kprobes.arch.x86_64.encode import jmp_rel32
from kprobes.arch.x86_64.plan import SLOT_SIZE, PlanKind
from kprobes.errors import InternalError, TargetError
from kprobes.linux import ptrace
from kprobes.process.engine import events as ev
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind
from kprobes.process.engine.tracer import Tracer
from kprobes.process.fast.shield import Shield, pages_of
from kprobes.process.fast.state import JumpState
from kprobes.process.inject import calls, selfrestore
from kprobes.process.survival.unmapping import Unmapping, leave_detours

_STOPPED = ThreadState.STOPPED


def detach_all(tracer: Tracer, jumps: JumpState) -> list[str]:
    """Steps 1-6 (above); what kept pages of ours in the program, one line each."""
    tracer.world.stop(land_exec=True)
    why_kept: list[str] = []
    try:
        # Step 1b: no thread waits for room in a ring any more (--block: shared_area.py); one
        # inside a detour's wait leaves it at its next look at the lease.
        jumps.release_waiters()
        # Step 2
        for tracee in list(tracer.tracees.values()):
            if tracee.kind is not TraceeKind.VFORK:
                tracer.breakpoints.restore_all(tracee)
        # Step 2b: every live frame we hooked gets its real return address back.
        tracer.trampoline.unhook(list(tracer.threads.values()))
        # Step 2c: no thread left inside a detour, where possible (unmapping.py).
        leave_detours(tracer, jumps)
        # Step 2d: then the frames the optimized return probes hooked (no thread is left
        # between an entry's push and its hook: the detours were left first).
        jumps.unhook_returns(list(tracer.threads.values()))
        # Step 3
        for slot, prepared in tracer.slot_history.items():
            if prepared.kind in (PlanKind.STEP, PlanKind.SINGLESTEP):
                at = slot + prepared.plan.length
                home = jmp_rel32(at, prepared.plan.next_addr)
                for tracee in tracer.own_memories():
                    try:
                        tracee.write(at, home)
                    except TargetError:
                        continue
        # Steps 4 and 5, until no thread is left (a pending clone may add one). One thread
        # with no stop of its own pending is kept, sent home, for last: it puts the program's
        # own SIGTRAP action back in place of the rescue (rescue.py) once every other thread
        # is gone, and nothing of ours is left to trap on.
        last: Thread | None = None
        _free_one(tracer)  # Step 4a
        unmapping = Unmapping(tracer, jumps)
        had_threads = bool(tracer.threads)
        inside = False  # a thread was let go in detour code that may still fault on a fetch
        while tracer.threads:
            for thread in list(tracer.threads.values()):
                if thread is last:
                    continue
                if (
                    last is None
                    and thread.pending is None
                    and thread.state is _STOPPED
                    and _send_home(tracer, thread) is not None
                ):
                    last = thread
                    continue
                inside = _release(tracer, thread, unmapping) or inside
                tracer.drop_thread(thread)
            if last is not None and len(tracer.threads) == 1:
                inside = inside or _may_fetch(tracer, last)
                unmapping.look_at(last)
                _uncover(tracer, jumps.shield, last)
                _give_back(unmapping, last, rescue=False)  # Step 6
                _deactivate_rescue(tracer, last, keep_fetch_faults=inside)
                _give_back(unmapping, last, rescue=True)
                _let_go(last, 0)
                tracer.drop_thread(last)
        why_kept = unmapping.why_kept
        main = tracer.main
        if (  # said, never silent (stress_commands.py)
            last is None
            and unmapping.pages
            and main is not None
            and os.path.exists(f"/proc/{main.pid}")
        ):
            why = "each had a stop of its own pending" if had_threads else "none was held"
            why_kept.append(f"every page of ours: no thread could be lent to unmap them ({why})")
    finally:
        for tracee in list(tracer.tracees.values()):
            tracer.drop_tracee(tracee)
    return why_kept


def _free_one(tracer: Tracer) -> None:
    """Step 4a: the last thread (Step 6 lends it for the injections) must have no stop of its
    own pending. When every thread has one (a single thread that signals itself is nearly
    always caught so), one is sent home first, given the signal it stopped for, and held
    again at once (``_restop``): it stops at its handler's entry, with nothing pending.
    Without it no thread was lent, and every page of ours stayed in the program, said
    nowhere. Rejected: keeping its signal to deliver at its release (the last thread leaves
    from the stop of the last injection, where a signal given to PTRACE_DETACH is dropped)."""
    threads = [t for t in tracer.threads.values() if t.state is _STOPPED]
    if any(t.pending is None for t in threads):
        return
    for t in threads:
        status = t.pending
        if status is None or not _is_signal_stop(status):
            continue
        sig = _send_home(tracer, t)
        if sig is not None and _restop(tracer, t, sig):
            return


def _is_signal_stop(status: int) -> bool:
    """A signal-delivery-stop (a trap's included), not an event's or a syscall's."""
    return os.WIFSTOPPED(status) and status >> 16 == 0 and not os.WSTOPSIG(status) & 0x80


_RESTOPS = 16  # signals delivered, at most, before a thread is held with none pending


def _restop(tracer: Tracer, t: Thread, sig: int) -> bool:
    """Resume ``t`` with ``sig`` and hold it again at once (PTRACE_INTERRUPT): True once it
    is in the interrupt's stop. A signal that stops it first is delivered in turn; anything
    else is left pending, as it came, for its release (Step 5)."""
    for _ in range(_RESTOPS):
        try:
            ptrace.cont(t.tid, sig)
            ptrace.interrupt(t.tid)
            status = ptrace.waitpid(t.tid, 0)[1]
        except (ProcessLookupError, ChildProcessError):
            tracer.drop_thread(t)
            return False
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            tracer.drop_thread(t)
            return False
        event = status >> 16
        if event == ptrace.PTRACE_EVENT_STOP and os.WSTOPSIG(status) == signal.SIGTRAP:
            t.event_stopped = True
            return True
        if not _is_signal_stop(status):
            break
        sig = os.WSTOPSIG(status)
    t.pending, t.pending_from = status, _STOPPED
    return False


def _deactivate_rescue(tracer: Tracer, thread: Thread, *, keep_fetch_faults: bool) -> None:
    """Put the program's own signal actions back, through ``thread`` (held, sent home).

    The injections go home by themselves on the rescue's ``syscall; ret`` (selfrestore.py),
    not on its stub: once the program's own SIGTRAP action is back, the stub's trap would be
    the program's, and a tool killed inside the injection would leave the thread to die of
    it. Where no way home is possible (a shadow stack) they run on the stub, and that window
    stays open. Without a thread the rescue stays installed, which is harmless: it hands
    every trap and fault that is not ours to the program's own action, and no trap of ours
    is left.
    """
    rescue = tracer.rescue
    if not rescue.is_installed:
        return
    with contextlib.suppress(TargetError, InternalError, ProcessLookupError):
        way = selfrestore.find_way_home(thread, rescue_area=rescue.area)
        if way is None:
            rescue.deactivate(
                lambda nr, *args: calls.run_syscall(thread, 0, nr, *args, rescue=rescue),
                keep_fetch_faults=keep_fetch_faults,
            )
        else:
            rescue.deactivate(
                lambda nr, *args: selfrestore.run_syscall(thread, way, nr, *args),
                keep_fetch_faults=keep_fetch_faults,
            )


def _uncover(tracer: Tracer, shield: Shield, thread: Thread) -> None:
    """Step 6: the pages our int3s and jumps were on get the protection they had (shield.py),
    through ``thread`` (held, sent home), all but a page where a byte of ours could not be
    taken back; without the rescue's stub to run it on, they stay writable, which harms
    nothing."""
    rescue = tracer.rescue
    pid = thread.tracee.pid
    if not rescue.is_installed or not shield.covered(pid):
        return
    with contextlib.suppress(TargetError, InternalError, ProcessLookupError):
        busy = _pages_with_our_bytes(tracer, thread.tracee)
        free = [page for page in shield.covered(pid) if page not in busy]
        if free:
            shield.uncover(
                pid,
                free,
                lambda nr, *args: calls.run_syscall(thread, 0, nr, *args, rescue=rescue),
                thread.tracee,
                thread.regs.rsp,
            )


def _pages_with_our_bytes(tracer: Tracer, space: Tracee) -> set[int]:
    """The pages of ``space`` where a byte of ours is still (Step 2 restores the bytes, not
    the bookkeeping): an int3 at an address we armed whose own byte is not one, or a jump
    site whose four last bytes are not the original's."""
    breakpoints = tracer.breakpoints
    pages: set[int] = set()
    for addr, original in breakpoints.ever_patched.items():
        with contextlib.suppress(TargetError):
            mine = addr not in breakpoints.ever_jumped and original != 0xCC
            if mine and space.read(addr, 1)[0] == 0xCC:
                pages.update(pages_of(addr, 1))
    for addr, (jmp, first5) in breakpoints.ever_jumped.items():
        with contextlib.suppress(TargetError):
            if space.read(addr + 1, len(first5) - 1) != first5[1:]:
                pages.update(pages_of(addr, len(jmp)))
    return pages


def _give_back(unmapping: Unmapping, thread: Thread, *, rescue: bool) -> None:
    """Step 6 (``unmapping.py``): a failure leaves pages mapped, never the program hurt."""
    with contextlib.suppress(TargetError, InternalError, ProcessLookupError):
        if rescue:
            unmapping.give_back_rescue(thread)
        else:
            unmapping.give_back(thread)


def _may_fetch(tracer: Tracer, t: Thread) -> bool:
    """Is ``t`` (sent home, its registers in the view) in detour code of ours, or will it
    return into some from a signal handler? Then a fetch of ours may still fault in it.

    The signal frame is found as the optimizer finds one: a word in the 64 KiB above the
    stack pointer inside our pages. The out-of-line area's pages hold no fetch and are left
    out (the trampoline's address may linger in the stack).
    """
    faults = tracer.fetch_faults
    if not tracer.rescue.is_fetch_faults_active:
        return False
    xol = tracer.xol

    def fetches_there(addr: int) -> bool:
        return faults.is_ours(addr) and not (xol is not None and xol.contains(addr))

    regs = t.regs
    if fetches_there(regs.rip):
        return True
    return any(fetches_there(word) for word in t.stack_words(regs.rsp))


def _home(tracer: Tracer, rip: int) -> int:
    """Where a thread stopped at ``rip`` inside one of our slots belongs in the original code."""
    xol = tracer.xol
    if xol is None or not xol.contains(rip):
        return rip
    page = xol.page_of(rip)
    assert page is not None
    slot = page.start + (rip - page.start) // SLOT_SIZE * SLOT_SIZE
    prepared = tracer.slot_history.get(slot)
    if prepared is None:
        return rip
    off = rip - slot
    if off == 0:
        return prepared.plan.addr
    if off >= prepared.plan.length:
        return prepared.plan.next_addr
    return rip


def _release(tracer: Tracer, t: Thread, unmapping: Unmapping) -> bool:
    """Steps 4 and 5 for ``t``; True if it was let go where a fetch of ours may still fault."""
    sig = _send_home(tracer, t)
    if sig is None:
        return False
    inside = _may_fetch(tracer, t)
    unmapping.look_at(t)
    _let_go(t, sig)
    return inside


def _send_home(tracer: Tracer, t: Thread) -> int | None:
    """Step 4: rip back on original code; the signal to deliver (None: the thread is gone)."""
    sig = 0
    if t.state is ThreadState.NEW:
        first = _first_stop(tracer, t.tid)
        if first is None or os.WIFEXITED(first) or os.WIFSIGNALED(first):
            return None
        t.state = ThreadState.STOPPED
    status = t.pending
    t.pending = None
    try:
        regs = t.load_regs()
    except ProcessLookupError:
        return None
    rip = regs.rip
    if status is not None:
        event = (status >> 16) & 0xFF
        if status == ev.SIGTRAP_STOP:
            # The trampoline lies in the out-of-line area too: test it before the slots.
            if rip - 1 == tracer.trampoline.addr and tracer.trampoline.addr:
                home = tracer.trampoline.home_of(t, regs.rsp)
                if home is not None:
                    rip = home  # a return not yet reported: go where it was going
            elif t.pending_from is ThreadState.STEPPING or (
                tracer.xol and tracer.xol.contains(rip)
            ):
                pass  # the end of an out-of-line step: _home() below maps rip back
            elif rip - 1 in tracer.breakpoints.ever_patched:
                rip -= 1  # the hit was not handled: run the restored instruction
            else:
                sig = signal.SIGTRAP  # the program's own
        elif event == 0 and os.WIFSTOPPED(status):
            sig = os.WSTOPSIG(status)
            if tracer.fetch_faults.fix(t, sig):
                sig = 0  # a fetch of ours hit a bad pointer: on past it
                rip = regs.rip
        elif event in (
            ptrace.PTRACE_EVENT_CLONE,
            ptrace.PTRACE_EVENT_FORK,
            ptrace.PTRACE_EVENT_VFORK,
        ):
            _adopt_child(tracer, t, event)
    tramp = tracer.trampoline.addr
    if rip == tramp and tramp:  # held back onto the trampoline's int3 (World._hold)
        home = tracer.trampoline.home_of(t, regs.rsp)
        if home is not None:
            rip = home
    rip = _home(tracer, rip)
    if rip != regs.rip:
        regs.rip = rip
        t.store_regs()
    return sig


def _first_stop(tracer: Tracer, tid: int) -> int | None:
    """The first stop of a new thread: reaped already (waiting in the inbox), or to come."""
    status = tracer.world.take_stop(tid)
    if status is not None:
        return status
    try:
        return ptrace.waitpid(tid, 0)[1]
    except ChildProcessError:
        return None


def _let_go(t: Thread, sig: int) -> None:
    """Step 5: detach, delivering ``sig`` (or a signal we were holding)."""
    # A signal-delivery-stop detached with its sig keeps its own siginfo; otherwise deliver a
    # signal we were holding, with the siginfo it came with.
    if not sig and t.held_signals:
        sig, info = t.held_signals.pop(0)
        ptrace.setsiginfo(t.tid, info)
    with contextlib.suppress(ProcessLookupError):
        ptrace.detach(t.tid, sig)


def _adopt_child(tracer: Tracer, parent: Thread, event: int) -> None:
    """A clone/fork reported while we were stopping: its child must be released too."""
    child = ptrace.geteventmsg(parent.tid)
    if child in tracer.threads:
        return
    if event == ptrace.PTRACE_EVENT_CLONE:
        tracer.add_thread(parent.tracee, child, ThreadState.NEW)
        return
    kind = TraceeKind.VFORK if event == ptrace.PTRACE_EVENT_VFORK else TraceeKind.RELEASE
    tracee = tracer.add_tracee(child, kind)
    tracer.add_thread(tracee, child, ThreadState.NEW)
    if kind is TraceeKind.RELEASE:
        tracer.breakpoints.restore_all(tracee)
        tracee.inherited_returns = tracer.trampoline.snapshot(parent)
        tracer.trampoline.restore_child(tracee)
