"""A signal frame that takes a borrowed thread home by itself (x86-64 ``rt_sigreturn``).

The rescue's mapping is made by one injected ``mmap`` before anything of ours is in the
program: while the thread wears the injection's registers, a tool killed now would leave it
to run on from them. So the injection is given a way home that needs no one. Its ``syscall``
is one that libc follows by a plain ``ret``; its stack pointer points at an ``rt_sigframe``
whose return address is libc's signal restorer (``mov rax, 15; syscall``) and whose
``ucontext`` holds the thread's own registers, signal mask and FPU state. Left alone at any
moment, the thread finishes the ``mmap``, returns into the restorer, and ``rt_sigreturn``
loads everything back from the frame, as after a signal handler.

The frame is laid out as the kernel lays out its own (``arch/x86/kernel/signal_64.c``,
``asm/sigframe.h``, ``uapi/asm/sigcontext.h``, ``fpu/signal.c``): the FPU state 64-byte
aligned below the red zone, then the frame, so that ``rsp + 8`` is 16-byte aligned after the
``ret``. Everything here is pure: registers and state in, bytes out.

- **The registers** are those the thread will really go on from: an interrupted syscall the
  kernel would restart is restarted from the frame (``rt_sigreturn`` sets ``orig_rax = -1``,
  so the kernel's own restart would not happen). A ``-ERESTART_RESTARTBLOCK`` call
  (``nanosleep``, ``poll`` with a timeout, futex waits) is made again from its start with its
  own arguments: ``rt_sigreturn`` cancels the restart block, so ``restart_syscall`` would fail
  with ``EINTR``, which POSIX allows only when a handler ran (a program with none never
  checks for it), where it allows a sleep or a wait to last longer than asked.
- **The FPU state** is the thread's XSAVE image (``PTRACE_GETREGSET NT_X86_XSTATE``) with
  the software bytes and the end magic the kernel checks; without them it would restore the
  legacy FXSAVE part alone and reset AVX and later state. A NULL ``fpstate`` resets it all.
- **The alternate signal stack** (``uc_stack``) is unknown without another injection, and
  ``rt_sigreturn`` sets it from the frame (``restore_altstack``). But it ignores the result
  ("squash all but EFAULT", ``kernel/signal.c``), and ``do_sigaltstack`` refuses a mode that
  is neither 0, ``SS_ONSTACK`` nor ``SS_DISABLE`` with ``-EINVAL`` before it changes
  anything: ``SS_REFUSED`` leaves the thread its own alternate stack, whatever it is
  (``tests/programs/window.c`` checks it). Zeros would do only by chance: ``-ENOMEM``
  (smaller than ``MINSIGSTKSZ``) unless the thread has no alternate stack, where they match.

Rejected: ``syscall()``'s error path (it writes ``errno``), and a restorer of our own (we
have no code in the program yet: that is what the ``mmap`` is for).
"""

from __future__ import annotations

import struct
from typing import Final

from kprobes.arch.x86_64.abi import RED_ZONE
from kprobes.arch.x86_64.decode import MAX_INSN_LEN, decode_raw
from kprobes.arch.x86_64.iced import Code, Code_, Mnemonic, OpKind, Register
from kprobes.arch.x86_64.regs import REG_INDEX, REGS_SIZE
from kprobes.errors import NotABoundary
from kprobes.values import dataclass

# struct rt_sigframe: char *pretcode; struct ucontext uc; struct siginfo info;
FRAME_SIZE: Final = 8 + 304 + 128
UC: Final = 8  # the ucontext, in the frame
UC_FLAGS: Final = 0
UC_STACK: Final = 16  # stack_t: void *ss_sp; int ss_flags; size_t ss_size
UC_MCONTEXT: Final = 40  # struct sigcontext, 256 bytes
UC_SIGMASK: Final = 296
SC_FPSTATE: Final = 184  # in struct sigcontext

UC_FP_XSTATE: Final = 0x1
UC_SIGCONTEXT_SS: Final = 0x2
UC_STRICT_RESTORE_SS: Final = 0x4
SS_REFUSED: Final = 0x7FFF_FFFF  # no mode do_sigaltstack() accepts: it changes nothing

# struct sigcontext (64-bit) begins with these, in this order, then cs, gs, fs, ss (u16).
SIGCONTEXT_REGS: Final = (
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
    "rdi", "rsi", "rbp", "rbx", "rdx", "rax", "rcx", "rsp", "rip", "eflags",
)  # fmt: skip
_SIGCONTEXT: Final = struct.Struct("<18Q4H5Q64x")  # ... err, trapno, oldmask, cr2, fpstate
UC_RAX: Final = UC_MCONTEXT + 8 * SIGCONTEXT_REGS.index("rax")  # where a restarter's result goes

# The FPU state: an FXSAVE image (512 bytes) or an XSAVE one (the header at 512).
FXSAVE_SIZE: Final = 512
XSTATE_MIN: Final = 576  # the legacy area and the XSAVE header
SW_BYTES: Final = 464  # struct _fpx_sw_bytes, in the FXSAVE area's software-reserved bytes
XSTATE_BV: Final = 512
FP_XSTATE_MAGIC1: Final = 0x46505853
FP_XSTATE_MAGIC2: Final = 0x46505845
_SW: Final = struct.Struct("<IIQI28x")  # magic1, extended_size, xfeatures, xstate_size
XFEATURE_FPSSE: Final = 0x3
XFEATURE_PKRU: Final = 1 << 9
XFEATURE_XTILEDATA: Final = 1 << 18  # AMX tile data: the last state, 8 KiB, permission only
XTILEDATA_SIZE: Final = 8192

# Syscall restarts (include/linux/errno.h), as arch_do_signal_or_restart() applies them.
ERESTARTSYS: Final = 512
ERESTARTNOINTR: Final = 513
ERESTARTNOHAND: Final = 514
ERESTART_RESTARTBLOCK: Final = 516
SYSCALL_INSN_LEN: Final = 2  # syscall is 0f 05

_MASK64: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Frame:
    """A frame to write at ``address``, where the thread's rsp points (its return address)."""

    address: int
    data: bytes  # the frame, padding, then the FPU state up to its end magic
    fpstate: int  # where the FPU state begins (64-byte aligned)

    @property
    def end(self) -> int:
        return self.address + len(self.data)


def _reg(regs: bytes, name: str) -> int:
    return int.from_bytes(regs[8 * REG_INDEX[name] : 8 * REG_INDEX[name] + 8], "little")


def _with(regs: bytes, **values: int) -> bytes:
    out = bytearray(regs)
    for name, value in values.items():
        at = 8 * REG_INDEX[name]
        out[at : at + 8] = (value & _MASK64).to_bytes(8, "little")
    return bytes(out)


def resumed(regs: bytes) -> bytes:
    """``regs`` (``struct user_regs_struct``) as the thread goes on from them with no handler:
    an interrupted syscall restarted (rip back on the ``syscall``, rax its number again), a
    restart-block syscall made again from its start; anything else unchanged."""
    nr = _reg(regs, "orig_rax")
    if nr >= 1 << 63:  # -1: not in a syscall
        return regs
    rax = _reg(regs, "rax")
    error = _MASK64 + 1 - rax if rax >= 1 << 63 else 0
    if error in (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK):
        return _with(regs, rax=nr, rip=_reg(regs, "rip") - SYSCALL_INSN_LEN)
    return regs


def in_restart_block(regs: bytes) -> bool:
    """Whether ``regs`` are those of a call interrupted with ``-ERESTART_RESTARTBLOCK``: one
    that a restorer restarting it (the rescue's restarter) finishes better than ``resumed``."""
    nr, rax = _reg(regs, "orig_rax"), _reg(regs, "rax")
    return nr < 1 << 63 and rax == _MASK64 + 1 - ERESTART_RESTARTBLOCK


def fpstate(image: bytes) -> bytes:
    """The frame's FPU state from the thread's: an FXSAVE image (512 bytes, as
    PTRACE_GETFPREGS gives it) is used as it is; an XSAVE image (as PTRACE_GETREGSET
    NT_X86_XSTATE gives it, the user's XCR0 in its first software-reserved word) gets what the
    kernel puts in its own frames: FP/SSE (and PKRU) marked present in the header, the
    ``_fpx_sw_bytes`` and ``FP_XSTATE_MAGIC2`` right after the state.

    The kernel refuses an ``xstate_size`` larger than the task's own state: the AMX tile data
    (8 KiB, the last state) counts only for a task allowed to use it, so a frame whose tiles
    are unused leaves them out, and carries the end magic after them too (some kernels looked
    for it at the end of the task's whole state: commit dc8aa31a7ac2, reverted since).
    """
    if len(image) == FXSAVE_SIZE:
        return image
    if len(image) < XSTATE_MIN:
        raise ValueError(f"an XSAVE image of {len(image)} bytes")
    out = bytearray(image)
    xcr0 = int.from_bytes(out[SW_BYTES : SW_BYTES + 8], "little")
    present = int.from_bytes(out[XSTATE_BV : XSTATE_BV + 8], "little") | XFEATURE_FPSSE
    if xcr0 & XFEATURE_PKRU:
        present |= XFEATURE_PKRU  # its value is the task's; "absent" would load 0
    features = (xcr0 or present) & _MASK64
    size = len(out)
    unused_tiles = features & XFEATURE_XTILEDATA and not present & XFEATURE_XTILEDATA
    if unused_tiles and size - XTILEDATA_SIZE >= XSTATE_MIN:
        size -= XTILEDATA_SIZE
        features &= ~XFEATURE_XTILEDATA
    out[XSTATE_BV : XSTATE_BV + 8] = present.to_bytes(8, "little")
    _SW.pack_into(out, SW_BYTES, FP_XSTATE_MAGIC1, size + 4, features, size)
    magic = FP_XSTATE_MAGIC2.to_bytes(4, "little")
    out[size : size + 4] = magic
    if size != len(image):
        out += magic
    return bytes(out)


def sigcontext(regs: bytes, sigmask: int, fp_at: int) -> bytes:
    """``struct sigcontext`` holding ``regs``; the FPU state at ``fp_at``."""
    values = [_reg(regs, name) for name in SIGCONTEXT_REGS]
    cs, ss = _reg(regs, "cs") & 0xFFFF, _reg(regs, "ss") & 0xFFFF
    return _SIGCONTEXT.pack(*values, cs, 0, 0, ss, 0, 0, sigmask & _MASK64, 0, fp_at)


def build(regs: bytes, sigmask: int, fpu: bytes, restorer: int) -> Frame:
    """The frame below ``regs``' stack that ``rt_sigreturn`` turns back into ``regs``.

    ``regs`` are the registers to go back to (see ``resumed``), ``sigmask`` the thread's
    blocked signals, ``fpu`` its FPU state (see ``fpstate``), ``restorer`` the address of a
    ``mov rax, 15; syscall``: the ``ret`` after the injected syscall lands there.
    """
    if len(regs) < REGS_SIZE:
        raise ValueError(f"{len(regs)} bytes of registers")
    sp = _reg(regs, "rsp")
    fp_at = (sp - RED_ZONE - len(fpu)) & ~63
    address = ((fp_at - FRAME_SIZE) & ~15) - 8
    flags = UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS
    if len(fpu) > FXSAVE_SIZE:
        flags |= UC_FP_XSTATE
    frame = bytearray(fp_at - address)
    struct.pack_into("<Q", frame, 0, restorer)
    struct.pack_into("<QQQi4xQ", frame, UC + UC_FLAGS, flags, 0, 0, SS_REFUSED, 0)
    frame[UC + UC_MCONTEXT : UC + UC_SIGMASK] = sigcontext(regs, sigmask, fp_at)
    struct.pack_into("<Q", frame, UC + UC_SIGMASK, sigmask & _MASK64)
    return Frame(address=address, data=bytes(frame) + fpu, fpstate=fp_at)


# -- the two pieces of the program's code the frame relies on ------------------------------


def find_syscall_ret(code: bytes, base: int) -> int | None:
    """The first ``syscall`` in ``code`` (mapped at ``base``) that a ``ret`` follows."""
    at = code.find(b"\x0f\x05")
    while at >= 0:
        if _is(code, at, base, Code.SYSCALL) and _is(code, at + 2, base, Code.RETNQ):
            return base + at
        at = code.find(b"\x0f\x05", at + 1)
    return None


def find_restorer(code: bytes, base: int) -> int | None:
    """The first ``mov rax, 15; syscall`` (``rt_sigreturn``, libc's ``__restore_rt``) in
    ``code`` (mapped at ``base``), whichever encoding of the move it uses."""
    at = code.find(b"\x0f\x05")
    while at >= 0:
        for length in (5, 7, 10):  # mov eax, imm32; mov rax, imm32; mov rax, imm64
            start = at - length
            if start >= 0 and _is_mov_rax_15(code, start, base, length):
                return base + start
        at = code.find(b"\x0f\x05", at + 1)
    return None


def _is(code: bytes, at: int, base: int, want: Code_) -> bool:
    try:
        instr = decode_raw(code[at : at + MAX_INSN_LEN], base + at)
    except NotABoundary:
        return False
    return bool(instr.code == want)


def _is_mov_rax_15(code: bytes, at: int, base: int, length: int) -> bool:
    try:
        instr = decode_raw(code[at : at + MAX_INSN_LEN], base + at)
    except NotABoundary:
        return False
    return bool(
        instr.len == length
        and instr.mnemonic == Mnemonic.MOV
        and instr.op0_kind == OpKind.REGISTER
        and instr.op0_register in (Register.RAX, Register.EAX)
        and instr.op1_kind in (OpKind.IMMEDIATE32, OpKind.IMMEDIATE32TO64, OpKind.IMMEDIATE64)
        and instr.immediate(1) == 15
    )
