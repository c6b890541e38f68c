"""Life and death of the traced processes: exit, exec, a child's first stop, release, and
the members of a followed family whose stops this loop handles.

At exec the program's code is gone: every probe waits to be placed again in the new image
(pending.py) from the exit of ``execve`` on, with nothing of ours left in it. A child's
exec either lets the child go, or, when children are followed, hands it to a process of its
own (family.py), whose stops reach the root's loop and are handled here.

``Lifecycle`` is a part of ``Tracer`` (tracer.py), kept apart as a mechanism of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from kprobes.linux import ptrace
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind

if TYPE_CHECKING:
    from kprobes.core.manager import ProbeManager
    from kprobes.core.table import ProbeSite
    from kprobes.process.engine.breakpoints import Breakpoints
    from kprobes.process.engine.cpus import Placement
    from kprobes.process.engine.prepared import Prepared
    from kprobes.process.engine.tracer import Tracer
    from kprobes.process.engine.trampoline import Trampoline
    from kprobes.process.engine.xol import XolArea
    from kprobes.process.fast.optimizer import JumpState
    from kprobes.process.fetch.faults import FetchFaults
    from kprobes.process.survival.rescue import Rescue

S = ThreadState


class Lifecycle:
    """Exit, exec, children, and the family's stops, for ``Tracer``."""

    manager: ProbeManager
    main: Tracee | None
    exit_code: int | None
    follow_forks: bool
    breakpoints: Breakpoints
    xol: XolArea | None
    trampoline: Trampoline
    rescue: Rescue
    fetch_faults: FetchFaults
    optimizer: JumpState
    placement: Placement
    slot_owner: dict[int, ProbeSite]
    slot_history: dict[int, Prepared]
    tracees: dict[int, Tracee]
    family: list[Tracer]
    on_gone: Callable[[], None]
    on_child_exec: Callable[[Tracee, Thread], bool]
    threads: dict[int, Thread]

    if TYPE_CHECKING:

        def drop_thread(self, thread: Thread) -> None: ...
        def drop_tracee(self, tracee: Tracee) -> None: ...
        def _resume_if_free(self, t: Thread) -> None: ...

    def _on_exit(self, t: Thread, code: int) -> None:
        tracee = t.tracee
        self.drop_thread(t)
        if t.tid == tracee.pid:
            tracee.exit_code = code
            if tracee is self.main:
                self.exit_code = code
            self.drop_tracee(tracee)
            if tracee.kind is TraceeKind.MAIN:
                self.manager.mark_gone()
                self.on_gone()

    def _on_exec(self, t: Thread) -> None:
        tracee = t.tracee
        former = ptrace.geteventmsg(t.tid)
        self.placement.on_renamed(former, t.tid)
        if former != t.tid and former in self.threads:
            self.drop_thread(self.threads[former])
        for other in list(tracee.threads.values()):
            if other is not t:
                self.drop_thread(other)
        t.state = S.STOPPED
        t.step_site = None
        if tracee.kind is TraceeKind.MAIN:
            # The code we probed is gone: every probe waits to be placed again in the new
            # image, from the exit of execve on (pending.py), with nothing of ours in it.
            self.manager.unmap(lambda site: True)
            self.breakpoints.forget()
            if self.xol is not None:
                self.xol.forget()
            self.trampoline.forget()
            self.trampoline.forget_thread(t)  # its hooked frames went with the old image
            self.rescue.forget()
            self.fetch_faults.forget()
            self.optimizer.forget()
            self.slot_owner.clear()
            self.slot_history.clear()
            tracee.open_memory()
            self.on_gone()
            t.exec_landing = True
            t.trace_syscalls(True)
            self._resume_if_free(t)
        elif not (self.follow_forks and self.on_child_exec(tracee, t)):
            # A child's new image holds nothing of ours: let it go, unless it is followed,
            # and adopted with an image of its own (family.py).
            self._release(tracee, clean=False)

    def _first_stop_of_child(self, t: Thread) -> None:
        tracee = t.tracee
        if tracee.kind is TraceeKind.RELEASE:
            self._release(tracee, clean=True)
        elif tracee.kind is TraceeKind.FORK:
            self.breakpoints.sync(tracee)
            self.trampoline.restore_child(tracee)
            self._resume_if_free(t)
        else:
            self._resume_if_free(t)

    def _release(self, tracee: Tracee, *, clean: bool) -> None:
        """Take our bytes out of a child's own memory and let it go."""
        if clean:
            self.breakpoints.restore_all(tracee)
            self.trampoline.restore_child(tracee)
        for thread in list(tracee.threads.values()):
            sig = 0
            if thread.held_signals:
                sig, info = thread.held_signals.pop(0)
                ptrace.setsiginfo(thread.tid, info)
            with contextlib.suppress(ProcessLookupError):
                ptrace.detach(thread.tid, sig)
        self.drop_tracee(tracee)

    # -- the family: followed children with images of their own (family.py) ------------

    def _all_gone(self) -> None:
        for member in self.family:
            member._all_gone()
        self.family.clear()
        for tracee in list(self.tracees.values()):
            self.drop_tracee(tracee)
        self.on_gone()

    def _pump_family(self) -> None:
        """Handle the stops that reached the members of the family (followed children that
        exec'd: each has an image, and so a tracer, of its own) through this loop."""
        for member in list(self.family):
            while member.inbox:
                tid, status = member.inbox.pop(0)
                t = member.threads.get(tid)
                if t is None:
                    member._unowned(tid, status)
                    continue
                member.dispatch(t, status)
            if member.has_pending:
                member._drain_pending()
            error = member.manager.table.take_error()
            if error is not None:  # raised out of the root's run(), as the root's own are
                self.manager.table.park(error)
            if not member.live:
                self.family.remove(member)
                member.on_gone()
