"""Which tracer owns a thread, among the tracers of this Python process.

One ``wait`` sees the stops of every thread this process traces: the root's, a followed
child's that exec'd (a member of the family, with a tracer of its own), another ``Process``'s.
A stop reaped by a loop that does not own the thread is passed on to the loop that does
(its ``inbox``), or kept until a new thread's clone event names its tracer (``claim``).

A trap is the one stop that cannot simply be passed on: reaped, the kernel forgets it, and a
tool killed before the owner runs step 0 (``Tracer._other_trap``) would leave the thread
one byte past an int3 of ours, mid-instruction (``decisions.md``, "the reaped-trap window").
So a member's trap is left unreaped for the member's dispatch, which the root's loop runs
before it waits again (``is_members_running``), and any other tracer's trap is put back on
its int3 before the reap (``set_aside``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kprobes.process.engine import events as ev
from kprobes.process.engine.threads import RUNNING_STATES

if TYPE_CHECKING:
    from kprobes.process.engine.tracer import Tracer

_OWNERS: dict[int, Tracer] = {}  # every tid traced by a Tracer of this process
_UNCLAIMED: dict[int, list[int]] = {}  # stops of tids no tracer has claimed yet


def claim(tracer: Tracer, tid: int, *, seized: bool = False) -> list[int]:
    """``tracer`` owns ``tid`` from now on; the stops that came for it before, in order.

    What is kept under a tid may be an earlier process's: the kernel gives pids again, and
    a child of this Python process that no tracer traced (a ``Popen`` of the host program)
    was reaped by a tracer's wait when it exited, its exit kept here for good. A thread
    just ``seized`` (attached, or spawned and seized) had no stop for anyone before: all of
    it is dropped. A new thread's first report is a stop: the exits before it go too
    (tests/test_reused_pids.py)."""
    _OWNERS[tid] = tracer
    kept = _UNCLAIMED.pop(tid, [])
    if seized:
        return []
    while kept and (os.WIFEXITED(kept[0]) or os.WIFSIGNALED(kept[0])):
        del kept[0]
    return kept


def release(tracer: Tracer, tid: int) -> None:
    if _OWNERS.get(tid) is tracer:
        del _OWNERS[tid]


def pass_on(tracer: Tracer, tid: int, status: int) -> None:
    """A stop ``tracer`` waited for but does not own: to its owner, or kept for a new thread
    or child whose clone or fork event has not been seen yet."""
    owner = _OWNERS.get(tid)
    if owner is not None and owner is not tracer:
        owner.world.inbox.append((tid, status))
    else:
        _UNCLAIMED.setdefault(tid, []).append(status)


def is_members_running(tracer: Tracer, tid: int) -> bool:
    """``tid`` is a running thread of a member of ``tracer``'s family: its trap is left
    unreaped for the member's dispatch (``Lifecycle.pump_family``), which reaps it after
    step 0, as the root does its own."""
    owner = _OWNERS.get(tid)
    if owner is None or owner not in tracer.family:
        return False
    t = owner.threads.get(tid)
    return t is not None and t.state in RUNNING_STATES


def set_aside(tracer: Tracer, tid: int, status: int) -> None:
    """A stop of a thread ``tracer`` does not own, reaped and passed on. A running thread of
    another tracer that trapped on an int3 of that tracer's is first put back on it
    (``rewind_own_trap``) and let go: it traps again, and is seen then."""
    if status == ev.SIGTRAP_STOP:
        owner = _OWNERS.get(tid)
        t = None if owner is None or owner is tracer else owner.threads.get(tid)
        if (
            owner is not None
            and t is not None
            and t.state in RUNNING_STATES
            and owner.world.rewind_own_trap(t)
        ):
            tracer.world.reap(tid)
            owner.resume_if_free(t)
            return
        tracer.world.reap(tid)
    pass_on(tracer, tid, status)
