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
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
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


# -- a signal just after the tracer resumed a thread --------------------------------------------

# The tool, with a trace hook that sends it ``SIGTERM`` at the ``HIT``-th line where the
# tracer marks a thread running after resuming it from a hit: the instant the stress runs met
# once in ~100 rounds. There the thread is in no ptrace stop (/proc says running), but the
# tracer's books still say stopped.
AFTER_RESUME = r"""
import inspect, os, signal, sys
from kprobes.cli.main import main
from kprobes.process.engine.tracer import Tracer

HIT = int(os.environ["KPT_HIT"])
lines = {}
for fn in (Tracer._hit, Tracer._after_handler):
    src, first = inspect.getsourcelines(fn)
    lines[fn.__code__] = {first + i for i, s in enumerate(src) if s.strip() == "t.state = _RUNNING"}
assert all(lines.values()), lines
seen = 0

def local(frame, event, arg):
    global seen
    if event == "line" and frame.f_lineno in lines[frame.f_code]:
        seen += 1
        if seen == HIT:
            print("signal sent", file=sys.stderr, flush=True)
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, at once
    return local

if os.environ.get("KPT_UNGUARDED"):  # the signal raised there: the books mended later
    from kprobes.process.target import Process
    Process.is_mid_stop = property(lambda self: False)
sys.settrace(lambda frame, event, arg: local if frame.f_code in lines else None)
sys.argv[0] = "kprobes"
sys.exit(main())
"""


def our_mappings(pid: int) -> list[str]:
    """Executable anonymous mappings and the shared areas: what of ours a program can hold."""
    found = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        name = fields[5] if len(fields) > 5 else ""
        if "kprobes" in name or ("x" in fields[1] and not name):
            found.append(line)
    return found


@pytest.mark.ptrace
@pytest.mark.parametrize("guard", ["deferred", "raised"])
def test_a_signal_just_after_a_thread_was_resumed_loses_no_thread(build, popen, tmp_path, guard):
    """Before, the signal's ``KeyboardInterrupt`` came between the resume and the books: the
    next stop of the world could not resume the thread (ESRCH), dropped it, and the detach
    had no thread to unmap our pages with (they stayed, said nowhere). Now the signal waits
    for the tracer's wait (``Process.is_mid_stop``); and raised there anyway ("raised": as
    after half a second, sigint.py's GIVE_UP), the thread that ESRCH says runs is marked
    running, not dropped (world.py)."""
    prog = popen([build("ticker"), 1_000_000, 2000], stdout=subprocess.PIPE)
    assert prog.stdout is not None
    prog.stdout.readline()  # it runs
    assert our_mappings(prog.pid) == []
    err = tmp_path / "err"
    env = dict(os.environ, KPT_HIT="20", KPT_UNGUARDED="1" if guard == "raised" else "")
    with err.open("wb") as e:
        tool = popen(
            [sys.executable, "-c", AFTER_RESUME, "count", "-p", prog.pid, "work", "--no-optimize"],
            stdout=subprocess.PIPE,
            stderr=e,
            env=env,
        )
    out, _ = tool.communicate(timeout=120)
    assert b"work" in out, out
    stderr = err.read_text()
    assert "signal sent" in stderr, stderr
    assert tool.returncode == 0, stderr
    assert " hits" in stderr and "stay in process" not in stderr, stderr
    assert "TracerPid:\t0" in Path(f"/proc/{prog.pid}/status").read_text()
    assert our_mappings(prog.pid) == [], stderr
    for _ in range(3):  # it goes on, right
        i, v = (int(x) for x in prog.stdout.readline().split()[1:])
        assert v == i * i + 1
