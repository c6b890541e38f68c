"""SIGINT in the command line: it ends a command as Ctrl-C does, whatever we inherited, and it
ends a tracing run where ending is safe.

A shell script's background job starts with SIGINT ignored (``kprobes count -p PID f &`` then
``kill -INT $!`` did nothing), and CPython keeps an inherited SIG_IGN. perf and bpftrace
install their own SIGINT handler and end with their summary; so do we, for every command
(``sigint_ends_command``, installed by ``main``): SIGINT raises ``KeyboardInterrupt``.

While probes are live, an exception at an arbitrary point is not harmless. Raised between
the tracer's ``waitpid`` and its resuming the thread, it loses that stop: the thread waits at
the byte after our int3 with nobody knowing, and the detach that follows can only guess (it
waited two seconds for an interrupt stop that never came, then let the thread go on from the
middle of an instruction). So while probes are live, SIGINT (``SafeInterrupt``):

* while probes are being placed, only sets ``interrupted``: placing stops between two probes
  and the run is skipped;
* then asks the target to end its run (``Process.end_run``): the tracer raises
  ``RunInterrupted`` out of ``run()`` once it has finished the stop it is handling, or the
  next one, never in the middle of one;
* and raises ``KeyboardInterrupt`` itself only when no thread of the program is in a ptrace
  stop and the tracer is waiting (``Process.is_mid_stop`` is false: it is in ``waitpid``,
  which an exception interrupts without loss, or outside ``run()``), looked at again every
  few milliseconds by a timer, and after half a second anyway (a thread may stay stopped
  for good). /proc alone is not enough: a thread just resumed is in no stop, and an
  exception before the tracer marks it running left it marked stopped, then dropped by the
  next stop of the world (the detach lent no thread, and our pages stayed, said nowhere).

SIGTERM and SIGHUP (``timeout 3 kprobes ...``, a closed terminal) end a run exactly as SIGINT
does, with the summary and the table: their default action would kill the tool with its
probes in the program (what SIGKILL leaves is a rescue's work, not an ending).

Once the run is over (``is_over``, set by the session with plain stores as the loop is left)
and while the probes are removed, SIGINT is only noted: an exception in the middle of a detach
would leave the program with our breakpoints and nobody to answer them (the detach itself
also runs ``lifetime.uninterrupted()``, for every other way in). Only the command line does
any of this; the library leaves SIGINT to the program that imports it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any

from kprobes.linux import procfs

# How soon a deferred SIGINT is looked at again.
RECHECK = 0.005
# How long a SIGINT may wait for a safe point before it is raised anyway.
GIVE_UP = 0.5
# The signals that end a run with live probes at a safe point, with its summary.
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Handler = signal.Handlers | Callable[[int, FrameType | None], Any]


class RunInterrupted(Exception):
    """SIGINT, raised out of a target's ``run()`` once the stop it was handling is finished."""


@contextmanager
def sigint_ends_command() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the block; the handler found is put back after
    it (``main()`` may run in a process of others, as the tests do)."""
    with _handler(signal.SIGINT, signal.default_int_handler):
        yield


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT is ignored in the block: for the removal of every probe."""
    with _handler(signal.SIGINT, signal.SIG_IGN):
        yield


def is_in_trace_stop(pid: int) -> bool:
    """Some thread of ``pid`` is in a ptrace stop: a stop the tracer may be handling."""
    try:
        tids = procfs.list_tasks(pid)
    except OSError:
        return False
    return any(procfs.task_state(pid, tid) == "t" for tid in tids)


class SafeInterrupt:
    """SIGINT for one run with live probes (see the module's docstring).

    ``end_run(exc)`` makes the run raise ``exc`` at its next safe point (the ptrace target:
    ``Process.end_run``); ``is_mid_hit()`` says whether raising here and now could cut a
    stop in two.
    """

    def __init__(
        self,
        end_run: Callable[[BaseException], None] = lambda exc: None,
        is_mid_hit: Callable[[], bool] = lambda: False,
    ) -> None:
        self.interrupted = False
        self.signal: signal.Signals | None = None  # the first that came (ENDING_SIGNALS)
        self.asked_at = 0.0  # when it came (time.monotonic())
        self.is_placing = True  # probes are being placed: never raise, stop between two
        self.end_run = end_run
        self.is_mid_hit = is_mid_hit
        # Called (from the handler) with a signal that comes while the run is being ended:
        # the ending may shorten what it still reads.
        self.on_late_signal: Callable[[], None] = lambda: None
        # The run is over (the loop returned, or left by an exception): a signal from now on
        # is only noted. Set by plain stores, never a call: Python runs a pending handler at
        # the first call after an exception leaves the loop, which was ``quiet()``'s own, so
        # a signal that came as the run ended raised KeyboardInterrupt into the ending, past
        # the removal of the probes (left to the atexit hook, no summary, status 130).
        self.is_over = False
        self._since = 0.0
        self._has_asked = False
        self._is_quiet = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        with ExitStack() as stack:
            for signum in ENDING_SIGNALS:
                stack.enter_context(_handler(signum, self._on_sigint))
            stack.enter_context(_handler(signal.SIGALRM, self._on_recheck))
            try:
                yield
            finally:
                self.quiet()

    def quiet(self) -> None:
        """From now on (the probes are being removed) SIGINT is only noted."""
        self._is_quiet = True
        if threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.signal = signal.Signals(signum)
            self.asked_at = self._since = time.monotonic()
        self._raise_when_safe()

    def _on_recheck(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted:
            self._raise_when_safe()

    def _raise_when_safe(self) -> None:
        if self._is_quiet or self.is_over:
            self.on_late_signal()
            return
        if self.is_placing:
            return  # placing: the caller looks at ``interrupted`` once it is over
        if not self._has_asked:
            self._has_asked = True
            self.end_run(RunInterrupted())
        if time.monotonic() - self._since < GIVE_UP and self.is_mid_hit():
            signal.setitimer(signal.ITIMER_REAL, RECHECK)  # in case no stop comes
            return
        raise KeyboardInterrupt


@contextmanager
def _handler(signum: int, handler: Handler) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers: leave them to it
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)
