"""Keep the program's own SIGTRAP handler alive while our breakpoints trap inside it.

Our breakpoints raise SIGTRAP in the program. The kernel forces that signal: when the thread
has SIGTRAP blocked, as it does while running its own SIGTRAP handler, ``force_sig`` resets
the handler to SIG_DFL and unblocks the signal before ptrace even reports the stop. We discard
the signal, but the reset stays, and the program's next own trap kills it. The kernel's
uprobes never raises a signal, so it does not have this problem; debuggers built on ptrace do.

So when a program catches SIGTRAP (we learn it the first time we deliver it one of its own
traps), we save its ``struct sigaction`` for SIGTRAP with an injected ``rt_sigaction``, and
after every hit we check ``SigCgt`` in /proc and put the handler back if our trap reset it.
This costs a /proc read per hit, and only in programs that handle SIGTRAP themselves.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from kprobes.errors import TargetError
from kprobes.linux import procfs
from kprobes.process.engine.rescue import Rescue, sigaction
from kprobes.process.engine.threads import Thread
from kprobes.process.inject import calls

_SIGACTION_SIZE = 32  # handler, flags, restorer, mask (the kernel's struct)


def catches_sigtrap(pid: int) -> bool:
    return bool(procfs.caught_signals(pid) & (1 << (signal.SIGTRAP - 1)))


class TrapGuard:
    def __init__(self, pid: int, syscall_insn: Callable[[], int], rescue: Rescue) -> None:
        self.pid = pid
        self._syscall_insn = syscall_insn
        self._rescue = rescue  # injections run on its stub once it is installed
        self.saved: bytes | None = None

    @property
    def is_armed(self) -> bool:
        return self.saved is not None

    def arm_if_needed(self, thread: Thread) -> None:
        """The program is about to receive one of its own SIGTRAPs: save its handler."""
        if catches_sigtrap(self.pid):
            self.saved = self._sigaction(thread, None)

    def repair(self, thread: Thread) -> None:
        """After a hit: if our trap reset the program's SIGTRAP handler, put it back."""
        if self.saved is not None and not catches_sigtrap(self.pid):
            self._sigaction(thread, self.saved)

    def forget(self) -> None:
        """exec reset the program's handlers: nothing saved is the program's any more."""
        self.saved = None

    def _sigaction(self, thread: Thread, new: bytes | None) -> bytes:
        # The thread's loaded view, not a reload: a pre handler's unsaved register writes are
        # in it, and run_syscall puts the view back as it found it.
        mem = thread.tracee
        scratch = calls.scratch_below(thread.regs.rsp, 2 * _SIGACTION_SIZE)
        new_at = 0
        if new is not None:
            new_at = scratch + _SIGACTION_SIZE
            mem.write(new_at, new)

        def syscall(nr: int, *args: int) -> int:
            insn = self._syscall_insn()
            return calls.run_syscall(thread, insn, nr, *args, rescue=self._rescue)

        try:
            return sigaction(mem, syscall, scratch, signal.SIGTRAP, new_at)
        except TargetError as exc:
            raise TargetError(f"process {self.pid}: {exc}") from exc
