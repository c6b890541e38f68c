"""Make a stopped thread run a syscall or a function for us, then put it back exactly.

The out-of-line page must be mapped by the program itself (``mmap`` in its own address
space), and a GNU ifunc resolver must run in the program to say which implementation it
picked. Both borrow one held thread: save its registers, point it at a ``syscall``
instruction (or at the function, with a return address on an int3 of ours), let it run until
it traps, read ``rax``, and restore every register. ``orig_rax = -1`` keeps the kernel from
"restarting" a syscall the thread was interrupted in; restoring the saved registers brings
that restart back as it was.

Once the rescue is mapped (``rescue.py``), injections run on its stub (``syscall; int3``)
instead, with the thread's registers written beside it first: if the tool dies in the
middle, the thread traps on the stub's int3 and the rescue puts its registers back. The
``mmap`` of the rescue itself carries its own way home (``selfrestore.py``); the borrowed
``syscall`` here serves it only where the program's code offers no such way.

The trap that ends an injection is forced on the thread by the kernel (``force_sig``): if
the thread blocks SIGTRAP, as it does inside the program's own SIGTRAP handler (or inside
the rescue chaining to it), the kernel unblocks it and makes the program's SIGTRAP action
SIG_DFL before ptrace reports the stop, and the program's next own trap kills it. So a
thread that blocks SIGTRAP has it unblocked (``PTRACE_SETSIGMASK``) for the injection only,
and its own mask back after: the trap is then delivered, not forced, and nothing is reset.

Rejected: writing a ``syscall`` instruction over the thread's current code. Another thread
could execute those bytes; we only borrow instructions that already exist. Repairing the
action after the injection (as the trap guard does after a hit): the injection that repairs
it would end on a forced trap of its own, and the thread's mask would stay changed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kprobes.arch.x86_64 import rescue as rescue_layout
from kprobes.errors import TargetError
from kprobes.linux import ptrace
from kprobes.process.engine.events import SIGTRAP_STOP
from kprobes.process.engine.threads import RIP_OFFSET, Thread, ThreadState, siginfo_code

if TYPE_CHECKING:
    from kprobes.process.engine.rescue import Rescue

_SAFE_STACK_GAP = 512  # beyond the 128-byte red zone, kept clear of the thread's frame
_SCRATCH_GAP = 4096  # scratch memory lies this far below the stack pointer, and more


def scratch_below(sp: int, size: int) -> int:
    """Room for ``size`` bytes an injected syscall reads or writes (a ``struct sigaction``)
    in the free stack of a held thread whose stack pointer is ``sp``: a page below it, clear
    of the red zone and of what an injected call pushes, 16-byte aligned."""
    return ((sp - _SCRATCH_GAP) & ~0xF) - size


def run_syscall(
    thread: Thread, syscall_insn: int, nr: int, *args: int, rescue: Rescue | None = None
) -> int:
    """Execute syscall ``nr`` in ``thread``; returns the raw rax (negative errno on failure).

    With an installed ``rescue`` it runs on the rescue's stub and ``syscall_insn`` is unused.
    """
    assert thread.state is ThreadState.STOPPED, "inject needs a held thread"
    view = (bytes(thread.regs.buffer), thread.regs.dirty)  # a handler's unsaved changes
    regs = thread.load_regs()
    saved = bytes(regs.buffer)
    landing = rescue if rescue is not None and rescue.is_installed else None
    try:
        if landing is not None:
            landing.begin_injection(thread.tracee, home_regs(thread, saved, view[0]))
        regs.rax = nr
        regs.orig_rax = (1 << 64) - 1
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            regs.set(name, value)
        with _sigtrap_unblocked(thread.tid):
            if landing is not None:
                regs.rip = rescue_layout.stub(landing.area)
                thread.store_regs()
                ptrace.cont(thread.tid, 0)
                _wait_for_trap(thread, stepping=False)
                after = thread.load_regs()
                if after.rip != rescue_layout.stub_trap(landing.area) + 1:
                    raise TargetError(f"injected syscall {nr} stopped at {after.rip:#x}")
            else:
                regs.rip = syscall_insn
                thread.store_regs()
                ptrace.singlestep(thread.tid, 0)
                _wait_for_trap(thread, stepping=True)
                after = thread.load_regs()
        result = after.rax
    finally:
        restore_regs(thread, saved, view)
        if landing is not None:
            landing.end_injection(thread.tracee)
    return result - (1 << 64) if result >= 1 << 63 else result


def call_function(
    thread: Thread, func: int, return_trap: int, *args: int, rescue: Rescue | None = None
) -> int:
    """Call ``func(*args)`` in ``thread``; ``return_trap`` must hold an int3 of ours.

    With an installed ``rescue`` the call returns on the rescue's stub trap instead.
    """
    assert thread.state is ThreadState.STOPPED, "inject needs a held thread"
    view = (bytes(thread.regs.buffer), thread.regs.dirty)
    regs = thread.load_regs()
    saved = bytes(regs.buffer)
    mem = thread.tracee
    landing = rescue if rescue is not None and rescue.is_installed else None
    if landing is not None:
        return_trap = rescue_layout.stub_trap(landing.area)
    try:
        if landing is not None:
            landing.begin_injection(mem, home_regs(thread, saved, view[0]))
        sp = ((regs.rsp - _SAFE_STACK_GAP) & ~0xF) - 8
        mem.write(sp, return_trap.to_bytes(8, "little"))
        regs.rsp = sp
        regs.orig_rax = (1 << 64) - 1
        regs.rax = 0
        for name, value in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args, strict=False):
            regs.set(name, value)
        regs.rip = func
        thread.store_regs()
        with _sigtrap_unblocked(thread.tid):
            ptrace.cont(thread.tid, 0)
            _wait_for_trap(thread, stepping=False)
        after = thread.load_regs()
        if after.rip != return_trap + 1:
            raise TargetError(f"injected call to {func:#x} stopped at {after.rip:#x}")
        result = after.rax
    finally:
        restore_regs(thread, saved, view)
        if landing is not None:
            landing.end_injection(mem)
    return int(result)


@contextlib.contextmanager
def _sigtrap_unblocked(tid: int) -> Iterator[None]:
    """SIGTRAP unblocked in ``tid`` while the injection runs, its own mask back after (see
    the module docstring): the injection's trap must not be forced on a blocked SIGTRAP."""
    mask = ptrace.getsigmask(tid)
    bit = 1 << (signal.SIGTRAP - 1)
    if not mask & bit:
        yield
        return
    ptrace.setsigmask(tid, mask & ~bit)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            ptrace.setsigmask(tid, mask)


def home_regs(thread: Thread, kernel_regs: bytes, view: bytes) -> bytes:
    """The registers the rescue gives the thread back if the tool dies during the injection.

    Its own registers, but where it really was: a thread borrowed from inside a handler has
    the handler's view (its hit is handled: the rip it goes on at, and what an emulated
    instruction changed, the loader's ``ret`` its rsp); one whose int3 trap is still pending
    goes back onto the int3, to take that trap again (from the rescue, if the tool is gone).
    """
    home = bytearray(kernel_regs)
    if thread.busy:
        home[:] = view  # rip, and what an emulated instruction changed (a ret's rsp)
    elif thread.pending == SIGTRAP_STOP:
        info = ptrace.getsiginfo(thread.tid)
        if siginfo_code(info) == ptrace.SI_KERNEL:
            rip = int.from_bytes(home[RIP_OFFSET : RIP_OFFSET + 8], "little") - 1
            home[RIP_OFFSET : RIP_OFFSET + 8] = rip.to_bytes(8, "little")
    return bytes(home)


def restore_regs(thread: Thread, kernel_regs: bytes, view: tuple[bytes, bool]) -> None:
    """Put the thread's registers back, and the handler's view of them as it was."""
    thread.regs.buffer[:] = kernel_regs
    thread.store_regs()
    thread.regs.buffer[:] = view[0]
    thread.regs.dirty = view[1]


def step(thread: Thread) -> None:
    """One instruction of the held ``thread`` (the detach steps threads out of detours):
    a signal that comes meanwhile is held for later, a fault or an exit raises."""
    ptrace.singlestep(thread.tid, 0)
    _wait_for_trap(thread, stepping=True)


def next_stop(thread: Thread) -> int:
    """The next stop of ``thread``, which we drive alone (an injected call, a step, the
    rescue's own run): its wait status; a ``TargetError`` if it died or is gone."""
    try:
        _, status = ptrace.waitpid(thread.tid, 0)
    except ChildProcessError as exc:
        raise TargetError(f"thread {thread.tid} is gone") from exc
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        raise TargetError(f"thread {thread.tid} died during an injected call")
    return status


def _wait_for_trap(thread: Thread, *, stepping: bool) -> None:
    """Wait for ``thread``'s SIGTRAP; hold other signals for later, fail on faults or exit."""
    while True:
        status = next_stop(thread)
        sig = os.WSTOPSIG(status)
        event = status >> 16
        if sig == signal.SIGTRAP and event == 0:
            return
        if event:
            # An interrupt that was still pending: consume it and carry on.
            restart = ptrace.singlestep if stepping else ptrace.cont
            restart(thread.tid, 0)
            continue
        if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
            raise TargetError(f"injected code faulted in thread {thread.tid} (signal {sig})")
        thread.held_signals.append((sig, ptrace.getsiginfo(thread.tid)))
        restart = ptrace.singlestep if stepping else ptrace.cont
        restart(thread.tid, 0)
