"""Stop events as values: what one waitpid status means for one thread.

The hot path (a breakpoint hit: a plain SIGTRAP stop, status 0x57f) is tested by the event
loop before any of this runs; everything else is decoded here into frozen values matched with
``match``. Exceptions are for failures, never for events.
"""

from __future__ import annotations

import os
import signal

from kprobes.linux import ptrace
from kprobes.values import dataclass

SIGTRAP_STOP = (signal.SIGTRAP << 8) | 0x7F  # WIFSTOPPED with SIGTRAP and no event: a trap


@dataclass(frozen=True, slots=True)
class Exited:
    tid: int
    code: int


@dataclass(frozen=True, slots=True)
class Killed:
    tid: int
    signal: int


@dataclass(frozen=True, slots=True)
class Trap:
    """A SIGTRAP signal-delivery-stop: a breakpoint, a finished single-step, or the program's."""

    tid: int


@dataclass(frozen=True, slots=True)
class Signal:
    """A signal is about to be delivered to the thread (signal-delivery-stop)."""

    tid: int
    signal: int


@dataclass(frozen=True, slots=True)
class NewThread:
    tid: int  # the thread that called clone()


@dataclass(frozen=True, slots=True)
class Forked:
    tid: int
    is_vfork: bool


@dataclass(frozen=True, slots=True)
class Exec:
    tid: int


@dataclass(frozen=True, slots=True)
class GroupStop:
    tid: int
    signal: int


@dataclass(frozen=True, slots=True)
class EventStop:
    """PTRACE_EVENT_STOP with SIGTRAP: our interrupt, a new thread's first stop, or a wake-up."""

    tid: int


@dataclass(frozen=True, slots=True)
class SyscallStop:
    """A syscall-entry or syscall-exit stop (PTRACE_SYSCALL, with PTRACE_O_TRACESYSGOOD)."""

    tid: int


@dataclass(frozen=True, slots=True)
class OtherEvent:
    tid: int
    event: int


StopEvent = (
    Exited
    | Killed
    | Trap
    | Signal
    | SyscallStop
    | NewThread
    | Forked
    | Exec
    | GroupStop
    | EventStop
    | OtherEvent
)
SYSCALL_TRAP = signal.SIGTRAP | 0x80  # WSTOPSIG of a syscall stop

_GROUP_STOP_SIGNALS = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


def decode(tid: int, status: int) -> StopEvent:
    if os.WIFEXITED(status):
        return Exited(tid, os.WEXITSTATUS(status))
    if os.WIFSIGNALED(status):
        return Killed(tid, os.WTERMSIG(status))
    sig = os.WSTOPSIG(status)
    event = (status >> 16) & 0xFF
    match event:
        case 0:
            if sig == signal.SIGTRAP:
                return Trap(tid)
            return SyscallStop(tid) if sig == SYSCALL_TRAP else Signal(tid, sig)
        case ptrace.PTRACE_EVENT_CLONE:
            return NewThread(tid)
        case ptrace.PTRACE_EVENT_FORK:
            return Forked(tid, is_vfork=False)
        case ptrace.PTRACE_EVENT_VFORK:
            return Forked(tid, is_vfork=True)
        case ptrace.PTRACE_EVENT_EXEC:
            return Exec(tid)
        case ptrace.PTRACE_EVENT_STOP:
            if sig in _GROUP_STOP_SIGNALS:
                return GroupStop(tid, sig)
            return EventStop(tid)
        case _:
            return OtherEvent(tid, event)
