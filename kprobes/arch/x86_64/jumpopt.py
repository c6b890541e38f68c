"""Can a probe be jump-optimized, and which instructions does its jump displace?

An optimized probe replaces the int3 at ``A`` by a 5-byte ``jmp`` to a detour. The jump
overwrites whole instructions from ``A`` until at least 5 bytes are covered (the kernel's
"detoured code region", DCR); those instructions move into the detour, relocated, and the
detour jumps back to ``A + len`` (see detour.py). This module decides, from the function's
original bytes alone, whether that is safe, mirroring the kernel's ``can_optimize()`` and
``copy_optimized_instructions()`` (arch/x86/kernel/kprobes/opt.c) and the limits the Kprobes
document lists in its section on jump optimization:

a) The displaced instructions must run anywhere: each must fall through to the next (no call,
   ret, jump or syscall: the kernel's ``can_boost()``) and pass the out-of-line plan of plan.py.
   A rip-relative operand is fine; relocate_region() re-targets it and raises NotRelocatable
   (ERANGE) when the detour is out of its reach.
b) No call in the region: its return address would point into the detour, which a later unwind
   or an unoptimize would find, and which a return would run after the detour's bytes changed.
c) Nothing may jump into ``(A, A + len)``, the bytes that become the jump's displacement: so the
   whole function is decoded, and refused if any relative jump, jcc, loop or call in it targets
   that range, if it has an indirect jump (FF /4, FF /5: a jump table may go anywhere), or an
   int3 or undecodable bytes (we cannot see past them). Code outside the function that is known
   to enter it (gcc's ``foo.cold`` part, exception landing pads) is handed in by the caller.
d) The region lies inside the function (its ELF size): past the end may be another function.

A refusal is an answer, not a failure: the probe stays on the trap tier and ``list()`` shows
the reason, so it comes back as a Refusal value rather than an exception. The caller guarantees
original bytes (STYLE §6): an int3 of ours would read as "another debugger's breakpoint".

Rejected: checking only the 4 bytes after the int3 (the kernel's test covers
``[A+1, A+5]``, enough when the region is exactly 5 bytes); we refuse targets anywhere strictly
inside the region, since a jump to the middle of a displaced instruction is nonsense anyway and
the test costs nothing more. Jumping *to* ``A`` itself is fine: ``A`` holds the new ``jmp``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from kprobes.arch.x86_64.decode import MAX_INSN_LEN, format_instruction
from kprobes.arch.x86_64.encode import JMP_REL32_LEN, relocate_rip_relative
from kprobes.arch.x86_64.iced import (
    Code,
    Decoder,
    DecoderError,
    FlowControl,
    Instruction,
    Mnemonic,
    OpKind,
)
from kprobes.arch.x86_64.plan import plan_instruction
from kprobes.errors import InternalError, NotRelocatable
from kprobes.values import dataclass

_NEAR_BRANCH_KINDS: Final = frozenset(
    {OpKind.NEAR_BRANCH16, OpKind.NEAR_BRANCH32, OpKind.NEAR_BRANCH64}
)

# Why an instruction that does not fall through cannot be displaced, by iced's flow control.
_NOT_FALLING_THROUGH: Final = {
    FlowControl.UNCONDITIONAL_BRANCH: "a jump",
    FlowControl.CONDITIONAL_BRANCH: "a conditional jump",
    FlowControl.INDIRECT_BRANCH: "an indirect jump",
    FlowControl.RETURN: "a return",
    FlowControl.CALL: "a call",
    FlowControl.INDIRECT_CALL: "a call",
    FlowControl.INTERRUPT: "an interrupt",
    FlowControl.XBEGIN_XABORT_XEND: "a transaction (RTM)",
    FlowControl.EXCEPTION: "an instruction that raises an exception",
}


@dataclass(frozen=True, slots=True)
class Displaced:
    """One instruction the jump overwrites: its original address and bytes."""

    addr: int
    code: bytes
    text: str
    rip_relative: bool

    @property
    def length(self) -> int:
        return len(self.code)


@dataclass(frozen=True, slots=True)
class Region:
    """The optimizable region at ``addr``: the whole instructions the 5-byte jump covers."""

    addr: int
    insns: tuple[Displaced, ...]

    @property
    def length(self) -> int:
        return sum(insn.length for insn in self.insns)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(insn.length for insn in self.insns)

    @property
    def end(self) -> int:
        """Where the detour jumps back to: the first instruction after the region."""
        return self.addr + self.length

    @property
    def original(self) -> bytes:
        """The region's original bytes (unoptimizing writes back the first 5)."""
        return b"".join(insn.code for insn in self.insns)

    def contains(self, addr: int) -> bool:
        """Whether ``addr`` lies in the region (another probe there blocks optimization)."""
        return self.addr <= addr < self.end


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the probe at ``addr`` cannot be optimized: a short sentence for ``list()``."""

    addr: int
    reason: str


def find_region(
    code: bytes,
    func_start: int,
    addr: int,
    func_size: int,
    *,
    fragments: Sequence[tuple[int, bytes]] = (),
    entries: Iterable[int] = (),
) -> Region | Refusal:
    """The region a jump at ``addr`` would displace, or why there must be none.

    ``code`` holds the function's original bytes from ``func_start`` (at least ``func_size``
    of them). ``fragments`` are other pieces of the same function as (address, bytes), e.g.
    gcc's ``foo.cold``: they are scanned like the function. ``entries`` are addresses reached
    from elsewhere (exception landing pads). Raises InternalError when ``addr`` is not inside
    the function or ``code`` is short: the caller's bug, not a property of the site.
    """
    if func_size <= 0:
        return Refusal(addr, "the function's size is unknown")
    if not func_start <= addr < func_start + func_size:
        raise InternalError(
            f"{addr:#x} is not inside the function at {func_start:#x} ({func_size} bytes)"
        )
    if len(code) < func_size:
        raise InternalError(f"{len(code)} bytes given for a function of {func_size}")
    left = func_start + func_size - addr
    if left < JMP_REL32_LEN:
        return Refusal(addr, f"only {left} bytes to the function's end; the jump needs 5")

    # Step 1: decode the whole function (the kernel's can_optimize()).
    body = bytes(code[:func_size])
    decoded = _decode_all(body, func_start)
    if isinstance(decoded, str):
        return Refusal(addr, decoded)

    # Step 2: the region: whole instructions from addr until the jump fits.
    region = _region_insns(decoded, addr)
    if isinstance(region, str):
        return Refusal(addr, region)
    end = addr + sum(instr.len for instr in region)
    if end > func_start + func_size:
        return Refusal(addr, "the region would pass the function's end")

    # Step 3: nothing may enter the region but at addr.
    pieces = [decoded]
    for frag_start, frag_code in fragments:
        frag = _decode_all(bytes(frag_code), frag_start)
        if isinstance(frag, str):
            return Refusal(addr, f"{frag} (a fragment of the function)")
        pieces.append(frag)
    for piece in pieces:
        why = _scan(piece, addr, end)
        if why is not None:
            return Refusal(addr, why)
    for entry in entries:
        if addr < entry < end:
            return Refusal(addr, f"{entry:#x} inside the region is entered from elsewhere")

    # Step 4: each displaced instruction must run anywhere (copy_optimized_instructions()).
    insns: list[Displaced] = []
    for instr in region:
        offset = instr.ip - func_start
        raw = body[offset : offset + instr.len]
        why = _why_not_displaceable(instr, body[offset : offset + MAX_INSN_LEN])
        if why is not None:
            return Refusal(addr, why)
        insns.append(
            Displaced(instr.ip, raw, format_instruction(instr), instr.is_ip_rel_memory_operand)
        )
    return Region(addr, tuple(insns))


def relocate_region(region: Region, at: int) -> bytes:
    """The region's instructions rewritten to run from address ``at`` (inside a detour).

    Each keeps its length (encode.py rewrites the rip-relative disp32 in place), so the copy
    of the instruction at ``region.addr + k`` sits at ``at + k``. Raises NotRelocatable
    (ERANGE) when a rip-relative operand is out of rel32 reach of ``at``.
    """
    out = bytearray()
    for insn in region.insns:
        copy = relocate_rip_relative(insn.code, insn.addr, at + (insn.addr - region.addr))
        if len(copy) != insn.length:
            raise InternalError(f"relocating `{insn.text}` changed its length")
        out += copy
    return bytes(out)


def _decode_all(body: bytes, start: int) -> list[Instruction] | str:
    """Every instruction of ``body``, or why it does not decode to its end."""
    decoder = Decoder(64, body, ip=start)
    out: list[Instruction] = []
    for instr in decoder:
        if instr.code == Code.INVALID:
            if decoder.last_error == DecoderError.NO_MORE_BYTES:
                return f"the instruction at {instr.ip:#x} runs past the end of the function"
            return f"undecodable bytes at {instr.ip:#x}"
        out.append(instr)
    return out


def _region_insns(decoded: list[Instruction], addr: int) -> list[Instruction] | str:
    for i, instr in enumerate(decoded):
        if instr.ip == addr:
            region, covered = [], 0
            for insn in decoded[i:]:
                region.append(insn)
                covered += insn.len
                if covered >= JMP_REL32_LEN:
                    return region
            return "the region would pass the function's end"
        if instr.ip > addr:
            break
    return f"{addr:#x} is not an instruction boundary"


def _scan(decoded: list[Instruction], addr: int, end: int) -> str | None:
    """Why some instruction of ``decoded`` may enter ``(addr, end)``, or None."""
    for instr in decoded:
        if instr.flow_control == FlowControl.INDIRECT_BRANCH or instr.is_jmp_far_indirect:
            return f"indirect jump at {instr.ip:#x} (`{format_instruction(instr)}`)"
        if instr.mnemonic == Mnemonic.INT3:
            return f"int3 at {instr.ip:#x} in the function"
        if any(instr.op_kind(i) in _NEAR_BRANCH_KINDS for i in range(instr.op_count)):
            target = instr.near_branch_target
            if addr < target < end:
                return (
                    f"`{format_instruction(instr)}` at {instr.ip:#x} jumps into the region "
                    f"({target:#x})"
                )
    return None


def _why_not_displaceable(instr: Instruction, code: bytes) -> str | None:
    """Why ``instr`` (original bytes ``code``) cannot move into a detour, or None."""
    text = format_instruction(instr)
    try:
        plan_instruction(code, instr.ip, has_post_handler=False)
    except NotRelocatable as exc:
        why = exc.message.rsplit(": ", 1)[-1]
        return f"`{text}` at {instr.ip:#x} cannot run out of line: {why}"
    flow = instr.flow_control
    if flow == FlowControl.NEXT:
        return None
    if instr.code == Code.SYSCALL:
        kind = "a syscall"
    else:
        kind = _NOT_FALLING_THROUGH.get(flow, "an instruction that may change rip")
    return f"{kind} in the region (`{text}` at {instr.ip:#x})"
