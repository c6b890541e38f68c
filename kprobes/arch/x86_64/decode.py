"""Instruction decoding and the instruction-boundary check.

x86 has no alignment: a byte in the middle of an instruction may also start another, valid,
instruction. A breakpoint placed there would corrupt the instruction around it, so the kernel's
``can_probe()`` decodes from the start of the enclosing function up to the probe address and
accepts the address only if one decoded instruction starts exactly there. We do the same linear
sweep. (Recursive-descent disassembly would also follow jumps around embedded data, but compilers
do not put data inside x86-64 functions, and the kernel makes the same linear assumption.)

Every decode in the package goes through ``decode_raw()`` so that a byte sequence iced cannot
decode is reported one way: ``NotABoundary`` with errno EILSEQ, the errno ``register_kprobe()``
returns for an address that is not an instruction boundary. The caller must hand us original
bytes, never bytes that already carry our own int3 or jmp patches.

iced-x86 is imported only inside ``kprobes.arch.x86_64``; everything above sees ``Insn``.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Final

from kprobes.arch.x86_64.iced import (
    Code,
    Decoder,
    DecoderError,
    Formatter,
    FormatterSyntax,
    Instruction,
)
from kprobes.errors import InternalError, NotABoundary
from kprobes.values import dataclass

# The architectural limit: a longer byte sequence raises #UD (SDM vol. 2, 2.3.11).
MAX_INSN_LEN: Final = 15


@dataclass(frozen=True, slots=True)
class Insn:
    """One decoded instruction at its runtime address."""

    addr: int
    length: int
    code: bytes
    text: str

    @property
    def end(self) -> int:
        """The address of the next instruction."""
        return self.addr + self.length


def _make_formatter() -> Formatter:
    # Intel syntax as objdump -M intel and the kernel's own messages spell it, with rip-relative
    # operands shown as written (``[rip+0x2ee4]``) so the text matches the bytes.
    formatter = Formatter(FormatterSyntax.INTEL)
    formatter.space_after_operand_separator = True
    formatter.rip_relative_addresses = True
    formatter.hex_prefix = "0x"
    formatter.hex_suffix = ""
    formatter.uppercase_hex = False
    formatter.show_branch_size = False
    formatter.branch_leading_zeros = False
    return formatter


_FORMATTER: Final = _make_formatter()


def format_instruction(instr: Instruction) -> str:
    """``instr`` as text, e.g. ``mov eax, [rip+0x2ee4]``."""
    return str(_FORMATTER.format(instr))


def decode_raw(code: bytes, addr: int) -> Instruction:
    """The first instruction of ``code`` as iced sees it; for use inside this package only.

    Raises NotABoundary (EILSEQ) when the bytes are not a valid instruction or are cut short.
    """
    decoder = Decoder(64, code[:MAX_INSN_LEN], ip=addr)
    instr = decoder.decode()
    if instr.code == Code.INVALID:
        raise NotABoundary(_invalid_message(code, addr, decoder), errno=errno.EILSEQ)
    return instr


def _invalid_message(code: bytes, addr: int, decoder: Decoder) -> str:
    shown = code[:MAX_INSN_LEN].hex(" ")
    if decoder.last_error == DecoderError.NO_MORE_BYTES:
        return f"the bytes at {addr:#x} are not a valid instruction (cut short: {shown})"
    return f"the bytes at {addr:#x} are not a valid instruction ({shown})"


def _insn(code: bytes, offset: int, instr: Instruction) -> Insn:
    length = instr.len
    return Insn(
        addr=instr.ip,
        length=length,
        code=bytes(code[offset : offset + length]),
        text=format_instruction(instr),
    )


def decode_at(code: bytes, addr: int) -> Insn:
    """The first instruction of ``code``, which starts at runtime address ``addr``."""
    return _insn(code, 0, decode_raw(code, addr))


def iter_insns(code: bytes, start: int) -> Iterator[Insn]:
    """Linear sweep over ``code`` (starting at runtime address ``start``).

    Stops at the end of ``code``; an instruction cut short by the end is not yielded (the caller
    usually reads a fixed window, and its last instruction may straddle the edge). An invalid
    instruction before the end raises NotABoundary: nothing after it can be trusted.
    """
    decoder = Decoder(64, code, ip=start)
    offset = 0
    for instr in decoder:
        if instr.code == Code.INVALID:
            if decoder.last_error == DecoderError.NO_MORE_BYTES:
                return
            raise NotABoundary(
                _invalid_message(code[offset:], start + offset, decoder), errno=errno.EILSEQ
            )
        yield _insn(code, offset, instr)
        offset += instr.len


def check_boundary(code: bytes, func_start: int, addr: int) -> Insn:
    """Prove that ``addr`` starts an instruction of the function at ``func_start``.

    ``code`` holds the function's original bytes from ``func_start`` on, at least up to
    ``addr + MAX_INSN_LEN`` (less is fine at the end of a mapping). Returns the instruction at
    ``addr``; raises NotABoundary (EILSEQ) naming the instruction that straddles ``addr``.
    """
    if not func_start <= addr < func_start + len(code):
        raise NotABoundary(
            f"{addr:#x} is outside the {len(code)} bytes decoded from {func_start:#x}",
            errno=errno.EILSEQ,
        )
    decoder = Decoder(64, code, ip=func_start)
    offset = 0
    for instr in decoder:
        here = func_start + offset
        if instr.code == Code.INVALID and here == addr:
            raise NotABoundary(_invalid_message(code[offset:], addr, decoder), errno=errno.EILSEQ)
        if instr.code == Code.INVALID:
            raise NotABoundary(
                f"{addr:#x} is not a provable instruction boundary: decoding from "
                f"{func_start:#x} met an invalid instruction at {here:#x}",
                errno=errno.EILSEQ,
            )
        if here == addr:
            return _insn(code, offset, instr)
        if here + instr.len > addr:
            raise NotABoundary(
                f"{addr:#x} is not an instruction boundary: it is inside "
                f"`{format_instruction(instr)}` at {here:#x} ({instr.len} bytes)",
                errno=errno.EILSEQ,
            )
        offset += instr.len
    # The range check above put addr inside code, and the sweep covers all of code.
    raise InternalError(f"{addr:#x} was not reached decoding from {func_start:#x}")
