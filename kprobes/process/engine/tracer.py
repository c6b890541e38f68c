"""The event loop: wait for a thread to stop, decide what the stop means, resume it.

A breakpoint hit is the hot path and is handled first, straight from the wait status
(``0x57f``: stopped by SIGTRAP, no ptrace event), with one PTRACE_GETREGS, the handlers, the
out-of-line plan, one PTRACE_POKEUSER of rip (PTRACE_SETREGS if a handler or the emulation
wrote another register) and one PTRACE_CONT; a return into the kretprobe trampoline likewise.
Everything else is decoded into an event value (``events.py``) and matched.

Stopping the world (``stop_world``/``resume_world``) is how patches are made safely: every
running thread gets PTRACE_INTERRUPT and we wait until each has stopped. A thread that stops
for another reason meanwhile (a hit, a signal, a clone) keeps that status as ``pending`` and is
handled by ``run()`` once the world runs again; nothing is lost or handled twice.

Signals that arrive while a thread executes an out-of-line copy are held and delivered, with
their original siginfo, when the copy has finished (a fault in the copy itself restarts the
instruction at the probed address and is delivered there), never by sending the thread back
to the probed address; a ``syscall`` copy gets its held signals back once inside the syscall,
so that a blocking one is still interrupted (signals.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from kprobes.arch.x86_64.plan import PlanKind, step_fixup
from kprobes.arch.x86_64.regs import REG_INDEX
from kprobes.arch.x86_64.rescue import put_back_mark
from kprobes.core.manager import ProbeManager
from kprobes.core.table import ProbeSite
from kprobes.errors import InternalError
from kprobes.linux import ptrace
from kprobes.process.engine import events as ev
from kprobes.process.engine import owners
from kprobes.process.engine.breakpoints import Breakpoints
from kprobes.process.engine.cpus import Placement
from kprobes.process.engine.lifecycle import Lifecycle
from kprobes.process.engine.prepared import Prepared
from kprobes.process.engine.signals import SignalDelivery
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind
from kprobes.process.engine.trampoline import Trampoline
from kprobes.process.engine.world import WorldStop
from kprobes.process.engine.xol import XolArea
from kprobes.process.fast.optimizer import JumpState
from kprobes.process.fetch.faults import FetchFaults
from kprobes.process.survival.rescue import Rescue
from kprobes.process.survival.trapguard import TrapGuard

S = ThreadState
# Members looked up once: in CPython 3.11 reading an attribute of an Enum class goes through
# the metaclass's __getattr__ hook (about 900 instructions), never a specialised lookup.
_STOPPED = S.STOPPED
_RUNNING = S.RUNNING
_STEPPING = S.STEPPING
_EMULATE = PlanKind.EMULATE
_BOOST = PlanKind.BOOST
_STEP = PlanKind.STEP
_RIP = REG_INDEX["rip"]


class Tracer(WorldStop, SignalDelivery, Lifecycle):
    def __init__(self, manager: ProbeManager, *, follow_forks: bool) -> None:
        self.manager = manager
        self.sites = manager.table.sites
        self.follow_forks = follow_forks
        self.tracees: dict[int, Tracee] = {}
        self.threads: dict[int, Thread] = {}
        self.main: Tracee | None = None
        self.breakpoints = Breakpoints()
        self.xol: XolArea | None = None
        self.slot_owner: dict[int, ProbeSite] = {}
        self.slot_history: dict[int, Prepared] = {}  # every slot ever filled, for detach
        self.hold_all = False  # spawned and not yet run(): keep every thread stopped
        self.exit_code: int | None = None
        self.inbox: list[tuple[int, int]] = []
        self.live = 0  # tracees that keep run() going (the program and followed children)
        self.has_pending = False  # some thread holds a status received while stopping
        self.on_gone: Callable[[], None] = lambda: None
        # Followed children that exec'd, driven by this loop (family.py); and who adopts one.
        self.family: list[Tracer] = []
        self.on_child_exec: Callable[[Tracee, Thread], bool] = lambda tracee, t: False
        # A syscall stop (PTRACE_SYSCALL: the exit of execve, the loader's startup), for
        # the target to look at before the thread goes on.
        self.on_syscall: Callable[[Thread], None] = lambda t: None
        self.trap_guard: TrapGuard | None = None
        self.guarding = False  # the trap guard is armed: hits take the full path
        self.trampoline = Trampoline(self)
        self.rescue = Rescue()  # what the program needs to carry on if the tool dies
        self.fetch_faults = FetchFaults()  # our code's pages, where a fault may be a fetch's
        self.optimizer = JumpState()  # optimized probes (optimizer.py)
        # Record probes (reader.py): their rings are read every POLL seconds while run()
        # waits, and a new thread's first stop tells which thread pointer it has.
        self.ring_poll: Callable[[], None] | None = None
        self.on_thread_start: Callable[[Thread], None] | None = None
        self.placement = Placement()  # hot threads on the tool's CPU (cpus.py)
        self._stop_depth = 0

    # -- bookkeeping -----------------------------------------------------------------------

    def add_tracee(self, pid: int, kind: TraceeKind) -> Tracee:
        tracee = Tracee(pid, kind)
        self.tracees[pid] = tracee
        if kind in (TraceeKind.MAIN, TraceeKind.FORK):
            self.live += 1
        if kind is TraceeKind.MAIN:
            self.main = tracee
        return tracee

    def add_thread(self, tracee: Tracee, tid: int, state: ThreadState) -> Thread:
        thread = tracee.add_thread(tid, state)
        self.threads[tid] = thread
        for status in owners.claim(self, tid):
            self.inbox.append((tid, status))
        return thread

    def drop_thread(self, thread: Thread) -> None:
        if thread.rets:
            self.trampoline.forget_thread(thread)
        self.threads.pop(thread.tid, None)
        thread.tracee.threads.pop(thread.tid, None)
        self.placement.forget(thread.tid)
        owners.release(self, thread.tid)

    def drop_tracee(self, tracee: Tracee) -> None:
        for thread in list(tracee.threads.values()):
            self.drop_thread(thread)
        tracee.close_memory()
        if self.tracees.pop(tracee.pid, None) is not None and tracee.kind in (
            TraceeKind.MAIN,
            TraceeKind.FORK,
        ):
            self.live -= 1
        if tracee is self.main:
            self.main = None

    def own_memories(self) -> Iterator[Tracee]:
        """Address spaces with their own copy of the code: where patches must be written."""
        for tracee in self.tracees.values():
            if tracee.kind in (TraceeKind.MAIN, TraceeKind.FORK):
                yield tracee

    @property
    def is_alive(self) -> bool:
        return self.live > 0

    # -- run -------------------------------------------------------------------------------

    def run(self, timeout: float | None) -> bool:
        """Dispatch stops until the program is gone (True) or ``timeout`` passes (False).

        The common stop, a hit of a probe with a one-stop plan and no post handler, is
        finished here inline, and so is a return into the trampoline: three ptrace requests
        (GETREGS; POKEUSER of rip, or SETREGS when a handler or the emulation changed another
        register; CONT) made through the thread's bound requests, and nothing else that can
        be left out. Every other stop is decoded and dispatched.
        """
        if self.hold_all:
            self.hold_all = False
            for thread in list(self.threads.values()):
                if thread.state is S.STOPPED and thread.pending is None and not thread.busy:
                    thread.resume()
        deadline = None if timeout is None else time.monotonic() + timeout
        threads = self.threads
        sites = self.sites
        table = self.manager.table
        wait = ptrace.wait
        waitpid = os.waitpid
        reap_options = ptrace.WNOHANG | ptrace.WALL
        raise_error = ptrace.raise_error
        trampoline = self.trampoline
        rescue = self.rescue
        TRAP = ev.SIGTRAP_STOP
        RUNNING = _RUNNING
        STOPPED = _STOPPED
        # `while True` and a break, not `while self.live`: CPython 3.11 specialises a function
        # called once (as this one is) only from an unconditional backward jump, and the
        # conditional one that `while self.live:` compiles to is not one. Written the other
        # way, every hit ran unspecialised bytecode: a third more instructions per hit.
        # Likewise a bound request is read into a local, then called: `req.cont()` compiles
        # to LOAD_METHOD, which 3.11 cannot specialise for a callable held in a slot.
        while True:
            if self.family and any(m.inbox or m.has_pending for m in self.family):
                self._pump_family()
            if not self.live and not self.family:
                break
            if self.has_pending:
                self._drain_pending()
            if deadline is not None and time.monotonic() >= deadline:
                return False  # between stops, also while they never cease
            poll = self.ring_poll
            if poll is not None:
                tid, status = self._wait_polling(deadline, poll)
            elif deadline is None and not self.inbox:
                try:
                    tid, status = wait(-1, 0)
                except ChildProcessError:
                    tid = status = 0
            else:
                tid, status = self._wait(deadline)
            if tid == 0:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._all_gone()
                break
            try:
                t = threads[tid]
            except KeyError:
                if status == TRAP and owners.is_members_running(self, tid):
                    self._unowned(tid, status)  # not reaped: the member's dispatch holds it
                else:
                    self._set_aside(tid, status)
                if self.family:
                    self._pump_family()
                    if table.pending_error is not None:  # a member's handler, or end_run()
                        exc = table.take_error()
                        assert exc is not None
                        raise exc from None
                continue
            if status == TRAP and t.state is RUNNING:
                t.state = STOPPED
                t.stops_to_check -= 1
                if not t.stops_to_check:
                    self.placement.check(t)
                req = t.req
                request = req.getregs
                if request() == -1:
                    raise_error()
                regs = t.regs
                regs.dirty = False
                w = t.words
                addr = w[_RIP] - 1
                site = sites.get(addr)
                # The stop is not reaped yet (ptrace.wait): the kernel still holds the trap,
                # which it delivers if the tool dies now. Reaped, it is gone, and the
                # thread must by then be in a state it can go on from without it (see
                # _hold_trap, which the other paths call).
                if site is None or not site.is_armed:
                    info = self._hold_trap(t, None, addr)
                    if addr == trampoline.addr and addr and not self.guarding:
                        # Step 1: pair the return (rip in the view: the real address); it
                        # goes to the kernel before any handler runs, so that the thread
                        # goes home by itself should the tool die in a handler.
                        chain = trampoline.take_return(t)
                        word = t.rip_word
                        word.value = w[_RIP]
                        poke_user = req.poke_user
                        if poke_user(word) == -1:
                            raise_error()
                        # Step 2: the handlers.
                        if chain:
                            trampoline.report_return(t, chain)
                            if regs.dirty:
                                request = req.setregs
                                if request() == -1:
                                    raise_error()
                        self._after_handler(t)
                    else:
                        self._foreign_trap(t, info)
                elif t.skip_hit is not None or self.guarding:
                    self._hold_trap(t, site.ainsn, addr)
                    self._hit(t, site)
                else:
                    x: Prepared = site.ainsn
                    emulator = x.emulator
                    poke_user = req.poke_user
                    # Step 0: a state right with the trap delivered or without it (see
                    # _hold_trap), then the reap. A slot is one (the rescue lets a trap in
                    # our pages go on); an emulated instruction goes back on its int3.
                    if emulator is None:
                        if poke_user(x.slot_word) == -1:
                            raise_error()
                    else:
                        if addr - 1 in rescue.noted:  # the rescue would take it for that one's
                            ptrace.setsiginfo(t.tid, put_back_mark(addr))
                        if poke_user(x.addr_word) == -1:
                            raise_error()
                    got, late = waitpid(tid, reap_options)
                    if got and late != TRAP:
                        self.inbox.append((tid, late))
                    # Step 1: before any handler runs, the kernel's registers become a state
                    # the program can go on from by itself, should the tool die now (see
                    # _make_safe and rescue.py): the slot, or the emulated instruction's
                    # effect. Unless a handler writes a register or redirects, this is the
                    # only write the hit needs (a slot's was step 0).
                    if emulator is not None:
                        if x.is_rip_only:
                            emulator(w, t.tracee)
                            word = t.rip_word
                            word.value = w[_RIP]
                            result = poke_user(word)
                        else:  # the whole emulation now; the view keeps the state before it
                            before = bytes(regs.buffer)
                            emulator(w, t.tracee)
                            request = req.setregs
                            result = request()
                            regs.buffer[:] = before
                        if result == -1:
                            raise_error()
                    w[_RIP] = addr  # handlers see ip at the probed instruction
                    # Step 2: the handlers.
                    redirected = False
                    if site.active:
                        t.busy = True
                        redirected = site.run_pre(regs)
                        t.busy = False
                    # Step 3: on, past the probed instruction.
                    if (
                        redirected
                        or not x.is_one_stop
                        or site.posts
                        or t.pending is not None
                        or t.state is not STOPPED
                    ):
                        self._finish_hit(t, site, redirected)
                    else:
                        result = 0
                        if emulator is None:  # BOOST: the slot is in place
                            if regs.dirty:
                                w[_RIP] = x.slot
                                request = req.setregs
                                result = request()
                            # else the view keeps rip at the probed address: the thread
                            # runs on now, and its next stop reloads the view.
                        elif regs.dirty:  # again, from the registers the handler left
                            emulator(w, t.tracee)
                            request = req.setregs
                            result = request()
                        # else the emulated state is in place
                        if result == -1:
                            raise_error()
                        if t.held_signals:
                            t.resume()
                        else:
                            request = req.cont
                            if request() == -1:
                                raise_error()
                            t.state = RUNNING
            else:
                self.dispatch(t, status)
            if table.pending_error is not None:
                exc = table.take_error()
                assert exc is not None
                raise exc
        return True

    def _set_aside(self, tid: int, status: int) -> None:
        owners.set_aside(self, tid, status)

    def _unowned(self, tid: int, status: int) -> None:
        owners.pass_on(self, tid, status)

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, t: Thread, status: int) -> None:
        event = ev.decode(t.tid, status)
        match event:
            case ev.Trap():  # not reaped yet, if it came from the wait (ptrace.wait)
                stepping = t.state is _STEPPING
                t.to(_STOPPED)
                self.placement.count(t)
                regs = t.load_regs()
                if stepping:
                    self._reap(t.tid)
                    self._finish_step(t)
                    return
                addr = regs.rip - 1
                site = self.sites.get(addr)
                if site is not None and site.is_armed:
                    self._hold_trap(t, site.ainsn, addr)
                    self._hit(t, site)
                else:
                    self._foreign_trap(t, self._hold_trap(t, None, addr))
            case ev.Signal(signal=sig):
                self._on_signal(t, sig)
            case ev.SyscallStop() if t.to_syscall_entry and t.state is _STEPPING:
                self._entered_step_syscall(t)
            case ev.SyscallStop():
                t.to(S.STOPPED)
                t.event_stopped = True  # no signal can be injected from a syscall stop
                t.busy = True  # a stop of the world in on_syscall must not resume it
                t.load_regs()  # the view a busy thread's injection starts from
                try:
                    self.on_syscall(t)
                finally:
                    t.busy = False
                self._resume_if_free(t)
            case ev.Exited(code=code):
                self._on_exit(t, code)
            case ev.Killed(signal=sig):
                self._on_exit(t, -sig)
            case ev.NewThread():
                t.to(S.STOPPED)
                new_tid = ptrace.geteventmsg(t.tid)
                self.placement.on_new_task(t.tid, new_tid, is_thread=True)
                if new_tid not in self.threads:
                    self.add_thread(t.tracee, new_tid, S.NEW)
                self._resume_if_free(t)
            case ev.Forked(is_vfork=is_vfork):
                t.to(S.STOPPED)
                child = ptrace.geteventmsg(t.tid)
                self.placement.on_new_task(t.tid, child, is_thread=False)
                if is_vfork:
                    kind = TraceeKind.VFORK
                else:
                    kind = TraceeKind.FORK if self.follow_forks else TraceeKind.RELEASE
                if child not in self.tracees:
                    tracee = self.add_tracee(child, kind)
                    if t.rets and kind is not TraceeKind.VFORK:
                        tracee.inherited_returns = self.trampoline.snapshot(t)
                    self.add_thread(tracee, child, S.NEW)
                self._resume_if_free(t)
            case ev.Exec():
                self._on_exec(t)
            case ev.GroupStop():
                t.to(S.GROUP_STOPPED)
                t.interrupt_sent = False
                ptrace.listen(t.tid)
            case ev.EventStop():
                # our interrupt, a new thread's first stop, or the end of a group-stop
                t.interrupt_sent = False
                was_new = t.state is S.NEW
                # An interrupt that outlived the stop of the world (sent to a thread already
                # stopped, it traps at its next resume) does not end what the thread was
                # doing: one in the middle of its step goes back to it.
                t.resume_stepping = t.state is S.STEPPING
                t.to(S.STOPPED)
                t.event_stopped = True
                if was_new and self.on_thread_start is not None:
                    self.on_thread_start(t)
                if was_new and t.tracee.kind is not TraceeKind.MAIN:
                    self._first_stop_of_child(t)
                else:
                    self._resume_if_free(t)
            case ev.OtherEvent():
                t.to(S.STOPPED)
                self._resume_if_free(t)

    def _resume_if_free(self, t: Thread) -> None:
        if not (self.hold_all or self._stop_depth or t.busy):
            t.resume()

    # -- hits ------------------------------------------------------------------------------

    def _hit(self, t: Thread, site: ProbeSite) -> None:
        """``t`` stopped on the int3 of ``site``; its registers are loaded."""
        regs = t.regs
        addr = site.addr
        self._make_safe(t, site.ainsn, addr)
        skip = t.skip_hit
        redirected = False
        if skip is not None and skip == (addr, regs.rsp):
            t.skip_hit = None  # the handlers already ran for this execution
        elif site.active:
            t.busy = True
            try:
                redirected = site.run_pre(regs)
            finally:
                t.busy = False
        if self.trap_guard is not None and self.trap_guard.is_armed:
            self.trap_guard.repair(t)
        self._finish_hit(t, site, redirected)

    def _make_safe(self, t: Thread, x: Prepared, addr: int) -> None:
        """Step 1 of every hit (see ``run()``): the kernel's registers become a state the
        program can go on from by itself before any handler runs; the view keeps rip at the
        probed instruction, as handlers see it.

        The kernel drops the trap a thread was stopped for when its tracer dies (measured:
        the thread resumes at the int3's next byte, mid-instruction). So the thread is sent
        to the slot, or given the emulated instruction's effect, before the handlers run; a
        handler that writes registers has the emulation done again from them, and one that
        redirects has its registers written over it (a push's or call's store below the
        stack pointer stays: memory the probed instruction was about to write anyway).
        """
        w = t.words
        w[_RIP] = addr
        if x.emulator is None:
            w[_RIP] = x.slot
        elif not x.is_rip_only:  # the whole emulation; the view keeps the state before it
            before = bytes(t.regs.buffer)
            x.emulator(w, t.tracee)
            t.store_regs()
            t.regs.buffer[:] = before
            return
        else:
            x.emulator(w, t.tracee)
        t.store_rip()
        w[_RIP] = addr

    def _finish_hit(self, t: Thread, site: ProbeSite, redirected: bool) -> None:
        """Run the probed instruction out of line (unless a pre handler redirected).

        ``_make_safe`` wrote the slot's address already where there is a slot.
        """
        if redirected:
            t.store_regs()
            self._after_handler(t)
            return
        x: Prepared = site.ainsn
        kind = x.kind
        if kind is _EMULATE:
            assert x.emulator is not None
            x.emulator(t.words, t.tracee)
            self._run_post(t, site)
            if x.is_rip_only:
                t.store_changes()
            else:
                t.store_regs()
            self._after_handler(t)
        elif kind is _BOOST:
            t.words[_RIP] = x.slot
            if t.regs.dirty:
                t.store_regs()
            self._after_handler(t)
        else:
            t.words[_RIP] = x.slot
            if t.regs.dirty:
                t.store_regs()
            t.step_site = site
            t.step_prep = x
            if t.pending is None and t.state is _STOPPED:
                if kind is _STEP:
                    ptrace.cont(t.tid, 0)
                    t.state = _STEPPING
                else:
                    t.step()

    def _run_post(self, t: Thread, site: ProbeSite) -> None:
        if site.posts:
            t.busy = True  # a handler may stop the world: nobody else may resume this thread
            try:
                site.run_post(t.regs)
            finally:
                t.busy = False

    def _after_handler(self, t: Thread) -> None:
        """Resume ``t`` unless a handler stopped the world and left it held."""
        if t.state is _STOPPED and t.pending is None and not self.hold_all:
            if t.held_signals:
                t.resume()
            else:
                cont = t.req.cont
                if cont() == -1:
                    ptrace.raise_error()
                t.state = _RUNNING

    def _finish_step(self, t: Thread) -> None:
        site = t.step_site
        if site is None:
            raise InternalError(f"thread {t.tid} finished a step it was not doing")
        t.step_site = None
        t.to_syscall_entry = False  # resumed by PTRACE_CONT, it ran into the guard int3
        x: Prepared = t.step_prep
        w = t.words
        w[_RIP] = step_fixup(x.plan, x.slot, w[_RIP])
        if x.kind is _BOOST and w[_RIP] == site.addr:
            t.skip_hit = (site.addr, t.regs.rsp)  # a rep not done: its int3 is not a new hit
        t.store_rip()  # past the probed instruction before the post handler (see run())
        self._run_post(t, site)
        if t.regs.dirty:
            t.store_regs()
        self._after_handler(t)

    def _return_hit(self, t: Thread) -> None:
        """``t`` returned into the kretprobe trampoline."""
        if self.trap_guard is not None and self.trap_guard.is_armed:
            self.trap_guard.repair(t)
        chain = self.trampoline.take_return(t)
        t.store_rip()  # home before the handlers (see run())
        if chain:
            self.trampoline.report_return(t, chain)
            if t.regs.dirty:
                t.store_regs()
        self._after_handler(t)
