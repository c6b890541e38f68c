"""A signal that comes as a run ends is noted, never raised into the ending (cli/session.py,
cli/sigint.py).

CPython runs a pending signal's handler at the next call it makes, wherever that is: after an
exception left the run loop, that was the first call of the ending, before SIGINT was made
quiet. The KeyboardInterrupt it raised went past the removal of the probes (the atexit hook
took them out, without the summary, status 130: seen once in about 120 ``hist`` runs ended by
SIGINT or SIGTERM). Here the backend is a stand-in for the layer below the session: its run
ends at once, the way a real one does (the program ended, ``-n``, the signal's own
``RunInterrupted``), with a signal just sent and not yet handled.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

import pytest

from kprobes.cli import session as session_module
from kprobes.cli.backends import Backend, Placed
from kprobes.cli.session import EnoughEvents, Session, parse_spec
from kprobes.cli.sigint import RunInterrupted
from kprobes.spec import ProbeSpec


class EndingBackend(Backend):
    """Places nothing; ``run()`` sends ``signum`` to this process and ends as ``how`` says."""

    def __init__(self, signum: signal.Signals, how: str) -> None:
        super().__init__()
        self.signum, self.how = signum, how
        self.steps: list[str] = []

    def place(self, specs: Sequence[ProbeSpec]) -> list[Placed]:
        return []

    def functions(self, pattern: str) -> list[str]:
        return []

    def run(self, timeout: float | None) -> bool:
        if self.how == "held":  # pending, unblocked at the first call of the ending
            signal.pthread_sigmask(signal.SIG_BLOCK, [self.signum])
        os.kill(os.getpid(), self.signum)  # pending: handled at the next call made
        if self.how == "ended":
            return True
        if self.how == "-n":
            raise EnoughEvents
        raise RunInterrupted

    def stop(self) -> None:
        self.steps.append("stop")

    def close(self) -> None:
        self.steps.append("close")


@pytest.mark.parametrize("how", ["ended", "-n", "interrupted"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_as_the_run_ends_is_noted_and_the_ending_is_whole(
    monkeypatch: pytest.MonkeyPatch, signum: signal.Signals, how: str
) -> None:
    backend = EndingBackend(signum, how)
    monkeypatch.setattr(session_module, "open_backend", lambda *args, **kwargs: backend)
    args = argparse.Namespace(filter=None, max_events=1 if how == "-n" else None, duration=None)
    session = Session(args, [parse_spec("work")])
    before = signal.getsignal(signal.SIGINT)
    session.run()  # no KeyboardInterrupt out of it
    assert backend.steps[-1] == "close"
    if how != "-n":
        assert backend.steps == ["stop", "close"]
    assert session.ended_by in (signum.name, "-n 1")
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_handled_at_the_first_call_of_the_ending_is_only_noted(
    monkeypatch: pytest.MonkeyPatch, signum: signal.Signals
) -> None:
    """The case the stress runs met, made exact: the signal is held until the ending makes
    its first call (``quiet()``), where CPython then runs its handler."""
    backend = EndingBackend(signum, "held")
    monkeypatch.setattr(session_module, "open_backend", lambda *args, **kwargs: backend)
    args = argparse.Namespace(filter=None, max_events=None, duration=None)
    session = Session(args, [parse_spec("work")])

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "quiet":
            sys.setprofile(None)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])

    sys.setprofile(profile)
    try:
        session.run()  # no KeyboardInterrupt out of it
    finally:
        sys.setprofile(None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    assert backend.steps == ["stop", "close"]
    assert session.ended_by == signum.name
