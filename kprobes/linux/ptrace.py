"""The thin syscall layer: ptrace, wait, signals and process memory.

One place loads libc with ctypes, one function per ptrace request, and exactly one place
(``_check``) turns ``-1``/errno into ``OSError``. It holds no state and makes no decisions;
``process/`` above it translates ``OSError`` into the package's exceptions. Nothing above
``process/`` sees ctypes.

Register buffers are passed as the integer address of a caller-owned ``bytearray`` so a hit
costs one foreign call for PTRACE_GETREGS and one for PTRACE_SETREGS, with no allocation.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Final

_libc = ctypes.CDLL(None, use_errno=True)
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
PTRACE_CONT: Final = 7
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


def _check(result: int) -> int:
    """The one place a -1 return becomes an exception."""
    if result == -1:
        err = ctypes.get_errno()
        if err:
            raise OSError(err, os.strerror(err))
    return result


def _word(value: int) -> ctypes.c_void_p | None:
    return ctypes.c_void_p(value) if value else None


class StructBuffer:
    """A caller-owned bytearray handed to requests that fill or read a struct, in place."""

    __slots__ = ("_array",)

    def __init__(self, buf: bytearray) -> None:
        self._array = (ctypes.c_char * len(buf)).from_buffer(buf)


def seize(tid: int, options: int) -> None:
    _check(_ptrace(PTRACE_SEIZE, tid, None, _word(options)))


def set_options(tid: int, options: int) -> None:
    _check(_ptrace(PTRACE_SETOPTIONS, tid, None, _word(options)))


def interrupt(tid: int) -> None:
    _check(_ptrace(PTRACE_INTERRUPT, tid, None, None))


def cont(tid: int, sig: int = 0) -> None:
    if _ptrace(PTRACE_CONT, tid, None, _word(sig) if sig else None) == -1:
        _check(-1)


def singlestep(tid: int, sig: int = 0) -> None:
    _check(_ptrace(PTRACE_SINGLESTEP, tid, None, _word(sig)))


def listen(tid: int) -> None:
    _check(_ptrace(PTRACE_LISTEN, tid, None, None))


def detach(tid: int, sig: int = 0) -> None:
    _check(_ptrace(PTRACE_DETACH, tid, None, _word(sig)))


def getregs(tid: int, buf: StructBuffer) -> None:
    if _ptrace(PTRACE_GETREGS, tid, None, buf._array) == -1:
        _check(-1)


def setregs(tid: int, buf: StructBuffer) -> None:
    if _ptrace(PTRACE_SETREGS, tid, None, buf._array) == -1:
        _check(-1)


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


def sigchld_wait(timeout: float) -> None:
    """Sleep until SIGCHLD is pending or ``timeout`` passes; SIGCHLD must be blocked."""
    signal.sigtimedwait([signal.SIGCHLD], max(timeout, 0.0))


def block_sigchld() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])


def unblock_sigchld() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
