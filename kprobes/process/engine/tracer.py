"""The event loop: wait for a thread to stop, decide what the stop means, resume it.

A breakpoint hit is the hot path and is handled first, straight from the wait status
(``0x57f``: stopped by SIGTRAP, no ptrace event), with one PTRACE_GETREGS, the handlers, the
out-of-line plan, one PTRACE_POKEUSER of rip (PTRACE_SETREGS if a handler or the emulation
wrote another register) and one PTRACE_CONT; a return into the kretprobe trampoline likewise.
Everything else is decoded into an event value (``events.py``) and matched.

The tracer holds its mechanisms as parts, each behind what it may ask of the tracer
(written where the part is defined): ``world`` stops and resumes every thread so that
patches are made safely, and keeps the stops that come meanwhile (world.py); ``signals``
handles signal stops, holding those that arrive while a thread executes an out-of-line copy
(signals.py); ``lifecycle`` exit, exec and children (lifecycle.py); ``trampoline`` the
returns (trampoline.py); ``placement`` the threads' CPUs (cpus.py). The hit path itself
is here, written once.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kprobes.arch.x86_64.plan import PlanKind, step_fixup
from kprobes.arch.x86_64.regs import REG_INDEX
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
from kprobes.process.engine.rescue import Rescue
from kprobes.process.engine.signals import Signals
from kprobes.process.engine.threads import Thread, ThreadState, siginfo_code
from kprobes.process.engine.tracee import Tracee, TraceeKind
from kprobes.process.engine.trampoline import Trampoline
from kprobes.process.engine.world import World, put_back
from kprobes.process.engine.xol import XolArea

if TYPE_CHECKING:
    from kprobes.process.engine.contracts import FastTier, FaultFixer, Guardian

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


class Tracer:
    def __init__(
        self,
        manager: ProbeManager,
        *,
        follow_forks: bool,
        rescue: Rescue,
        fetch_faults: FaultFixer,
    ) -> None:
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
        self.live = 0  # tracees that keep run() going (the program and followed children)
        # Set by Process.run(), cleared while run() waits: stops are being handled, threads
        # resumed (no safe point for SIGINT, cli/sigint.py: a thread resumed and not yet
        # marked running is in no ptrace stop, and /proc cannot tell that an exception
        # there would leave it marked stopped, lost to every later stop of the world).
        self.is_dispatching = False
        self.forks = 0  # fork children followed so far: each address space its number
        self.on_gone: Callable[[], None] = lambda: None
        # Followed children that exec'd, driven by this loop (family.py); and who adopts one.
        self.family: list[Tracer] = []
        self.on_child_exec: Callable[[Tracee, Thread], bool] = lambda tracee, t: False
        # A syscall stop (PTRACE_SYSCALL: the exit of execve, the loader's startup), for
        # the target to look at before the thread goes on.
        self.on_syscall: Callable[[Thread], None] = lambda t: None
        self.trap_guard: Guardian | None = None
        self.guarding = False  # the trap guard is armed: hits take the full path
        self.trampoline = Trampoline(self)
        self.rescue = rescue  # what the program needs to carry on if the tool dies
        self.fetch_faults = fetch_faults  # our code's pages, where a fault may be a fetch's
        self.fast: FastTier | None = None  # the optimized tier, once there is one (fast/)
        # Record probes (reader.py): their rings are read every POLL seconds while run()
        # waits, and a new thread's first stop (or a vfork parent's return) tells which
        # thread pointer names it.
        self.ring_poll: Callable[[], None] | None = None
        self.on_thread_start: Callable[[Thread], None] | None = None
        self.placement = Placement()  # hot threads on the tool's CPU (cpus.py)
        self.lifecycle = Lifecycle(self)  # exit, exec, children, the family (lifecycle.py)
        self.world = World(
            self,
            breakpoints=self.breakpoints,
            trampoline=self.trampoline,
            rescue=rescue,
            table=manager.table,
        )
        self.signals = Signals(self, slot_owner=self.slot_owner, fetch_faults=fetch_faults)

    # -- bookkeeping -----------------------------------------------------------------------

    def add_tracee(self, pid: int, kind: TraceeKind) -> Tracee:
        tracee = Tracee(pid, kind)
        self.tracees[pid] = tracee
        if kind is TraceeKind.FORK:
            self.forks += 1
            tracee.number = self.forks
        if kind in (TraceeKind.MAIN, TraceeKind.FORK):
            self.live += 1
        if kind is TraceeKind.MAIN:
            self.main = tracee
        return tracee

    def add_thread(
        self, tracee: Tracee, tid: int, state: ThreadState, *, seized: bool = False
    ) -> Thread:
        """``tid`` is ours: ``seized`` by us just now (attached, or spawned), or a new
        thread or child an event of ours named (its stops that came first are its own)."""
        thread = tracee.add_thread(tid, state)
        self.threads[tid] = thread
        claimed = owners.claim(self, tid, seized=seized)
        self.world.inbox.extend((tid, status) for status in claimed)
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

        The common stop, a trap of a running thread, goes straight to ``_trap`` from the wait
        status: a hit of a probe with a one-stop plan and no post handler is three ptrace
        requests (GETREGS; POKEUSER of rip, or SETREGS when a handler or the emulation
        changed another register; CONT) made through the thread's bound requests, and
        nothing else that can be left out. Every other stop is decoded and dispatched.
        """
        if self.hold_all:
            self.hold_all = False
            for thread in list(self.threads.values()):
                if thread.state is S.STOPPED and thread.pending is None and not thread.busy:
                    thread.resume()
        deadline = None if timeout is None else time.monotonic() + timeout
        threads = self.threads
        table = self.manager.table
        world = self.world
        inbox = world.inbox
        wait = ptrace.wait
        TRAP = ev.SIGTRAP_STOP
        RUNNING = _RUNNING
        STOPPED = _STOPPED
        # `while True` and a break, not `while self.live`: CPython 3.11 specialises a function
        # called once (as this one is) only from an unconditional backward jump, which
        # `while self.live:` does not compile to: every hit ran a third more instructions.
        # Likewise a bound request is read into a local, then called: `req.cont()` compiles
        # to LOAD_METHOD, which 3.11 cannot specialise for a callable held in a slot.
        while True:
            if self.family and any(m.world.inbox or m.world.has_pending for m in self.family):
                self.lifecycle.pump_family()
            if not self.live and not self.family:
                break
            if world.has_pending:
                world.drain_pending()
            if deadline is not None and time.monotonic() >= deadline:
                return False  # between stops, also while they never cease
            poll = self.ring_poll
            if self.family and (poll is not None or any(m.ring_poll for m in self.family)):
                poll = self.lifecycle.poll_family  # the members' rings are read here too
            self.is_dispatching = False  # an exception in the wait loses nothing
            if poll is not None:
                tid, status = world.wait_polling(deadline, poll)
            elif deadline is None and not inbox:
                try:
                    tid, status = wait(-1, 0)
                except ChildProcessError:
                    tid = status = 0
            else:
                tid, status = world.wait(deadline)
            self.is_dispatching = True
            if tid == 0:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self.lifecycle.all_gone()
                break
            try:
                t = threads[tid]
            except KeyError:
                if status == TRAP and owners.is_members_running(self, tid):
                    self.take_unowned(tid, status)  # not reaped: the member's dispatch holds it
                else:
                    self.set_aside(tid, status)
                if self.family:
                    self.lifecycle.pump_family()
                    if table.pending_error is not None:  # a member's handler, or end_run()
                        exc = table.take_error()
                        assert exc is not None
                        raise exc from None
                continue
            if status == TRAP and t.state is RUNNING:
                t.state = STOPPED
                self._trap(t)
            else:
                self.dispatch(t, status)
            if table.pending_error is not None:
                exc = table.take_error()
                assert exc is not None
                raise exc
        return True

    def set_aside(self, tid: int, status: int) -> None:
        owners.set_aside(self, tid, status)

    def take_unowned(self, tid: int, status: int) -> None:
        owners.pass_on(self, tid, status)

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, t: Thread, status: int) -> None:
        event = ev.decode(t.tid, status)
        match event:
            case ev.Trap():  # not reaped yet, if it came from the wait (ptrace.wait)
                if t.state is _STEPPING:
                    t.to(_STOPPED)
                    self.placement.count(t)
                    t.load_regs()
                    self.world.reap(t.tid)
                    self._finish_step(t)
                    return
                t.to(_STOPPED)
                self._trap(t)
            case ev.Signal(signal=sig):
                self.signals.on_signal(t, sig)
            case ev.SyscallStop() if t.to_syscall_entry and t.state is _STEPPING:
                self.signals.entered_step_syscall(t)
            case ev.SyscallStop():
                t.to(S.STOPPED)
                t.event_stopped = True  # no signal can be injected from a syscall stop
                t.busy = True  # a stop of the world in on_syscall must not resume it
                t.load_regs()  # the view a busy thread's injection starts from
                try:
                    self.on_syscall(t)
                finally:
                    t.busy = False
                self.resume_if_free(t)
            case ev.Exited(code=code):
                self.lifecycle.on_exit(t, code)
            case ev.Killed(signal=sig):
                self.lifecycle.on_exit(t, -sig)
            case ev.NewThread():
                t.to(S.STOPPED)
                new_tid = ptrace.geteventmsg(t.tid)
                self.placement.on_new_task(t.tid, new_tid, is_thread=True)
                if new_tid not in self.threads:
                    self.add_thread(t.tracee, new_tid, S.NEW)
                self.resume_if_free(t)
            case ev.Forked(is_vfork=is_vfork):
                self._forked(t, is_vfork)
            case ev.Exec():
                self.lifecycle.on_exec(t)
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
                    self.lifecycle.first_stop_of_child(t)
                else:
                    self.resume_if_free(t)
            case ev.OtherEvent(event=kind):
                t.to(S.STOPPED)
                if kind == ptrace.PTRACE_EVENT_VFORK_DONE and self.on_thread_start is not None:
                    # Back from a vfork, held before it runs: its child ran on its stack with
                    # its thread pointer, and the fast tier's records named the child by it
                    # until now (read first); from now on they name this thread again.
                    self.on_thread_start(t)
                self.resume_if_free(t)

    def _forked(self, t: Thread, is_vfork: bool) -> None:
        """``t`` forked (or vforked): its child is taken in, to be followed or let go."""
        t.to(S.STOPPED)
        child = ptrace.geteventmsg(t.tid)
        self.placement.on_new_task(t.tid, child, is_thread=False)
        if is_vfork:
            kind = TraceeKind.VFORK
        else:
            kind = TraceeKind.FORK if self.follow_forks else TraceeKind.RELEASE
        if child not in self.tracees:
            tracee = self.add_tracee(child, kind)
            if kind is TraceeKind.VFORK:  # it runs in its parent's memory, salt and all
                tracee.number = t.tracee.number
            if t.rets and kind is not TraceeKind.VFORK:
                tracee.inherited_returns = self.trampoline.snapshot(t)
            self.add_thread(tracee, child, S.NEW)
        self.resume_if_free(t)

    def is_free(self, t: Thread) -> bool:
        """``t`` may be resumed now: the world is not stopped, nor is every thread held (a
        spawned program not run yet), nor does a handler hold ``t``."""
        return not (self.hold_all or self.world.is_stopped or t.busy)

    def resume_if_free(self, t: Thread) -> None:
        if self.is_free(t):
            t.resume()

    # -- hits ------------------------------------------------------------------------------

    def _trap(self, t: Thread) -> None:
        """``t`` (just marked stopped) trapped: on an int3 of a probe (a hit), into the
        trampoline (a return), or on a trap that is not ours. Its stop is not reaped yet
        (``ptrace.wait``): the kernel still holds the trap, which it delivers if the tool
        dies now. Reaped, it is gone, and the thread must by then be in a state it can go on
        from without it (step 0 of each path)."""
        t.stops_to_check -= 1
        if not t.stops_to_check:
            self.placement.check(t)
        request = t.req.getregs
        if request() == -1:
            ptrace.raise_error()
        t.regs.dirty = False
        addr = t.words[_RIP] - 1
        site = self.sites.get(addr)
        if site is not None and site.is_armed:
            self._hit(t, site, addr)
        else:
            self._other_trap(t, addr)

    def _other_trap(self, t: Thread, addr: int) -> None:
        """``t`` trapped on an int3 at ``addr`` where no armed probe is: a return into the
        kretprobe trampoline, a stale trap (an int3 we removed before its trap was seen), or
        the program's own trap.

        Step 0, as for a hit (``_hit``), then the reap. Until the reap the kernel holds the
        trap, and delivers it to the program (to the rescue) if the tool dies; after it, the
        trap is gone and the thread goes on from its registers. Left one byte past an int3
        of ours, it would run the middle of an instruction (``decisions.md``, "the
        reaped-trap window"). So before the reap the thread is put where both are right: for
        a probe's trap, in the slot (the rescue lets a trap in our pages go on), or back on
        the probe's int3 (the rescue lets a trap that sits on an int3 of ours go on, and it
        is taken again; ``put_back``). Here, a stale trap goes back on its byte, the
        program's again. The trampoline's int3 and the program's own traps need nothing
        (the byte after the trampoline is an int3 too; the program's own trap, if the tool
        dies, is lost as a signal the tool held is).
        """
        trampoline = self.trampoline.addr
        if addr == trampoline and trampoline:
            self.world.reap(t.tid)
            self._return_hit(t)
            return
        info = ptrace.getsiginfo(t.tid)
        is_stale = siginfo_code(info) == ptrace.SI_KERNEL and self.breakpoints.is_stale_trap(addr)
        if is_stale:
            put_back(t, addr, True)  # Step 0: its byte is the program's again
        self.world.reap(t.tid)
        if is_stale:  # run the real instruction
            t.regs.rip = addr
            t.store_regs()
            site = self.sites.get(addr)
            if site is not None:
                site.miss()
            self._after_handler(t)
            return
        guard = self.trap_guard
        if guard is not None and not guard.is_armed:
            guard.arm_if_needed(t)
            self.guarding = guard.is_armed
            ptrace.setsiginfo(t.tid, info)  # the injection replaced the stop's siginfo
        t.resume(signal.SIGTRAP)  # the program's own trap: deliver it

    def _hit(self, t: Thread, site: ProbeSite, addr: int) -> None:
        """``t`` stopped on the int3 of ``site`` at ``addr``, registers loaded: the hit, the
        one place its rules are written (a one-stop plan finishes here). Step 1 makes the
        kernel's registers a state the program goes on from by itself should the tool die
        (rescue.py): the slot, or the emulation's effect; a handler's register writes or
        redirection are written over it after. Without those, it is the hit's one write.
        """
        x: Prepared = site.ainsn
        req = t.req
        regs = t.regs
        w = t.words
        # Step 0: before the reap, a state right with the trap delivered or without it
        # (``_other_trap`` says why): the slot, or back on the probe's int3.
        emulator = x.emulator
        if emulator is None:
            poke = req.poke_user
            if poke(x.slot_word) == -1:
                ptrace.raise_error()
        else:
            put_back(t, addr, addr - 1 in self.rescue.noted)
        self.world.reap(t.tid)
        # Step 1: safe before the handlers; the view keeps the state before the emulation.
        if emulator is not None:
            if x.is_rip_only:
                emulator(w, t.tracee)
                word = t.rip_word
                word.value = w[_RIP]
                poke = req.poke_user
                result = poke(word)
            else:
                before = bytes(regs.buffer)
                emulator(w, t.tracee)
                setregs = req.setregs
                result = setregs()
                regs.buffer[:] = before
            if result == -1:
                ptrace.raise_error()
        w[_RIP] = addr  # handlers see ip at the probed instruction
        # Step 2: the handlers, unless they ran already for this execution (a rep not done).
        redirected = False
        skip = t.skip_hit
        if skip is not None and skip == (addr, regs.rsp):
            t.skip_hit = None
        elif site.active:
            t.busy = True
            try:
                redirected = site.run_pre(regs)
            finally:
                t.busy = False
        if self.guarding and self.trap_guard is not None and self.trap_guard.is_armed:
            self.trap_guard.repair(t)
        # Step 3: on, past the probed instruction: at once for a one-stop plan.
        if (
            redirected
            or not x.is_one_stop
            or site.posts
            or t.pending is not None
            or t.state is not _STOPPED
            or self.hold_all
        ):
            self._finish_hit(t, site, redirected)
            return
        if regs.dirty:  # the handler wrote registers: on from them
            if emulator is None:  # BOOST: in the slot
                w[_RIP] = x.slot
            else:  # the emulation again
                emulator(w, t.tracee)
            setregs = req.setregs
            if setregs() == -1:
                ptrace.raise_error()
        # else the slot or the emulated state is in place (the view keeps rip at the
        # probed address: the thread's next stop reloads the view)
        if t.held_signals:
            t.resume()
        else:
            cont = req.cont
            if cont() == -1:
                ptrace.raise_error()
            t.state = _RUNNING

    def _finish_hit(self, t: Thread, site: ProbeSite, redirected: bool) -> None:
        """Step 3 of a hit (``_hit``) that is not finished at once: a redirection, a post
        handler, a plan that needs a second stop, or a thread a handler left held. Step 0
        wrote the slot's address already where there is a slot.
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
