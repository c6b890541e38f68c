"""``uninterrupted()``: a signal whose handler raises waits for the end of the block, then
raises there (lifetime.py). The three writes of a jump and a whole detach run so."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from kprobes import lifetime
from kprobes.lifetime import hold_exit_signals, release_exit_signals, uninterrupted


@pytest.fixture(autouse=True)
def python_sigint():
    """Python's own SIGINT handler, whatever the suite inherited (a script's background job
    starts with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_in_the_block_is_raised_after_it():
    steps = []
    with pytest.raises(KeyboardInterrupt), uninterrupted():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes enough for a handler to have run
            steps.append(1)
        steps.append("end")
    assert steps[-1] == "end" and len(steps) == 1001
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_each_signal_that_came_is_raised_once_after_the_block():
    seen: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: seen.append(signum))
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)
    }
    try:
        with uninterrupted(), uninterrupted():  # nested: swapped once, raised once
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGTERM, signal.SIGALRM):
                os.kill(os.getpid(), sig)
            assert seen == []
        assert sorted(seen) == sorted([signal.SIGTERM, signal.SIGHUP, signal.SIGALRM])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_outside_the_main_thread_it_changes_nothing():
    found = []
    thread = threading.Thread(target=lambda: found.append(_handler_inside()))
    thread.start()
    thread.join()
    assert found == [signal.default_int_handler]


def _handler_inside():
    with uninterrupted():
        return signal.getsignal(signal.SIGINT)


@pytest.fixture
def no_holder(monkeypatch):
    """No other holder of the exit signals (one a failed test left unclosed, say)."""
    monkeypatch.setattr(lifetime, "_holders", set())
    monkeypatch.setattr(lifetime, "_saved_handlers", {})


def test_a_holder_puts_its_handler_back_where_another_holder_lost_it(no_holder):
    """SIGTERM set back to its default while a holder holds it: the next holder installs the
    SystemExit handler again, and the last one out leaves the default."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    first, second = object(), object()
    try:
        hold_exit_signals(first)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        hold_exit_signals(second)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        release_exit_signals(first)
        release_exit_signals(second)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        release_exit_signals(first)
        release_exit_signals(second)
        signal.signal(signal.SIGTERM, previous)


def test_exit_signals_let_go_in_the_block_stay_let_go_after_it(no_holder):
    """A detach (uninterrupted) that lets go of the last holder: SIGTERM goes back to its
    default after the block, not to the SystemExit handler the block had swapped out."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    holder = object()
    try:
        hold_exit_signals(holder)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with uninterrupted():
            release_exit_signals(holder)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with uninterrupted():
            hold_exit_signals(holder)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        release_exit_signals(holder)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        release_exit_signals(holder)
        signal.signal(signal.SIGTERM, previous)
