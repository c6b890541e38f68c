"""The thin syscall layer: ptrace, wait, signals and process memory.

One place loads libc with ctypes, one function per ptrace request (GETREGS, SETREGS,
POKEUSER and CONT without a signal are a thread's ``bind_requests``), and exactly one place
(``raise_error``) turns ``-1``/errno into ``OSError``. It holds no state and makes no
decisions; ``process/`` above it translates ``OSError`` into the package's exceptions.
Nothing above ``process/`` sees ctypes.

A breakpoint hit makes three requests (GETREGS, then POKEUSER of rip or SETREGS, then CONT)
and the cost of each, past the kernel's, is ctypes': about 2,700 machine instructions per
call, 400 more through a Python function around it. So ``bind_requests`` gives a thread's hit
requests with every argument bound once (``functools.partial`` over the foreign function):
they cost the foreign call alone, return the raw result, and their caller hands a ``-1`` to
``raise_error``. Register buffers are
caller-owned ``bytearray``s seen as ctypes arrays (no allocation per call), and 64-bit
arguments are caller-owned ``Word``s, built once: building a ctypes integer costs a third of
the call that takes it.

libc is loaded as a ``PyDLL``: its calls keep the GIL. Every call made through it returns at
once (ptrace requests never block, and neither does tgkill); waiting happens in
``os.waitpid``, which does release the GIL. Not releasing and re-taking the GIL around each
call saves about 400 instructions per call.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable
from functools import partial
from typing import Final, NoReturn

from kprobes.values import dataclass

_libc = ctypes.PyDLL(None, use_errno=True)
# ptrace(2) is variadic in glibc, so no argtypes: every argument is passed as an int that fits
# in 32 bits (request, tid), None (NULL) or a ctypes object (a 64-bit pointer or value). Skipping
# argtypes conversion saves about a third of the cost of each call on the hit path.
_ptrace = _libc.ptrace
_ptrace.restype = ctypes.c_long
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

PTRACE_TRACEME: Final = 0
PTRACE_PEEKDATA: Final = 2
PTRACE_POKEDATA: Final = 5
PTRACE_POKEUSER: Final = 6
PTRACE_CONT: Final = 7
PTRACE_SYSCALL: Final = 24
PTRACE_KILL: Final = 8
PTRACE_SINGLESTEP: Final = 9
PTRACE_GETREGS: Final = 12
PTRACE_SETREGS: Final = 13
PTRACE_GETFPREGS: Final = 14
PTRACE_SETFPREGS: Final = 15
PTRACE_DETACH: Final = 17
PTRACE_SETOPTIONS: Final = 0x4200
PTRACE_GETEVENTMSG: Final = 0x4201
PTRACE_GETSIGINFO: Final = 0x4202
PTRACE_SETSIGINFO: Final = 0x4203
PTRACE_SEIZE: Final = 0x4206
PTRACE_INTERRUPT: Final = 0x4207
PTRACE_LISTEN: Final = 0x4208

PTRACE_O_TRACESYSGOOD: Final = 0x01
PTRACE_O_TRACEFORK: Final = 0x02
PTRACE_O_TRACEVFORK: Final = 0x04
PTRACE_O_TRACECLONE: Final = 0x08
PTRACE_O_TRACEEXEC: Final = 0x10
PTRACE_O_TRACEVFORKDONE: Final = 0x20
PTRACE_O_TRACEEXIT: Final = 0x40

PTRACE_EVENT_FORK: Final = 1
PTRACE_EVENT_VFORK: Final = 2
PTRACE_EVENT_CLONE: Final = 3
PTRACE_EVENT_EXEC: Final = 4
PTRACE_EVENT_VFORK_DONE: Final = 5
PTRACE_EVENT_EXIT: Final = 6
PTRACE_EVENT_STOP: Final = 128

WALL: Final = 0x40000000  # __WALL: wait for threads and non-SIGCHLD children too
WNOHANG: Final = os.WNOHANG

SIGINFO_SIZE: Final = 128
SI_KERNEL: Final = 0x80
SI_USER: Final = 0
SI_TKILL: Final = -6

_SYS_TGKILL: Final = 234


def raise_error() -> NoReturn:
    """The one place a failed call becomes an exception: the errno of the call that just
    returned -1 (ctypes keeps it, per thread, as the call returns)."""
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))


def _check(result: int) -> int:
    if result == -1 and ctypes.get_errno():
        raise_error()
    return result


def _word(value: int) -> ctypes.c_void_p | None:
    return ctypes.c_void_p(value) if value else None


class StructBuffer:
    """A caller-owned bytearray handed to requests that fill or read a struct, in place."""

    __slots__ = ("_array",)

    def __init__(self, buf: bytearray) -> None:
        self._array = (ctypes.c_char * len(buf)).from_buffer(buf)


class Word(ctypes.c_void_p):
    """A caller-owned 64-bit argument (an address, a register value), converted once.

    Set ``value`` and pass the same Word again: cheaper than a new ctypes integer per call.
    """


@dataclass(frozen=True, slots=True)
class BoundRequests:
    """The requests a breakpoint hit makes on one thread, every argument bound once.

    Each returns the raw result of ptrace(2); on ``-1`` the caller calls ``raise_error()``.
    """

    getregs: Callable[[], int]  # PTRACE_GETREGS into the thread's register buffer
    setregs: Callable[[], int]  # PTRACE_SETREGS from it
    # PTRACE_POKEUSER of one word at the bound offset: one register written back for about
    # half the kernel time of a PTRACE_SETREGS, which reads and checks all 27.
    poke_user: Callable[[Word], int]
    cont: Callable[[], int]  # how the thread is resumed now: PTRACE_CONT or PTRACE_SYSCALL
    plain_cont: Callable[[], int]  # PTRACE_CONT, no signal
    syscall_cont: Callable[[], int]  # PTRACE_SYSCALL, no signal: stop at its next syscall


def bind_requests(tid: int, regs: StructBuffer, user_offset: int) -> BoundRequests:
    """``tid``'s hit requests; ``user_offset`` is the word of ``struct user`` that
    ``poke_user`` writes (``regs`` is at offset 0, so a register's offset is 8 * its index)."""
    # A Python int goes to a variadic call as a C int, sign-extended to 64 bits: exact for an
    # offset this small, and cheaper to convert than a ctypes object.
    if not 0 <= user_offset < 1 << 31:
        raise ValueError(f"struct user offset {user_offset} out of range")
    return BoundRequests(
        getregs=partial(_ptrace, PTRACE_GETREGS, tid, None, regs._array),
        setregs=partial(_ptrace, PTRACE_SETREGS, tid, None, regs._array),
        poke_user=partial(_ptrace, PTRACE_POKEUSER, tid, user_offset),
        cont=partial(_ptrace, PTRACE_CONT, tid, None, None),
        plain_cont=partial(_ptrace, PTRACE_CONT, tid, None, None),
        syscall_cont=partial(_ptrace, PTRACE_SYSCALL, tid, None, None),
    )


def seize(tid: int, options: int) -> None:
    _check(_ptrace(PTRACE_SEIZE, tid, None, _word(options)))


def set_options(tid: int, options: int) -> None:
    _check(_ptrace(PTRACE_SETOPTIONS, tid, None, _word(options)))


def interrupt(tid: int) -> None:
    _check(_ptrace(PTRACE_INTERRUPT, tid, None, None))


def cont(tid: int, sig: int = 0) -> None:
    if _ptrace(PTRACE_CONT, tid, None, _word(sig) if sig else None) == -1:
        _check(-1)


def syscall_cont(tid: int, sig: int = 0) -> None:
    """PTRACE_SYSCALL: resume, and stop at the next syscall's entry or exit."""
    _check(_ptrace(PTRACE_SYSCALL, tid, None, _word(sig)))


def singlestep(tid: int, sig: int = 0) -> None:
    _check(_ptrace(PTRACE_SINGLESTEP, tid, None, _word(sig)))


def listen(tid: int) -> None:
    _check(_ptrace(PTRACE_LISTEN, tid, None, None))


def detach(tid: int, sig: int = 0) -> None:
    _check(_ptrace(PTRACE_DETACH, tid, None, _word(sig)))


FPREGS_SIZE: Final = 512  # struct user_fpregs_struct (the FXSAVE image)


def getfpregs(tid: int) -> bytes:
    """The FXSAVE image: x87 state, mxcsr, st0-7 at 32, xmm0-15 at 160 (16 bytes each)."""
    buf = ctypes.create_string_buffer(FPREGS_SIZE)
    _check(_ptrace(PTRACE_GETFPREGS, tid, None, buf))
    return buf.raw


def setfpregs(tid: int, image: bytes) -> None:
    buf = ctypes.create_string_buffer(bytes(image), FPREGS_SIZE)
    _check(_ptrace(PTRACE_SETFPREGS, tid, None, buf))


def geteventmsg(tid: int) -> int:
    value = ctypes.c_ulong(0)
    _check(_ptrace(PTRACE_GETEVENTMSG, tid, None, ctypes.byref(value)))
    return int(value.value)


def getsiginfo(tid: int) -> bytes:
    buf = ctypes.create_string_buffer(SIGINFO_SIZE)
    _check(_ptrace(PTRACE_GETSIGINFO, tid, None, buf))
    return bytes(buf.raw)


def setsiginfo(tid: int, info: bytes) -> None:
    buf = ctypes.create_string_buffer(info, SIGINFO_SIZE)
    _check(_ptrace(PTRACE_SETSIGINFO, tid, None, buf))


def tgkill(tgid: int, tid: int, sig: int) -> None:
    _check(
        _syscall(
            ctypes.c_long(_SYS_TGKILL), ctypes.c_long(tgid), ctypes.c_long(tid), ctypes.c_long(sig)
        )
    )


def waitpid(pid: int, options: int) -> tuple[int, int]:
    """waitpid(2) with __WALL added; (0, 0) when WNOHANG finds nothing."""
    return os.waitpid(pid, options | WALL)


# A stopped tracee's signal lives in the kernel until its stop is reaped (``wait_task_stopped``
# zeroes ``exit_code``; ``exit_ptrace`` leaves it): a thread whose tracer dies before the reap
# gets its SIGTRAP delivered, one whose tracer dies after resumes without it. So a trap stop
# is only peeked at (``waitid(WNOWAIT)``) and reaped once the thread has been put in a state
# that is right either way (process/engine/tracer.py).
TRAP_STOP: Final = (signal.SIGTRAP << 8) | 0x7F  # a signal-delivery stop of SIGTRAP
_PEEK: Final = os.WEXITED | os.WSTOPPED | os.WNOWAIT | WALL
_REAP: Final = os.WNOHANG | WALL


def wait(pid: int, options: int) -> tuple[int, int]:
    """``waitpid(pid, options)`` (pid -1: any), except that a SIGTRAP stop (``TRAP_STOP``)
    is left unreaped: the caller makes the thread safe, then reaps it (``World.reap``)."""
    tid, status = peek(pid, options)
    if tid and status != TRAP_STOP:
        got, reaped = os.waitpid(tid, _REAP)
        if got:
            status = reaped  # the same, unless it died in between (then its exit)
    return tid, status


def peek(pid: int, options: int) -> tuple[int, int]:
    """The next status of ``pid`` (-1: any child) as ``waitpid`` gives it, not reaped;
    (0, 0) when WNOHANG finds nothing."""
    if pid == -1:
        info = os.waitid(os.P_ALL, 0, options | _PEEK)
    else:
        info = os.waitid(os.P_PID, pid, options | _PEEK)
    if info is None:
        return 0, 0
    code, value = info.si_code, info.si_status
    if code == os.CLD_EXITED:
        status = (value & 0xFF) << 8
    elif code == os.CLD_KILLED:
        status = value
    elif code == os.CLD_DUMPED:
        status = value | 0x80
    else:  # CLD_TRAPPED, CLD_STOPPED: value is the whole exit_code (event << 8 | signal)
        status = (value << 8) | 0x7F
    return info.si_pid, status


def sigchld_wait(timeout: float) -> None:
    """Sleep until SIGCHLD is pending or ``timeout`` passes; SIGCHLD must be blocked."""
    signal.sigtimedwait([signal.SIGCHLD], max(timeout, 0.0))


def block_sigchld() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])


def unblock_sigchld() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])


# -- what a signal frame of our own needs (process/inject/selfrestore.py) -------------------------

PTRACE_GETREGSET: Final = 0x4204
PTRACE_GETSIGMASK: Final = 0x420A
PTRACE_SETSIGMASK: Final = 0x420B
PTRACE_GET_SYSCALL_INFO: Final = 0x420E
NT_X86_XSTATE: Final = 0x202
PTRACE_SYSCALL_INFO_NONE: Final = 0
PTRACE_SYSCALL_INFO_ENTRY: Final = 1
PTRACE_SYSCALL_INFO_EXIT: Final = 2
_SYSCALL_INFO_SIZE: Final = 88  # struct ptrace_syscall_info: op, arch, ip, sp, then a union


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


def getregset(tid: int, note: int, size: int) -> bytes:
    """PTRACE_GETREGSET: the regset ``note`` (NT_*), as many bytes as the kernel gives, at most
    ``size`` (a multiple of 8)."""
    buf = ctypes.create_string_buffer(size)
    iov = _Iovec(ctypes.addressof(buf), size)
    _check(_ptrace(PTRACE_GETREGSET, tid, _word(note), ctypes.byref(iov)))
    return buf.raw[: iov.len]


_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.restype = ctypes.c_ssize_t


def process_vm_readv(pid: int, addr: int, size: int) -> bytes:
    """Up to ``size`` bytes at ``addr`` in ``pid``, read as the process itself could read
    them: a page it may not read (PROT_NONE) ends the read, where /proc/PID/mem, which
    ptrace's FOLL_FORCE lets through, would not. Fewer bytes where readable memory ends;
    OSError (EFAULT) when none can be read."""
    buf = ctypes.create_string_buffer(size)
    local = _Iovec(ctypes.addressof(buf), size)
    remote = _Iovec(addr, size)
    n = _check(_process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
    return buf.raw[:n]


def getsigmask(tid: int) -> int:
    """PTRACE_GETSIGMASK: the signals the thread blocks (bit n-1 = signal n), as it will
    block them back in user space (the saved mask while a ``ppoll`` or the like has its own)."""
    mask = ctypes.c_uint64(0)
    _check(_ptrace(PTRACE_GETSIGMASK, tid, _word(8), ctypes.byref(mask)))
    return int(mask.value)


def setsigmask(tid: int, mask: int) -> None:
    """PTRACE_SETSIGMASK: the signals the thread blocks from now on (bit n-1 = signal n)."""
    value = ctypes.c_uint64(mask)
    _check(_ptrace(PTRACE_SETSIGMASK, tid, _word(8), ctypes.byref(value)))


@dataclass(frozen=True, slots=True)
class SyscallInfo:
    """PTRACE_GET_SYSCALL_INFO, the part we read: which stop (``op``: PTRACE_SYSCALL_INFO_*),
    and the syscall's number at its entry or its return value at its exit."""

    op: int
    nr: int  # at an entry stop
    rval: int  # at an exit stop (a negative errno on failure)


def get_syscall_info(tid: int) -> SyscallInfo:
    buf = ctypes.create_string_buffer(_SYSCALL_INFO_SIZE)
    _check(_ptrace(PTRACE_GET_SYSCALL_INFO, tid, _word(_SYSCALL_INFO_SIZE), buf))
    raw = buf.raw
    op = raw[0]
    value = int.from_bytes(raw[24:32], "little", signed=op == PTRACE_SYSCALL_INFO_EXIT)
    return SyscallInfo(
        op=op,
        nr=value if op == PTRACE_SYSCALL_INFO_ENTRY else -1,
        rval=value if op == PTRACE_SYSCALL_INFO_EXIT else 0,
    )
