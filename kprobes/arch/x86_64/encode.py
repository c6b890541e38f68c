"""The machine code we write into the target: breakpoints, jumps, and relocated copies.

Each function is pure (bytes in, bytes out) and refuses what it cannot encode: a ``rel32`` that
does not reach raises NotRelocatable with errno ERANGE, the errno the kernel's optimizer returns
when a detour buffer lies out of ``jmp`` reach.

Relocating a copy rewrites its rip-relative displacement in place (``newdisp = disp + (A - S)``,
as the kernel's ``__copy_instruction()`` does) instead of re-assembling the instruction. A
re-encode could pick another encoding of the same instruction (a shorter VEX form, a dropped
redundant prefix) and so another length; the slot's fixups and the single-step mapping
``addr + (rip - slot)`` rely on the copy being byte for byte as long as the original. iced still
locates the displacement, and decodes the result to prove it addresses the same absolute byte.
"""

from __future__ import annotations

import errno
import struct
from typing import Final

from kprobes.arch.x86_64.decode import MAX_INSN_LEN, decode_raw
from kprobes.arch.x86_64.iced import Decoder
from kprobes.errors import InternalError, NotRelocatable

INT3: Final = b"\xcc"
JMP_REL32_LEN: Final = 5
JMP_ABS64_LEN: Final = 14

_REL32_MIN: Final = -(1 << 31)
_REL32_MAX: Final = (1 << 31) - 1
_MASK64: Final = (1 << 64) - 1


def in_rel32_reach(src_next: int, dst: int) -> bool:
    """Whether a rel32 counted from ``src_next`` (the next instruction) reaches ``dst``."""
    return _REL32_MIN <= dst - src_next <= _REL32_MAX


def jmp_rel32(src: int, dst: int) -> bytes:
    """``jmp dst`` (E9 rel32) to be placed at ``src``."""
    rel = dst - (src + JMP_REL32_LEN)
    if not _REL32_MIN <= rel <= _REL32_MAX:
        raise NotRelocatable(
            f"jmp from {src:#x} cannot reach {dst:#x}: {rel:+#x} is outside rel32 (±2 GiB)",
            errno=errno.ERANGE,
        )
    return b"\xe9" + struct.pack("<i", rel)


def jmp_abs64(dst: int) -> bytes:
    """``jmp qword ptr [rip+0]`` followed by the 8-byte target: reaches anywhere, 14 bytes."""
    return b"\xff\x25\x00\x00\x00\x00" + struct.pack("<Q", dst & _MASK64)


def relocate_rip_relative(code: bytes, addr: int, slot: int) -> bytes:
    """The instruction ``code`` (from ``addr``) rewritten to run at ``slot``.

    An instruction without a rip-relative operand is position independent here (branches are
    emulated, never copied) and comes back unchanged. Otherwise its disp32 is rewritten so that
    ``slot + len + newdisp == addr + len + disp``; NotRelocatable (ERANGE) when that does not fit.
    """
    instr = decode_raw(code, addr)
    length = instr.len
    copy = bytes(code[:length])
    if not instr.is_ip_rel_memory_operand:
        return copy
    # Step 1: find the displacement field with iced (it may be followed by an immediate).
    decoder = Decoder(64, code[:MAX_INSN_LEN], ip=addr)
    offsets = decoder.get_constant_offsets(decoder.decode())
    if not offsets.has_displacement or offsets.displacement_size != 4:
        raise InternalError(f"rip-relative `{copy.hex(' ')}` at {addr:#x} has no disp32")
    at = offsets.displacement_offset
    (disp,) = struct.unpack_from("<i", copy, at)
    # Step 2: the new displacement addresses the same absolute byte from the slot.
    new_disp = disp + (addr - slot)
    if not _REL32_MIN <= new_disp <= _REL32_MAX:
        target = instr.ip_rel_memory_address
        raise NotRelocatable(
            f"the rip-relative operand of the instruction at {addr:#x} (target {target:#x}) "
            f"is out of rel32 reach (±2 GiB) from the slot at {slot:#x}",
            errno=errno.ERANGE,
        )
    moved = copy[:at] + struct.pack("<i", new_disp) + copy[at + 4 :]
    # Step 3: prove it: same instruction, same length, same absolute operand address.
    check = decode_raw(moved, slot)
    if (
        check.code != instr.code
        or check.len != length
        or check.ip_rel_memory_address != instr.ip_rel_memory_address
    ):
        raise InternalError(f"relocating `{copy.hex(' ')}` from {addr:#x} to {slot:#x} failed")
    return moved
