"""The trap engine's parts on their own: ``World`` (engine/world.py) and ``Signals``
(engine/signals.py), each driven through the contract it is written against (``WorldHost``,
``SignalHost``) by a fake host, on fake threads that make no ptrace request.

What is checked here is each part's own bookkeeping: the stop depth, which held threads go on
at the end of a stop, the order stops held back are handed to the loop, which queued stop is
taken, which thread is lent for an injection, which signals are kept for after a copy. That
they do the right thing to a real program is the live tests' job (test_signals.py,
test_reaped_trap.py, test_threads.py, ...): every one of them runs through these parts.
"""

from __future__ import annotations

import signal
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kprobes.errors import InternalError, TargetError
from kprobes.linux import ptrace
from kprobes.process.engine import signals as signals_module
from kprobes.process.engine.signals import Signals
from kprobes.process.engine.threads import ThreadState
from kprobes.process.engine.world import World

S = ThreadState


@dataclass(eq=False)
class FakeThread:
    tid: int
    state: ThreadState = S.STOPPED
    busy: bool = False
    pending: int | None = None
    pending_from: ThreadState = S.RUNNING
    interrupt_sent: bool = False
    held_signals: list[tuple[int, bytes]] = field(default_factory=list)
    reraised: list[bytes] = field(default_factory=list)
    to_syscall_entry: bool = False
    event_stopped: bool = False
    resume_stepping: bool = False
    resumed: int = 0

    def to(self, state: ThreadState) -> None:
        self.state = state

    def resume(self, sig: int = 0) -> None:
        self.resumed += 1
        self.state = S.RUNNING


@dataclass(eq=False)
class FakeTracee:
    threads: dict[int, FakeThread] = field(default_factory=dict)


class FakeHost:
    """The tracer, as ``WorldHost`` and ``SignalHost`` describe it."""

    def __init__(self, *threads: FakeThread) -> None:
        self.threads: dict[int, Any] = {t.tid: t for t in threads}
        self.main: Any = FakeTracee(dict(self.threads))
        self.hold_all = False
        self.xol: Any = None
        self.lifecycle: Any = None
        self.dispatched: list[tuple[int, int]] = []
        self.free = True

    def dispatch(self, t: Any, status: int) -> None:
        self.dispatched.append((t.tid, status))

    def set_aside(self, tid: int, status: int) -> None:
        raise AssertionError("no stop of a foreign thread here")

    def add_thread(self, tracee: Any, tid: int, state: ThreadState) -> Any:
        raise AssertionError("no new thread here")

    def drop_thread(self, thread: Any) -> None:
        self.threads.pop(thread.tid, None)

    def is_free(self, t: Any) -> bool:
        return self.free


def world(host: FakeHost) -> World:
    parts: Any = None  # breakpoints, trampoline, rescue, table: only a held trap reads them
    return World(host, breakpoints=parts, trampoline=parts, rescue=parts, table=parts)


def test_a_nested_stop_only_counts_and_the_last_resume_lets_the_free_threads_go() -> None:
    free = FakeThread(1)
    busy = FakeThread(2, busy=True)  # a handler holds it: its caller resumes it
    pending = FakeThread(3, pending=0x57F)  # handled by the loop, later
    group = FakeThread(4, state=S.GROUP_STOPPED)
    host = FakeHost(free, busy, pending, group)
    w = world(host)
    assert not w.is_stopped
    w.stop()  # every thread already held: no request, nothing waited for
    w.stop()
    assert w.is_stopped
    w.resume()
    assert w.is_stopped and free.resumed == 0
    w.resume()
    assert not w.is_stopped
    assert [t.resumed for t in (free, busy, pending, group)] == [1, 0, 0, 0]


def test_a_world_held_by_the_tracer_stays_held_after_the_last_resume() -> None:
    thread = FakeThread(1)
    host = FakeHost(thread)
    host.hold_all = True  # spawned, not run yet
    w = world(host)
    w.stop()
    w.resume()
    assert not w.is_stopped and thread.resumed == 0


def test_the_stops_held_back_go_to_the_loop_in_order_from_the_state_they_came_in() -> None:
    a = FakeThread(1, pending=0x57F, pending_from=S.RUNNING)
    b = FakeThread(2, pending=0x137F, pending_from=S.STEPPING)
    held = FakeThread(3, pending=0xB7F, busy=True)  # a handler holds it: not now
    host = FakeHost(a, b, held)
    w = world(host)
    w.has_pending = True
    w.drain_pending()
    assert host.dispatched == [(1, 0x57F), (2, 0x137F)]
    assert (a.pending, a.state, b.pending, b.state) == (None, S.RUNNING, None, S.STEPPING)
    assert held.pending == 0xB7F and not w.has_pending


def test_a_queued_stop_is_taken_once_and_the_others_keep_their_order() -> None:
    w = world(FakeHost())
    w.inbox.extend([(7, 1), (8, 2), (7, 3)])
    assert w.take_stop(7) == 1
    assert w.take_stop(9) is None
    assert w.inbox == [(8, 2), (7, 3)]


def test_wait_hands_out_the_queued_stops_first_but_never_past_its_deadline() -> None:
    w = world(FakeHost())
    w.inbox.extend([(7, 1), (8, 2)])
    assert w.wait(time.monotonic() - 1) == (0, 0)  # a deadline passed comes first
    assert w.wait(time.monotonic() + 60) == (7, 1)
    assert w.wait(None) == (8, 2)
    assert w.inbox == []


def test_the_thread_lent_for_an_injection_is_a_held_one_no_handler_holds() -> None:
    running = FakeThread(1, state=S.RUNNING)
    busy = FakeThread(2, busy=True)
    pending = FakeThread(3, pending=0x57F)
    free = FakeThread(4)
    assert world(FakeHost(running, busy, pending, free)).held_thread() is free
    assert world(FakeHost(running, busy, pending)).held_thread() is busy  # the best there is
    with pytest.raises(InternalError, match="not stopped"):
        world(FakeHost(running, pending)).held_thread()
    gone = FakeHost(free)
    gone.main = None
    with pytest.raises(TargetError, match="exited"):
        world(gone).held_thread()


def siginfo(signo: int, code: int) -> bytes:
    return struct.pack("<iii", signo, 0, code) + bytes(128 - 12)


def test_a_standard_signal_is_kept_once_for_after_the_copy_a_realtime_one_each_time() -> None:
    t: Any = FakeThread(1)
    usr1 = siginfo(signal.SIGUSR1, -6)
    rt = siginfo(signal.SIGRTMIN, -6)
    for _ in range(2):
        signals_module._hold(t, signal.SIGUSR1, usr1)
        signals_module._hold(t, signal.SIGRTMIN, rt)
    assert [sig for sig, _ in t.held_signals] == [
        signal.SIGUSR1,
        signal.SIGRTMIN,
        signal.SIGRTMIN,
    ]


@pytest.mark.parametrize(
    ("sig", "code", "trapnr"),
    [
        (signal.SIGSEGV, 1, 14),  # SEGV_MAPERR: a page fault
        (signal.SIGSEGV, ptrace.SI_KERNEL, 13),  # a general protection fault
        (signal.SIGBUS, 2, 17),
        (signal.SIGFPE, 1, 0),
        (signal.SIGILL, 1, 6),
        (signal.SIGSEGV, -6, None),  # sent by tgkill: not a fault of the instruction
        (signal.SIGUSR1, 0, None),
    ],
)
def test_a_fault_of_the_copy_is_told_from_a_signal_sent_to_it(
    sig: int, code: int, trapnr: int | None
) -> None:
    assert signals_module._fault_trapnr(sig, siginfo(sig, code)) == trapnr


def test_a_step_that_enters_its_syscall_while_it_may_not_go_on_waits_to_finish_it() -> None:
    """The world is stopped (``SignalHost.is_free`` says no): the thread stays held, marked
    to go back to its step, by PTRACE_CONT, when it is let go; no request is made."""
    t: Any = FakeThread(1, state=S.STEPPING, to_syscall_entry=True)
    host = FakeHost(t)
    host.free = False
    Signals(host, slot_owner={}, fetch_faults=None).entered_step_syscall(t)  # type: ignore[arg-type]
    assert (t.state, t.to_syscall_entry) == (S.STOPPED, False)
    assert t.event_stopped and t.resume_stepping
