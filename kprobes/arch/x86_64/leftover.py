"""A jump left at a probe site by a kprobes that died (SIGKILL), and the bytes it covers.

A tool killed while it had optimized probes leaves their jumps: harmless as such (the detour
counts or records into memory nobody reads and runs the displaced instructions). But the next
tool that probes the same site would take the ``jmp`` for the program's code and put its int3
over the ``0xE9``; the int3's next byte is then the middle of the jump, which a thread resumes
at if that tool dies in turn right after reaping the trap. So a site that starts with a jump
into one of our detours is given its original bytes back first.

A detour is recognised by its first instruction (``lea rsp, [rsp-128]``, the red-zone step of
every detour, detour.py) and its last, a ``jmp`` back to ``A + len`` for a region of 5 to 20
bytes; the ``len`` bytes before that ``jmp`` are the displaced instructions, relocated: a
rip-relative operand is encoded again at its original address (the same target, the same
length) to give the original bytes. A displaced branch, or anything that does not decode back
to ``len`` bytes, takes nothing back: the site is probed as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kprobes.arch.x86_64.detour import DETOUR_MAX
from kprobes.arch.x86_64.iced import Decoder, Encoder, FlowControl, OpKind

_RED_ZONE_STEP: Final = bytes.fromhex("488d642480")  # lea rsp, [rsp-0x80]
_JMP_REL32: Final = 0xE9
_REGION_MAX: Final = 20


def original_under_jump(addr: int, head: bytes, read: Callable[[int, int], bytes]) -> bytes | None:
    """The 5 original bytes at ``addr`` if ``head`` (the 5 bytes there now) is a jump into a
    detour of ours, else None. ``read(at, n)`` reads up to ``n`` bytes of the program."""
    if len(head) < 5 or head[0] != _JMP_REL32:
        return None
    target = (addr + 5 + int.from_bytes(head[1:5], "little", signed=True)) & (2**64 - 1)
    try:
        code = read(target, DETOUR_MAX)
    except OSError:
        return None
    if not code.startswith(_RED_ZONE_STEP):
        return None
    for insn in Decoder(64, code, ip=target):
        if insn.is_invalid:
            return None
        if (
            insn.flow_control != FlowControl.UNCONDITIONAL_BRANCH
            or insn.op0_kind != OpKind.NEAR_BRANCH64
        ):
            continue
        length = insn.near_branch_target - addr
        if not 5 <= length <= _REGION_MAX or insn.len != 5:
            continue
        start = insn.ip - length - target
        if start < len(_RED_ZONE_STEP):
            return None
        copy = code[start : start + length]
        out = b""
        for displaced in Decoder(64, copy, ip=target + start):
            if displaced.is_invalid or displaced.flow_control != FlowControl.NEXT:
                return None  # a relocated branch: not the original bytes
            if displaced.is_ip_rel_memory_operand:
                encoder = Encoder(64)
                try:
                    encoder.encode(displaced, addr + len(out))
                except ValueError:
                    return None
                again = bytes(encoder.take_buffer())
                if len(again) != displaced.len:
                    return None
                out += again
            else:
                out += copy[len(out) : len(out) + displaced.len]
        return out[:5] if len(out) == length else None
    return None
