"""The traced program as every part of ``Process`` sees it: one small object they share.

The parts of a ``Process`` (arming, program calls, the fast tier, following, backtraces)
each need the same few things: the pid, the event loop (``Tracer``), the program's memory
while we are attached to it, its symbols, and its original code under our patches. They hold
this object for them instead of the ``Process`` itself, so that what a part may use of the
whole is written down here, and nothing else.
"""

from __future__ import annotations

import errno
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from kprobes.errors import TargetError
from kprobes.linux import procfs
from kprobes.process.engine.tracee import Tracee
from kprobes.process.engine.tracer import Tracer
from kprobes.symbols.resolve import SymbolResolver


class Attachment:
    """One traced program: its pid, its tracer, and whether we are still attached."""

    def __init__(self, pid: int, tracer: Tracer) -> None:
        self.pid = pid
        self.tracer = tracer
        self.is_attached = True  # False once closed (detached, or the program is gone)
        self._resolver: SymbolResolver | None = None

    def memory(self) -> Tracee:
        """The program's address space (its main image)."""
        main = self.tracer.main
        if main is None or not self.is_attached:
            raise TargetError(f"process {self.pid} is not traced any more")
        return main

    def original(self, addr: int, size: int) -> bytes:
        """The program's code as it was before any patch of ours (STYLE.md rule 6: every
        decode reads through this)."""
        return self.tracer.breakpoints.original(self.memory(), addr, size)

    def symbols(self) -> SymbolResolver:
        """The program's symbols (its mapped ELF files), read once and refreshed on demand."""
        if self._resolver is None:
            self._resolver = SymbolResolver(self.pid)
        return self._resolver

    def forget_image(self) -> None:
        """exec replaced the program's image: its symbols are read again when asked."""
        self._resolver = None

    def require(self) -> None:
        """Raise ``TargetError`` unless the program can be changed now."""
        if self.is_attached and self.tracer.main is not None:
            return
        if not self.is_attached and self.tracer.exit_code is None:
            raise TargetError(f"process {self.pid} was detached", errno=errno.ESRCH)
        raise self.exited()

    @contextmanager
    def registering(self) -> Iterator[None]:
        """Around a registration: the program must be there (``require``), and one that
        fails because the program exited meanwhile (before it, or in the middle, whatever
        step noticed) says that, in one line, as a ``TargetError``."""
        self.require()
        try:
            yield
        except (TargetError, ProcessLookupError, ChildProcessError) as exc:
            gone = self.gone()
            if gone is None or (isinstance(exc, TargetError) and str(exc) == str(gone)):
                raise
            raise gone from exc

    def gone(self) -> TargetError | None:
        """The error for a registration the program did not wait for: it has exited
        (None while it lives, or once it was detached: that error is said as it is)."""
        if not self.is_attached:
            return None
        if (
            self.tracer.main is not None
            and self.tracer.exit_code is None
            and procfs.task_state(self.pid, self.pid) not in ("", "Z", "X")
        ):
            return None
        return self.exited()

    def exited(self) -> TargetError:
        code = self.tracer.exit_code
        how = ""
        if code is not None and code >= 0:
            how = f" (exit status {code})"
        elif code is not None:
            try:
                how = f" (killed by {signal.Signals(-code).name})"
            except ValueError:
                how = f" (killed by signal {-code})"
        return TargetError(f"process {self.pid} has exited{how}", errno=errno.ESRCH)
