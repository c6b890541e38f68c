"""Stopping the world: hold every thread of the program, so that patches are made safely.

Every running thread gets PTRACE_INTERRUPT and we wait until each has stopped. A thread that
stops for another reason meanwhile (a hit, a signal, a clone) keeps that status as
``pending`` and is handled by ``run()`` once the world runs again; nothing is lost or
handled twice. A held thread is always in a state it can go on from by itself (see
``rewind_own_trap`` and rescue.py): the tool may die while it holds the world.

``World`` is a part the tracer holds (``Tracer.world``); what it may ask of the tracer is
``WorldHost``, below. The rest of the package stops the world through it
(``tracer.world.stop()``/``resume()``) and reads ``is_stopped``. Rejected: a mixin of
``Tracer`` (as it was until issue 19), which shared the tracer's ``self`` and its private
stop depth with every module that needed to know whether the world was stopped.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Protocol

from kprobes.arch.x86_64.plan import PlanKind
from kprobes.arch.x86_64.regs import REG_INDEX
from kprobes.arch.x86_64.rescue import put_back_mark
from kprobes.errors import InternalError, TargetError
from kprobes.linux import procfs, ptrace
from kprobes.process.engine import events as ev
from kprobes.process.engine.threads import RUNNING_STATES, Thread, ThreadState, siginfo_code
from kprobes.process.engine.tracee import Tracee, TraceeKind

if TYPE_CHECKING:
    from collections.abc import Callable

    from kprobes.core.table import ProbeTable
    from kprobes.process.engine.breakpoints import Breakpoints
    from kprobes.process.engine.lifecycle import Lifecycle
    from kprobes.process.engine.rescue import Rescue
    from kprobes.process.engine.trampoline import Trampoline
    from kprobes.process.engine.xol import XolArea

S = ThreadState
_RIP = REG_INDEX["rip"]
# A thread not stopped after STOP_WORLD_TIMEOUT is looked at in /proc (a stop whose report
# was lost); one still running (not scheduled yet on a loaded machine, or in an
# uninterruptible sleep) is waited for, up to STOP_WORLD_GIVE_UP in all.
STOP_WORLD_TIMEOUT = 2.0
STOP_WORLD_GIVE_UP = 120.0
POLL = 0.002  # seconds between two polls (the record probes' rings) while run() waits
_REAP = ptrace.WNOHANG | ptrace.WALL
_TRAP_STOP = ptrace.TRAP_STOP


class WorldHost(Protocol):
    """What ``World`` may read and call on the tracer that holds it (tracer.py).

    It reads the tracer's threads (``threads``: every traced thread by tid; ``main``: the
    program's process) and whether the tracer holds every thread anyway (``hold_all``); it
    calls back to hand a stop to the loop (``dispatch``, ``set_aside`` for a thread another
    tracer owns) and to change the set of threads (``add_thread``, ``drop_thread``, a
    child's ``lifecycle``). It may assume that the tracer never resumes a thread while the
    world is stopped (``Tracer.resume_if_free``) and that ``dispatch`` of a stop that came
    while stopping the world is left to ``drain_pending`` (but an exit, and the program's
    exec in a stop that asks for it: ``stop(land_exec=True)``).
    """

    @property
    def threads(self) -> dict[int, Thread]: ...
    @property
    def main(self) -> Tracee | None: ...
    @property
    def hold_all(self) -> bool: ...
    @property
    def xol(self) -> XolArea | None: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    def dispatch(self, t: Thread, status: int) -> None: ...
    def set_aside(self, tid: int, status: int) -> None: ...
    def add_thread(self, tracee: Tracee, tid: int, state: ThreadState) -> Thread: ...
    def drop_thread(self, thread: Thread) -> None: ...


class World:
    """Stopping and resuming every thread, and the stops that come meanwhile.

    It owns the stops the loop has not handled yet: ``inbox`` (reaped, waiting their turn:
    a late status found at a reap, one another tracer passed on) and the statuses held by
    threads that stopped for a reason of their own while the world was being stopped
    (``Thread.pending``; ``has_pending`` says some thread holds one).
    """

    def __init__(
        self,
        host: WorldHost,
        *,
        breakpoints: Breakpoints,
        trampoline: Trampoline,
        rescue: Rescue,
        table: ProbeTable,
    ) -> None:
        self._host = host
        self._breakpoints = breakpoints
        self._trampoline = trampoline
        self._rescue = rescue
        self._table = table
        self._depth = 0
        self.inbox: list[tuple[int, int]] = []
        self.has_pending = False
        self._lands_exec = False  # this stop of the world handles an exec (``stop``)

    def held_thread(self, space: Tracee | None = None) -> Thread:
        """A thread of the program (of ``space``, a followed fork child's, if given) held
        still, for injection (prefer one no handler holds)."""
        main = self._host.main if space is None else space
        if main is None:
            raise TargetError("the program has exited")
        best: Thread | None = None
        for thread in main.threads.values():
            if thread.state is S.STOPPED and thread.pending is None:
                if not thread.busy:
                    return thread
                best = best or thread
        if best is None:
            raise InternalError("no held thread: the world is not stopped")
        return best

    # -- waiting for a stop, and the stops held back -------------------------------------

    def wait(self, deadline: float | None) -> tuple[int, int]:
        """The next stop: queued first, then from the kernel; (0, 0) at ``deadline`` or
        with no child left."""
        # The deadline first: a program whose threads stop as fast as we resume them would
        # otherwise never let run(timeout) return.
        if deadline is not None and time.monotonic() >= deadline:
            return 0, 0
        if self.inbox:
            return self.inbox.pop(0)
        if deadline is None:
            try:
                return ptrace.wait(-1, 0)
            except ChildProcessError:
                return 0, 0
        return self.wait_until(deadline) or (0, 0)

    @staticmethod
    def wait_until(until: float) -> tuple[int, int] | None:
        """The next stop before ``until``; None when it passes, (0, 0) with no child left."""
        ptrace.block_sigchld()
        try:
            while True:
                try:
                    tid, status = ptrace.wait(-1, ptrace.WNOHANG)
                except ChildProcessError:
                    return 0, 0
                if tid:
                    return tid, status
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return None
                ptrace.sigchld_wait(remaining)
        finally:
            ptrace.unblock_sigchld()

    def wait_polling(self, deadline: float | None, poll: Callable[[], None]) -> tuple[int, int]:
        """``wait``, calling ``poll`` every ``POLL`` seconds while no thread stops (the
        rings of record probes, reader.py); (0, 0) at the deadline or with no child left.
        An exception a handler raised in ``poll`` is raised here, between stops."""
        while True:
            if self.inbox:
                return self.inbox.pop(0)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return 0, 0
            stop = self.wait_until(now + POLL if deadline is None else min(now + POLL, deadline))
            if stop is not None:
                return stop
            poll()
            exc = self._table.take_error()
            if exc is not None:
                raise exc

    def drain_pending(self) -> None:
        self.has_pending = False
        for thread in list(self._host.threads.values()):
            if thread.pending is not None and not thread.busy:
                status, thread.pending = thread.pending, None
                thread.state = thread.pending_from
                self._host.dispatch(thread, status)

    def take_stop(self, tid: int) -> int | None:
        """The first queued stop of ``tid``, taken out of the inbox (None if there is none)."""
        for i, (who, status) in enumerate(self.inbox):
            if who == tid:
                del self.inbox[i]
                return status
        return None

    # -- stopping the world ------------------------------------------------------------------

    @property
    def is_stopped(self) -> bool:
        """Every thread is held (inside a ``stop``/``resume`` pair)."""
        return self._depth > 0

    def stop(self, *, land_exec: bool = False) -> None:
        """Hold every thread of every tracee; nested calls only count. ``land_exec``: an
        exec of the program found meanwhile is handled here (``_land_exec``): for a stop
        whose caller has computed nothing of the image yet (a registration's batch, the
        detach); any other caller finds it held back as before."""
        self._depth += 1
        if self._depth > 1:
            return
        self._lands_exec = land_exec
        threads = self._host.threads
        for t in list(threads.values()):
            if t.state in RUNNING_STATES and not t.interrupt_sent:
                try:
                    ptrace.interrupt(t.tid)
                    t.interrupt_sent = True
                except ProcessLookupError:
                    self._host.drop_thread(t)
        now = time.monotonic()
        deadline, give_up = now + STOP_WORLD_TIMEOUT, now + STOP_WORLD_GIVE_UP
        try:
            while any(t.state in RUNNING_STATES for t in threads.values()):
                tid, status = self.wait(deadline)
                if tid == 0:
                    now = time.monotonic()
                    if self._assume_stopped(is_last_chance=now >= give_up):
                        break
                    deadline = min(now + STOP_WORLD_TIMEOUT, give_up)
                    continue
                held = threads.get(tid)
                if held is None:
                    self._host.set_aside(tid, status)
                    continue
                self._hold(held, status)
        except BaseException:
            self.resume()  # the threads held so far run again; the caller sees why
            raise

    def reap(self, tid: int) -> None:
        """Reap a trap stop ``ptrace.wait`` left (a status found instead comes next); a
        no-op for one reaped already."""
        # waitpid itself, not through a helper of ptrace.py: this is on every hit's path.
        got, late = os.waitpid(tid, _REAP)
        if got and late != _TRAP_STOP:
            self.inbox.append((tid, late))

    def _hold(self, t: Thread, status: int) -> None:
        """Record a stop that arrived while stopping the world (a trap's not reaped yet,
        see ``ptrace.wait``: it is reaped here)."""
        host = self._host
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            host.dispatch(t, status)
            return
        event = (status >> 16) & 0xFF
        if (
            event == ptrace.PTRACE_EVENT_EXEC
            and t.tracee.kind is TraceeKind.MAIN
            and self._lands_exec
        ):
            t.interrupt_sent = False  # the exec's stop took our interrupt's place
            self._land_exec(t, status)
            return
        is_event_stop = event == ptrace.PTRACE_EVENT_STOP and os.WSTOPSIG(status) == signal.SIGTRAP
        # Any stop of a thread ends our interrupt's claim on it: the kernel clears a pending
        # PTRACE_INTERRUPT at every ptrace-stop ("any trap clears pending STOP trap").
        sent, t.interrupt_sent = t.interrupt_sent, False
        if is_event_stop and (sent or t.state is S.NEW):
            was = t.state
            was_new = was is S.NEW
            t.to(S.STOPPED)
            t.resume_stepping = was is S.STEPPING  # stopped before its step ended
            t.event_stopped = True
            if was in RUNNING_STATES and procfs.deliverable_signals(t.tracee.pid, t.tid):
                # The interrupt overtook a signal the thread had just raised (an int3 of
                # ours, a step, a fault): its trap is queued, not reported. Let it report
                # it now (the thread dequeues it before running a single instruction), so
                # that the stop is held as what it really is. Released or borrowed with
                # the trap still queued, the thread would take it without us: SIGTRAP.
                queued = self._report_queued(t)
                if queued is None:
                    host.drop_thread(t)
                else:
                    t.state = was
                    self._hold(t, queued)
                return
            if was_new and t.tracee.kind is not TraceeKind.MAIN:
                host.lifecycle.first_stop_of_child(t)  # held: the world is stopped
            return
        if status == ev.SIGTRAP_STOP:
            rewound = self.rewind_own_trap(t)
            self.reap(t.tid)
            if rewound:
                return
        if event == ptrace.PTRACE_EVENT_CLONE and t.state is S.RUNNING:
            # A new thread: take it in now (its first stop comes by itself), and let the
            # creator finish its clone() and stop again at our interrupt. Held in the
            # middle of the syscall it could not be lent for an injection (the kernel
            # writes clone's result over the injected call's registers).
            new_tid = ptrace.geteventmsg(t.tid)
            if new_tid not in host.threads:
                host.add_thread(t.tracee, new_tid, S.NEW)
            try:
                ptrace.cont(t.tid, 0)
                ptrace.interrupt(t.tid)
            except ProcessLookupError:
                host.drop_thread(t)
                return
            t.interrupt_sent = True
            return
        t.pending_from = t.state
        t.pending = status
        self.has_pending = True
        t.state = S.STOPPED

    def _land_exec(self, t: Thread, status: int) -> None:
        """The program exec'd before our interrupt could stop it: seized inside its
        ``execve`` (``Popen`` returns there, once the kernel has closed the child's
        close-on-exec pipe), or exec'ing as we stopped it. What this stop of the world is
        for (a registration, a detach) is about the new image, which our books do not
        describe yet, and a thread in an exec stop cannot be lent for an injection. So the
        exec is handled now as ``run()`` would handle it: the old image forgotten
        (``on_exec``), the thread taken on to the exit of ``execve`` (the next stop: the
        kernel reports it before any signal), and the new image's probes placed there
        (``on_syscall``), the thread held. Rejected: leaving the exec to ``drain_pending``
        (the registration failed with no thread to inject with, or resolved its symbols in
        the image gone)."""
        host = self._host
        host.dispatch(t, status)
        if t.tracee.kind is not TraceeKind.MAIN or t.tid not in host.threads:
            return
        try:
            ptrace.syscall_cont(t.tid, 0)
            status = ptrace.wait(t.tid, ptrace.WALL)[1]
        except (ProcessLookupError, ChildProcessError):
            host.drop_thread(t)
            return
        t.state = S.RUNNING
        if os.WIFSTOPPED(status) and status >> 8 == ev.SYSCALL_TRAP:
            host.dispatch(t, status)  # held: the world is stopped
        else:
            self._hold(t, status)  # killed meanwhile, say

    def rewind_own_trap(self, t: Thread) -> bool:
        """A thread that trapped on an int3 of ours while we stop the world: put it back on
        the int3, as if it had not got there yet (it takes the trap again once resumed).

        Held with rip past the int3, mid-instruction, the thread would resume there if the
        tool died (the kernel drops the trap), and an injection or a detach would have to
        know about the trap. Back on the int3, it is in a state it can go on from by itself:
        the rescue handles the trap, or the restored byte runs, or we see the trap again.
        Its stop is not reaped yet (``_hold`` reaps it): the kernel delivers the trap if
        the tool dies before, and the rescue lets a trap on an int3 of ours, or in our
        pages, go on (marked where it would take it for the address before, ``put_back``).
        """
        if siginfo_code(ptrace.getsiginfo(t.tid)) != ptrace.SI_KERNEL:
            return False  # a single-step, or a SIGTRAP sent by someone
        at = t.load_regs().rip - 1
        stepping = t.state is S.STEPPING
        if stepping:
            x = t.step_prep
            own = x is not None and x.kind is PlanKind.STEP and at == x.slot + x.plan.length
        else:
            trampoline = self._trampoline.addr
            own = at in self._breakpoints.ever_patched or (at == trampoline and at != 0)
        if not own:
            return False
        t.words[_RIP] = at
        put_back(t, at, not stepping and at - 1 in self._rescue.noted)
        t.state = S.STOPPED
        t.resume_stepping = stepping
        return True

    def _report_queued(self, t: Thread) -> int | None:
        """Resume ``t`` from its interrupt stop: the stop of its queued signal comes next
        (None if the thread is gone)."""
        try:
            ptrace.cont(t.tid, 0)
            return ptrace.wait(t.tid, 0)[1]
        except (ProcessLookupError, ChildProcessError):
            return None

    def _assume_stopped(self, *, is_last_chance: bool) -> bool:
        """Threads we did not hear from in time: trust /proc when it says they are stopped.
        False when one is still running (it is waited for again), unless ``is_last_chance``.

        Such a thread may sit in a stop whose report we took from the kernel and lost (an
        exception, KeyboardInterrupt say, between ``waitpid`` and the code that records it):
        its siginfo says which. A signal-delivery stop is held as if just reported (the trap
        of one of our int3s is put back on its int3, another signal is delivered later);
        left alone, the thread would resume past our int3, mid-instruction.
        """
        is_all = True
        for t in list(self._host.threads.values()):
            if t.state not in RUNNING_STATES:
                continue
            state = procfs.task_state(t.tracee.pid, t.tid)
            if state == "":
                self._host.drop_thread(t)
                continue
            if state not in "tT":
                if is_last_chance or state in "ZX":  # a zombie never stops: as before
                    raise TargetError(f"thread {t.tid} did not stop (state {state!r})")
                is_all = False  # our interrupt stops it when it next runs
                continue
            try:
                tid, status = ptrace.wait(t.tid, ptrace.WNOHANG)
            except ChildProcessError:
                tid = status = 0
            if tid == t.tid:
                self._hold(t, status)  # the report was late, not lost
                continue
            lost = _lost_stop(t.tid)
            if lost is None:
                t.state = S.STOPPED  # a group-stop or an event stop: nothing to redo
                t.event_stopped = True
            else:
                self._hold(t, lost)
        return is_all

    def resume(self) -> None:
        """The end of a ``stop``: the last one lets every thread the world held go on."""
        self._depth -= 1
        if self._depth:
            return
        host = self._host
        xol = host.xol
        if xol is not None and xol.has_quarantine:
            rips = []
            for t in host.threads.values():
                if t.state is S.STOPPED:
                    rips.append(t.load_regs().rip if not t.busy else t.regs.rip)
            xol.recycle(rips)
        if host.hold_all:
            return
        for t in list(host.threads.values()):
            if t.state is S.STOPPED and t.pending is None and not t.busy:
                try:
                    t.resume()
                except ProcessLookupError:
                    if procfs.task_state(t.tracee.pid, t.tid) in ("", "Z", "X"):
                        host.drop_thread(t)
                    else:  # in no ptrace stop: it runs (or dies), and its next stop comes
                        t.state = S.STEPPING if t.step_site is not None else S.RUNNING


def put_back(t: Thread, addr: int, marked: bool) -> None:
    """Set ``t``'s rip (the kernel's, not the view's) to ``addr``, the int3 it trapped on,
    its trap not reaped yet (step 0 of an emulated probe's hit, and of a stale trap).
    ``marked``: with the siginfo that tells the rescue so, should the kernel deliver the
    trap (the rescue would otherwise take it for the trap of an int3 at ``addr - 1``, an
    address we patched)."""
    if marked:
        ptrace.setsiginfo(t.tid, put_back_mark(addr))
    word = t.rip_word
    word.value = addr
    if t.req.poke_user(word) == -1:
        ptrace.raise_error()


def _lost_stop(tid: int) -> int | None:
    """The wait status of a signal-delivery stop ``tid`` is in, from its siginfo (None when
    it is in another kind of stop)."""
    try:
        info = ptrace.getsiginfo(tid)
    except OSError:
        return None  # a group-stop has no siginfo
    signo = int.from_bytes(info[0:4], "little")
    code = siginfo_code(info)
    if signo == signal.SIGTRAP and code > 0 and code >> 8:
        return None  # a ptrace event stop (si_code = SIGTRAP | event << 8)
    return (signo << 8) | 0x7F
