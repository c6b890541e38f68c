"""A command forked and held just before its exec, so that the kernel sees it from its first
instruction.

The kernel's pid filter (an instance's ``set_event_pid``) names tasks, ``options/event-fork``
adds every task a filtered task creates (fork, vfork, clone: the ``sched_process_fork`` hook
runs before the new task is first woken), and a task keeps its pid through exec. So a
command whose pid is in the filter before it execs is recorded from the first instruction
of its new image (the dynamic loader's), and so is every process it starts, whatever they
exec in turn. ``HeldCommand`` forks; the child waits on a pipe; the caller puts the child's pid
in the filter and places its probes; ``release()`` lets the child exec and returns once the
exec has succeeded (the child's close-on-exec error pipe reads end-of-file) or raises
``TargetError`` with the reason the child reports.

Between its release and its exec the child still runs a few lines of Python, and their calls
into libc hit probes on libc: ``Uprobes`` drops the child's events recorded before its
``sched_process_exec`` record. Rejected: ``spawn`` (ptrace), which stops the command at its
entry point, after the dynamic loader and every library constructor have run unprobed; and
``posix_spawn`` from a helper process put in the filter, which makes the command a grandchild
that cannot be waited for or told from its helper as simply.
"""

from __future__ import annotations

import contextlib
import enum
import errno as _errno
import os
import signal
from collections.abc import Mapping, Sequence

from kprobes.errors import InternalError, TargetError
from kprobes.linux.childstart import restore_signals


class HeldState(enum.Enum):
    HELD = "held"  # forked, waiting before its exec
    RUNNING = "running"  # released: exec'ed, runs on its own
    ABANDONED = "abandoned"  # never released: exited without running the command


_TRANSITIONS = {
    HeldState.HELD: {HeldState.RUNNING, HeldState.ABANDONED},
    HeldState.RUNNING: set(),
    HeldState.ABANDONED: set(),
}


class HeldCommand:
    """``argv`` forked and held before ``execve(path, argv, env)``; our child."""

    def __init__(self, path: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        args, environ = list(argv), dict(env)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # the child: wait for the word, exec, or say why not
            try:
                restore_signals()  # as the command would start without us (childstart.py)
                os.close(go_w)
                os.close(err_r)
                if os.read(go_r, 1):
                    os.execve(path, args, environ)
            except BaseException as exc:
                code = getattr(exc, "errno", None) or _errno.ENOEXEC
                with contextlib.suppress(OSError):
                    os.write(err_w, f"{code}:{getattr(exc, 'strerror', None) or exc}".encode())
            finally:
                os._exit(127)
        os.close(go_r)
        os.close(err_w)
        self.pid = pid
        self.path = path
        self.state = HeldState.HELD
        self._go = go_w
        self._err = err_r

    def _become(self, state: HeldState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise InternalError(f"held command {self.pid}: {self.state.value} -> {state.value}")
        self.state = state

    @property
    def is_held(self) -> bool:
        return self.state is HeldState.HELD

    def release(self) -> None:
        """Let the child exec; return once it has, or raise ``TargetError`` (child reaped)."""
        self._become(HeldState.RUNNING)
        try:
            os.write(self._go, b"x")
        except OSError:
            pass  # it is gone already (killed): its error pipe says nothing, its exit all
        finally:
            os.close(self._go)
        try:
            report = b""
            while chunk := os.read(self._err, 4096):
                report += chunk
        finally:
            os.close(self._err)
        if report:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            code_text, _, message = report.decode(errors="replace").partition(":")
            raise TargetError(
                f"cannot run {self.path}: {message}",
                errno=int(code_text) if code_text.isdigit() else _errno.ENOEXEC,
            )

    def abandon(self) -> None:
        """Never run it: the child reads end-of-file and exits; reaped here."""
        if not self.is_held:
            return
        self._become(HeldState.ABANDONED)
        os.close(self._go)
        os.close(self._err)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        except BaseException:  # interrupted: make sure it cannot run the command anyway
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            raise
