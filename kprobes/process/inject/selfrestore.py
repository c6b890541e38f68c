"""An injected syscall whose thread goes home by itself: the rescue's own ``mmap``, and the
injections of a clean end that the rescue can no longer undo.

Every other injection runs on the rescue's stub, whose trap the rescue turns back into the
thread's own registers if the tool has died (``calls.py``). The ``mmap`` that makes the
rescue's mapping cannot: nothing of ours is in the program yet. Nor can those of a clean end
from the one that puts the program's own SIGTRAP action back (the stub's trap would then be
the program's, and kill it) to the ``munmap`` of the rescue itself. A tool killed while such a
thread wears the injection's registers would leave it to run on from them. So the injection
carries its own way home (``arch/x86_64/sigframe.py``), built from the program's code alone,
or at a clean end from the rescue's (a ``syscall; ret`` and a restorer beside its stub) while
its mapping lasts:

- the ``syscall`` is one that the program's code follows by a plain ``ret`` (libc's, else the
  dynamic loader's: at the exit of ``execve`` nothing else is mapped);
- the stack pointer points at an ``rt_sigframe`` below the red zone, whose return address is
  a ``mov rax, 15; syscall`` (libc's ``__restore_rt``; glibc's loader has one too) and whose
  ``ucontext`` holds the thread's own registers, signal mask and XSAVE state.

Left alone at any moment, the thread finishes the ``mmap``, returns into the restorer, and
``rt_sigreturn`` loads everything back. While the tool lives it goes home another way, the
kernel's way: the thread is stopped at the syscall's exit (``PTRACE_SYSCALL``), the result
read, an interrupt asked for (``PTRACE_INTERRUPT``), its own registers put back, and it is let
go as far as that interrupt's stop. So it is held at the end as it was held at the start, in a
stop inside the kernel's signal code: an interrupted syscall is restarted (or not) by the
kernel as if nothing had happened in between, and a thread lent while its own signal was
being delivered gets that signal again (``tgkill``) and stops on its delivery, where its
siginfo is put back (``program.py``). Each step leaves the thread in a state it goes on
from alone: the interrupt asked for before the registers are put back is dropped by the
kernel if we die (``__ptrace_unlink``), and the registers put back are its own.

Dying in the window still costs a little. A call interrupted with ``-ERESTART_RESTARTBLOCK``
(``nanosleep``, ``poll`` with a timeout) cannot be restarted through its restart block after
``rt_sigreturn``, which cancels the block: on the rescue's way home its restarter does it
before (``restart_syscall``, the result in the frame); on the program's the call is made again
from its start, with its arguments, so a sleep or a wait may last longer than asked, and one
that was already being restarted (``restart_syscall`` itself) fails with ``EINTR``, as after
a handler of the program's. The signal a thread was lent from, and those we held for it
meanwhile, are lost; the 4 MiB mapping stays, unused. The frame (3 KiB with AVX-512) goes
below the red zone of whatever stack the thread is on: one lent from inside a handler on a
small alternate stack could overrun it, as an injected call's return address already could.

Where no way home exists (no restorer in the program's code, a shadow stack that a ``ret``
without its ``call`` would break, a thread held at a syscall's entry), ``find_way_home``
says ``None`` and the caller injects as before (``calls.run_syscall``): the window is open
again for that program, as it was for every program before.

Rejected: single-stepping over the ``ret`` at the end (a tool killed during the step leaves
the trap flag set: the thread dies of the next SIGTRAP, the rescue not yet its handler);
letting the thread run through ``rt_sigreturn`` while the tool lives (the kernel's own
restart of an interrupted syscall, and a pending signal's delivery, would be ours instead);
a ``pop rax; ret`` chain instead of a restorer (not in glibc's loader; a restorer is).
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from typing import Final

from kprobes.arch.x86_64 import rescue as rescue_layout
from kprobes.arch.x86_64 import sigframe
from kprobes.errors import TargetError
from kprobes.linux import procfs, ptrace
from kprobes.process.engine.events import SYSCALL_TRAP
from kprobes.process.engine.threads import Thread, ThreadState, siginfo_code
from kprobes.process.inject import calls
from kprobes.symbols.maps import Mapping, read_maps
from kprobes.values import dataclass

AT_BASE: Final = 7  # auxv: the program interpreter's load address
_CHUNK: Final = 0x10000
_OVERLAP: Final = 16  # a pattern cut by a chunk's end is found in the next one
_XSTATE_MAX: Final = 0x10000  # more than any XSAVE layout so far (11,008 bytes with AMX)
_FAULTS: Final = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})
_MINUS_ONE: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class WayHome:
    """The two pieces of the program's code an injection borrows to go home by itself."""

    syscall_ret: int  # syscall; ret
    restorer: int  # mov rax, 15; syscall (rt_sigreturn)
    restarter: int = 0  # restart_syscall, then rt_sigreturn (the rescue's: rescue.c)


@dataclass(frozen=True, slots=True)
class _Saved:
    """What the thread goes back to."""

    regs: bytes  # the kernel's registers, exactly
    view: tuple[bytes, bool]  # a handler's view of them and its unsaved changes
    signal: int  # the signal whose delivery it was stopped in, 0 for any other stop


def find_way_home(thread: Thread, *, rescue_area: int = 0) -> WayHome | None:
    """A ``syscall; ret`` and a restorer in the code of ``thread``'s program (the rescue's
    own, at ``rescue_area``, if given), if a self-restoring injection is possible in it now;
    ``None`` to inject as before."""
    pid = thread.tracee.pid
    info = ptrace.get_syscall_info(thread.tid)
    if info.op not in (ptrace.PTRACE_SYSCALL_INFO_NONE, ptrace.PTRACE_SYSCALL_INFO_EXIT):
        return None  # its syscall has not run yet: we would run ours in its place
    if "shstk" in procfs.read_status(pid).get("x86_Thread_features", "").split():
        return None
    if rescue_area:
        return WayHome(
            rescue_layout.syscall_ret(rescue_area),
            rescue_layout.restorer(rescue_area),
            rescue_layout.restarter(rescue_area),
        )
    syscall_ret = restorer = None
    for m in _code_mappings(pid):
        for start, data in _chunks(thread, m):
            if syscall_ret is None:
                syscall_ret = sigframe.find_syscall_ret(data, start)
            if restorer is None:
                restorer = sigframe.find_restorer(data, start)
            if syscall_ret is not None and restorer is not None:
                return WayHome(syscall_ret, restorer)
    return None


def _code_mappings(pid: int) -> list[Mapping]:
    """The program's read-only code, libc first, then the loader, then the rest.

    Files and the vdso only: not anonymous or writable code (a JIT's may change under us),
    nor [vsyscall] (emulated: its bytes do not run). Libc and the loader stay mapped as long
    as the program runs.
    """
    try:
        loader = procfs.read_auxv(pid).get(AT_BASE, 0)
    except OSError:
        loader = 0
    maps = read_maps(pid)
    loader_path = next((m.path for m in maps if m.contains(loader)), None) if loader else None

    def rank(m: Mapping) -> int:
        if os.path.basename(m.path).startswith(("libc.", "libc-")):
            return 0
        if m.path == loader_path:
            return 1
        return 3 if m.path == "[vdso]" else 2

    code = [
        m
        for m in maps
        if "x" in m.perms and "w" not in m.perms and (m.is_file_backed or m.path == "[vdso]")
    ]
    return sorted(code, key=rank)


def _chunks(thread: Thread, m: Mapping) -> Iterator[tuple[int, bytes]]:
    for start in range(m.start, m.end, _CHUNK):
        size = min(_CHUNK + _OVERLAP, m.end - start)
        try:
            yield start, thread.tracee.read(start, size)
        except TargetError:
            return


def run_syscall(thread: Thread, way: WayHome, nr: int, *args: int) -> int:
    """Execute syscall ``nr`` in the held ``thread`` on ``way``; the raw result (a negative
    errno on failure). The thread is held at the end in a stop of the kernel's signal code
    with its own registers (see above)."""
    assert thread.state is ThreadState.STOPPED, "inject needs a held thread"
    tid = thread.tid
    # Step 1: what the thread goes back to: registers, signal mask, FPU state.
    view = (bytes(thread.regs.buffer), thread.regs.dirty)
    regs = thread.load_regs()
    saved = _Saved(bytes(regs.buffer), view, _delivered_signal(thread))
    mask = ptrace.getsigmask(tid)
    fpu = sigframe.fpstate(_fpu_image(tid))
    # Step 2: its way home, below its red zone: a frame rt_sigreturn turns back into it.
    home = calls.home_regs(thread, saved.regs, view[0])
    if way.restarter and sigframe.in_restart_block(home):
        frame = sigframe.build(home, mask, fpu, way.restarter)
    else:
        frame = sigframe.build(sigframe.resumed(home), mask, fpu, way.restorer)
    try:
        thread.tracee.write(frame.address, frame.data)
    except TargetError:
        calls.restore_regs(thread, saved.regs, view)
        raise
    # Step 3: the injection's registers. From here the thread goes home by itself.
    regs.rax = nr
    regs.orig_rax = _MINUS_ONE  # no restart of the syscall it may have been in
    for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
        regs.set(name, value)
    regs.rip = way.syscall_ret
    regs.rsp = frame.address
    thread.store_regs()
    # Step 4: to the syscall's exit; its result.
    try:
        result = _run_to_exit(thread, way, nr)
    except _Faulted as exc:
        calls.restore_regs(thread, saved.regs, view)  # held in the fault's delivery stop
        raise TargetError(f"injected syscall {nr} faulted in thread {tid} (signal {exc})") from exc
    # Step 5: home, the kernel's way.
    _go_home(thread, saved)
    return result - (1 << 64) if result >= 1 << 63 else result


def _delivered_signal(thread: Thread) -> int:
    """The signal whose delivery ``thread`` was stopped in (lent while it came), else 0."""
    status = thread.pending
    if status is None or not os.WIFSTOPPED(status) or status >> 16:
        return 0
    sig = os.WSTOPSIG(status)
    return 0 if sig == SYSCALL_TRAP else sig


def _fpu_image(tid: int) -> bytes:
    """The thread's XSAVE state (its FXSAVE part alone on a machine without XSAVE)."""
    try:
        return ptrace.getregset(tid, ptrace.NT_X86_XSTATE, _XSTATE_MAX)
    except OSError as exc:
        if exc.errno not in (errno.ENODEV, errno.EINVAL):
            raise
        return ptrace.getfpregs(tid)


class _Faulted(Exception):
    """The injected code faulted (the signal's number in ``args``)."""


def _run_to_exit(thread: Thread, way: WayHome, nr: int) -> int:
    """Run ``thread`` from its injection registers to the exit of syscall ``nr`` at
    ``way.syscall_ret``; its raw return value. Signals that come meanwhile are held for the
    thread (delivered once it is home); a pending interrupt's stop is consumed."""
    entered = False
    _syscall_resume(thread.tid)
    while True:
        status = _wait(thread)
        sig = os.WSTOPSIG(status)
        if sig == SYSCALL_TRAP:
            info = ptrace.get_syscall_info(thread.tid)
            if info.op == ptrace.PTRACE_SYSCALL_INFO_ENTRY:
                entered = info.nr == nr
            elif info.op == ptrace.PTRACE_SYSCALL_INFO_EXIT and entered:
                return info.rval & _MINUS_ONE
        elif status >> 16 == 0:  # a signal-delivery stop
            siginfo = ptrace.getsiginfo(thread.tid)
            if sig in _FAULTS and siginfo_code(siginfo) > 0:  # sent by the kernel: a fault
                raise _Faulted(sig)
            thread.held_signals.append((sig, siginfo))
        _syscall_resume(thread.tid)


def _go_home(thread: Thread, saved: _Saved) -> None:
    """From the syscall's exit, back to the thread's own registers in a stop of the kernel's
    signal code: our interrupt's stop, or the delivery of its own signal, sent again.

    The order makes every moment safe to die in: the stop is asked for first (the kernel
    drops an interrupt when its tracer dies, and a signal the thread was being given is
    given), then the registers are put back.
    """
    tid = thread.tid
    if saved.signal:
        ptrace.tgkill(thread.tracee.pid, tid, saved.signal)
    else:
        ptrace.interrupt(tid)
    calls.restore_regs(thread, saved.regs, saved.view)
    _resume_home(tid)
    while True:
        status = _wait(thread)
        is_delivery = status >> 16 == 0
        sig = os.WSTOPSIG(status)
        if not saved.signal:
            # The first stop, whatever it is, ends our interrupt's claim: the thread is home.
            # The kernel takes the interrupt before any signal; one that came first anyway
            # is held, and delivered from this very stop when the thread is resumed.
            if is_delivery:
                thread.held_signals.append((sig, ptrace.getsiginfo(tid)))
            thread.event_stopped = not is_delivery
            return
        if is_delivery and sig == saved.signal:
            thread.event_stopped = False
            return
        if is_delivery:
            thread.held_signals.append((sig, ptrace.getsiginfo(tid)))
        ptrace.cont(tid, 0)


# -- the requests and the wait, apart so that a test can die at each (tests/drivers) -------


def _syscall_resume(tid: int) -> None:
    ptrace.syscall_cont(tid, 0)


def _resume_home(tid: int) -> None:
    ptrace.cont(tid, 0)


# The thread's next stop: the one wait of every injection (the kill-window tests' driver
# hooks this name, as it hooks the steps above).
_wait = calls.next_stop
