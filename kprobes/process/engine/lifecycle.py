"""Life and death of the traced processes: exit, exec, a child's first stop, release, and
the members of a followed family whose stops this loop handles.

At exec the program's code is gone: every probe waits to be placed again in the new image
(pending.py) from the exit of ``execve`` on, with nothing of ours left in it. A child's
exec either lets the child go, or, when children are followed, hands it to a process of its
own (family.py), whose stops reach the root's loop and are handled here.

``Lifecycle`` is a part of ``Tracer`` (tracer.py), which calls it at those stops; it uses
the tracer's public state and calls only.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from kprobes.linux import ptrace
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind

if TYPE_CHECKING:
    from kprobes.process.engine.tracer import Tracer

S = ThreadState


class Lifecycle:
    """Exit, exec, children, and the family's stops, for ``Tracer``."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def on_exit(self, t: Thread, code: int) -> None:
        tracer = self._tracer
        tracee = t.tracee
        tracer.drop_thread(t)
        if t.tid == tracee.pid:
            tracee.exit_code = code
            if tracee is tracer.main:
                tracer.exit_code = code
            tracer.drop_tracee(tracee)
            if tracee.kind is TraceeKind.MAIN:
                tracer.manager.mark_gone()
                tracer.on_gone()

    def on_exec(self, t: Thread) -> None:
        tracer = self._tracer
        tracee = t.tracee
        former = ptrace.geteventmsg(t.tid)
        tracer.placement.on_renamed(former, t.tid)
        if former != t.tid and former in tracer.threads:
            tracer.drop_thread(tracer.threads[former])
        for other in list(tracee.threads.values()):
            if other is not t:
                tracer.drop_thread(other)
        t.state = S.STOPPED
        t.step_site = None
        if tracee.kind is TraceeKind.MAIN:
            # The code we probed is gone: every probe waits to be placed again in the new
            # image, from the exit of execve on (pending.py), with nothing of ours in it.
            tracer.manager.unmap(lambda site: True)
            tracer.breakpoints.forget()
            if tracer.xol is not None:
                tracer.xol.forget()
            tracer.trampoline.forget()
            tracer.trampoline.forget_thread(t)  # its hooked frames went with the old image
            tracer.rescue.forget()
            tracer.fetch_faults.forget()
            if tracer.trap_guard is not None:
                tracer.trap_guard.forget()  # exec reset the program's handlers
            if tracer.fast is not None:
                tracer.fast.forget()
            tracer.slot_owner.clear()
            tracer.slot_history.clear()
            tracee.open_memory()
            tracer.on_gone()
            t.exec_landing = True
            t.trace_syscalls(True)
            tracer.resume_if_free(t)
        elif not (tracer.follow_forks and tracer.on_child_exec(tracee, t)):
            # A child's new image holds nothing of ours: let it go, unless it is followed,
            # and adopted with an image of its own (family.py).
            self.release(tracee, clean=False)

    def first_stop_of_child(self, t: Thread) -> None:
        tracer = self._tracer
        tracee = t.tracee
        if tracee.kind is TraceeKind.RELEASE:
            self.release(tracee, clean=True)
        elif tracee.kind is TraceeKind.FORK:
            tracer.breakpoints.sync(tracee)
            tracer.trampoline.restore_child(tracee)
            if tracer.fast is not None:
                tracer.fast.fork_child(tracee)
            tracer.resume_if_free(t)
        else:
            tracer.resume_if_free(t)

    def release(self, tracee: Tracee, *, clean: bool) -> None:
        """Take our bytes out of a child's own memory and let it go."""
        tracer = self._tracer
        if clean:
            tracer.breakpoints.restore_all(tracee)
            tracer.trampoline.restore_child(tracee)
        for thread in list(tracee.threads.values()):
            sig = 0
            if thread.held_signals:
                sig, info = thread.held_signals.pop(0)
                ptrace.setsiginfo(thread.tid, info)
            with contextlib.suppress(ProcessLookupError):
                ptrace.detach(thread.tid, sig)
        tracer.drop_tracee(tracee)

    # -- the family: followed children with images of their own (family.py) ------------

    def all_gone(self) -> None:
        tracer = self._tracer
        for member in tracer.family:
            member.lifecycle.all_gone()
        tracer.family.clear()
        for tracee in list(tracer.tracees.values()):
            tracer.drop_tracee(tracee)
        tracer.on_gone()

    def pump_family(self) -> None:
        """Handle the stops that reached the members of the family (followed children that
        exec'd: each has an image, and so a tracer, of its own) through this loop."""
        tracer = self._tracer
        for member in list(tracer.family):
            inbox = member.world.inbox
            while inbox:
                tid, status = inbox.pop(0)
                t = member.threads.get(tid)
                if t is None:
                    member.take_unowned(tid, status)
                    continue
                member.dispatch(t, status)
            if member.world.has_pending:
                member.world.drain_pending()
            error = member.manager.table.take_error()
            if error is not None:  # raised out of the root's run(), as the root's own are
                tracer.manager.table.park(error)
            if not member.live:
                tracer.family.remove(member)
                member.on_gone()

    def poll_family(self) -> None:
        """One batch of records of every ring of the family (the tracer's own and its
        members'), while the loop waits for stops; an exception a member's handler raised
        is raised from the tracer's table, as its own are (``World.wait_polling``)."""
        tracer = self._tracer
        if tracer.ring_poll is not None:
            tracer.ring_poll()
        for member in tracer.family:
            if member.ring_poll is not None:
                member.ring_poll()
                error = member.manager.table.take_error()
                if error is not None:
                    tracer.manager.table.park(error)
