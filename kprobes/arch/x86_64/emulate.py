"""Applying an EMULATE plan: the instruction's architectural effect, computed by the tracer.

This runs on every hit of an emulated probe, between two ptrace calls, so it does no decoding
and no allocation beyond the integers it computes: ``plan_instruction()`` has already turned
the instruction into an ``Op`` with its registers named, its branch target absolute and its
memory operand split into parts. Dispatch is one dict lookup.

Semantics follow the SDM, not the kernel's copies where they differ (the kernel's loop
emulation tests rcx before decrementing; the CPU decrements first). Every read from the
target happens before the first register is written, and the one stack write (call, push)
before rsp moves: if the Memory raises (the target's stack is bad), the registers are as they
were, and the caller can deliver the fault at the probed address as the CPU would have.

None of the emulated instructions reads or changes a flag other than through ``eflags`` tests
(jcc, loope/loopne), so flags are never written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol

from kprobes.arch.x86_64.plan import MemOperand, Op, Plan, PlanKind
from kprobes.arch.x86_64.regs import CF, OF, PF, REG_INDEX, SF, ZF, Regs
from kprobes.errors import InternalError

_MASK64: Final = (1 << 64) - 1
_MASK32: Final = (1 << 32) - 1
_EMULATE: Final = PlanKind.EMULATE  # Enum class attribute lookup costs 70 ns per hit


class Memory(Protocol):
    """The target's memory. ``read`` returns exactly ``size`` bytes or raises."""

    def read(self, addr: int, size: int) -> bytes: ...

    def write(self, addr: int, data: bytes) -> None: ...


# Word indexes in the register view (Regs.words); emulation runs on every hit, so it reads and
# writes words directly instead of going through attribute descriptors.
_RIP: Final = REG_INDEX["rip"]
_RSP: Final = REG_INDEX["rsp"]
_RCX: Final = REG_INDEX["rcx"]
_EFLAGS: Final = REG_INDEX["eflags"]
_FS_BASE: Final = REG_INDEX["fs_base"]
_GS_BASE: Final = REG_INDEX["gs_base"]


def _address(m: MemOperand, w: memoryview) -> int:
    """The effective (linear) address of ``m``."""
    ea = m.disp
    if m.base is not None:
        ea += w[REG_INDEX[m.base]]
    if m.index is not None:
        ea += w[REG_INDEX[m.index]] * m.scale
    if m.segment is not None:
        ea += w[_FS_BASE] if m.segment == "fs" else w[_GS_BASE]
    return ea & _MASK64


def _load64(mem: Memory, addr: int) -> int:
    return int.from_bytes(mem.read(addr, 8), "little")


def _branch_source(p: Plan, w: memoryview, mem: Memory) -> int:
    """The target of an indirect call/jmp: a register, or a qword in memory."""
    if p.reg is not None:
        return int(w[REG_INDEX[p.reg]])
    assert p.mem is not None, "plan_instruction gives an indirect branch a reg or a mem"
    return _load64(mem, _address(p.mem, w))


def _push(w: memoryview, mem: Memory, value: int) -> None:
    sp = (w[_RSP] - 8) & _MASK64
    mem.write(sp, value.to_bytes(8, "little"))
    w[_RSP] = sp


# The eight base conditions of jcc, indexed by cond >> 1; an odd cond negates
# (70/71 o, 72/73 b, 74/75 e, 76/77 be, 78/79 s, 7A/7B p, 7C/7D l, 7E/7F le).
_BASE_CONDITIONS: Final[tuple[Callable[[int], bool], ...]] = (
    lambda f: f & OF != 0,
    lambda f: f & CF != 0,
    lambda f: f & ZF != 0,
    lambda f: f & (CF | ZF) != 0,
    lambda f: f & SF != 0,
    lambda f: f & PF != 0,
    lambda f: (f & SF != 0) != (f & OF != 0),
    lambda f: f & ZF != 0 or (f & SF != 0) != (f & OF != 0),
)


def condition_holds(cond: int, eflags: int) -> bool:
    """Whether jcc with condition nibble ``cond`` (0..15, as in 0x70+cond) jumps."""
    return _BASE_CONDITIONS[cond >> 1](eflags) != bool(cond & 1)


def _nop(p: Plan, w: memoryview, mem: Memory) -> None:
    w[_RIP] = p.addr + p.length


def _jmp(p: Plan, w: memoryview, mem: Memory) -> None:
    w[_RIP] = p.target


def _jcc(p: Plan, w: memoryview, mem: Memory) -> None:
    taken = _BASE_CONDITIONS[p.cond >> 1](w[_EFLAGS]) != bool(p.cond & 1)
    w[_RIP] = p.target if taken else p.addr + p.length


def _call(p: Plan, w: memoryview, mem: Memory) -> None:
    _push(w, mem, p.addr + p.length)
    w[_RIP] = p.target


def _call_indirect(p: Plan, w: memoryview, mem: Memory) -> None:
    # The target is read before the push: `call [rsp]` and `call rsp` use the old rsp.
    target = _branch_source(p, w, mem)
    _push(w, mem, p.addr + p.length)
    w[_RIP] = target & _MASK64


def _jmp_indirect(p: Plan, w: memoryview, mem: Memory) -> None:
    w[_RIP] = _branch_source(p, w, mem) & _MASK64


def _ret(p: Plan, w: memoryview, mem: Memory) -> None:
    sp = w[_RSP]
    target = _load64(mem, sp)
    w[_RSP] = (sp + 8 + p.imm) & _MASK64
    w[_RIP] = target


def _push_reg(p: Plan, w: memoryview, mem: Memory) -> None:
    # `push rsp` pushes the value rsp had before the instruction.
    assert p.reg is not None, "plan_instruction names the pushed register"
    _push(w, mem, w[REG_INDEX[p.reg]])
    w[_RIP] = p.addr + p.length


def _mov_reg(p: Plan, w: memoryview, mem: Memory) -> None:
    assert p.reg is not None and p.src is not None, "plan_instruction names both registers"
    value = w[REG_INDEX[p.src]]
    # A 32-bit destination zero-extends into the whole register.
    w[REG_INDEX[p.reg]] = value if p.opsize == 8 else value & _MASK32
    w[_RIP] = p.addr + p.length


def _lea(p: Plan, w: memoryview, mem: Memory) -> None:
    assert p.reg is not None and p.mem is not None, "plan_instruction gives lea a reg and a mem"
    value = _address(p.mem, w)
    w[REG_INDEX[p.reg]] = value if p.opsize == 8 else value & _MASK32
    w[_RIP] = p.addr + p.length


def _decrement_counter(p: Plan, w: memoryview) -> int:
    """rcx (or ecx, opsize 4) minus one, written back; a 32-bit write zero-extends (as the CPU
    does for ``addr32 loop``)."""
    count = (w[_RCX] - 1) & (_MASK64 if p.opsize == 8 else _MASK32)
    w[_RCX] = count
    return int(count)


def _loop(p: Plan, w: memoryview, mem: Memory) -> None:
    taken = _decrement_counter(p, w) != 0
    w[_RIP] = p.target if taken else p.addr + p.length


def _loope(p: Plan, w: memoryview, mem: Memory) -> None:
    taken = _decrement_counter(p, w) != 0 and w[_EFLAGS] & ZF != 0
    w[_RIP] = p.target if taken else p.addr + p.length


def _loopne(p: Plan, w: memoryview, mem: Memory) -> None:
    taken = _decrement_counter(p, w) != 0 and w[_EFLAGS] & ZF == 0
    w[_RIP] = p.target if taken else p.addr + p.length


def _jrcxz(p: Plan, w: memoryview, mem: Memory) -> None:
    # No decrement: jrcxz/jecxz only test the counter.
    taken = w[_RCX] & (_MASK64 if p.opsize == 8 else _MASK32) == 0
    w[_RIP] = p.target if taken else p.addr + p.length


_HANDLERS: Final[dict[Op, Callable[[Plan, memoryview, Memory], None]]] = {
    Op.NOP: _nop,
    Op.JMP: _jmp,
    Op.JCC: _jcc,
    Op.CALL: _call,
    Op.CALL_INDIRECT: _call_indirect,
    Op.JMP_INDIRECT: _jmp_indirect,
    Op.RET: _ret,
    Op.PUSH: _push_reg,
    Op.MOV_REG: _mov_reg,
    Op.LEA: _lea,
    Op.LOOP: _loop,
    Op.LOOPE: _loope,
    Op.LOOPNE: _loopne,
    Op.JRCXZ: _jrcxz,
}


# Emulations that change rip and nothing else (no other register, no memory): the tracer can
# write rip back alone, with one PTRACE_POKEUSER instead of a whole PTRACE_SETREGS.
_RIP_ONLY: Final = frozenset({Op.NOP, Op.JMP, Op.JCC, Op.JMP_INDIRECT, Op.JRCXZ})


def changes_rip_only(plan: Plan) -> bool:
    """Whether emulating ``plan`` writes rip alone (``endbr64``, ``nop``, jumps)."""
    return plan.kind is _EMULATE and plan.op in _RIP_ONLY


def emulate(plan: Plan, regs: Regs, mem: Memory) -> None:
    """Apply ``plan``'s instruction to ``regs`` (and the stack through ``mem``), rip included."""
    if plan.kind is not _EMULATE or plan.op is None:
        raise InternalError(f"`{plan.text}` at {plan.addr:#x} has no emulation ({plan.kind.value})")
    _HANDLERS[plan.op](plan, regs.words, mem)
    regs.dirty = True


Emulator = Callable[[memoryview, Memory], None]


def emulator_for(plan: Plan) -> Emulator:
    """A callable applying ``plan`` to the register words, specialised once at registration.

    The usual first instructions of a function (push, mov, lea, nop, endbr64) get closures with
    every register index and constant folded in, so a hit pays one call and a few word
    accesses; the rest go through the generic handlers.
    """
    if plan.kind is not _EMULATE or plan.op is None:
        raise InternalError(f"`{plan.text}` at {plan.addr:#x} has no emulation ({plan.kind.value})")
    nxt = plan.addr + plan.length
    op = plan.op
    if op is Op.NOP:

        def nop(w: memoryview, mem: Memory) -> None:
            w[_RIP] = nxt

        return nop
    if op is Op.PUSH and plan.reg is not None:
        src = REG_INDEX[plan.reg]

        def push(w: memoryview, mem: Memory) -> None:
            sp = (w[_RSP] - 8) & _MASK64
            mem.write(sp, w[src].to_bytes(8, "little"))
            w[_RSP] = sp
            w[_RIP] = nxt

        return push
    if op is Op.MOV_REG and plan.reg is not None and plan.src is not None:
        dst, src = REG_INDEX[plan.reg], REG_INDEX[plan.src]
        mask = _MASK64 if plan.opsize == 8 else _MASK32

        def mov(w: memoryview, mem: Memory) -> None:
            w[dst] = w[src] & mask
            w[_RIP] = nxt

        return mov
    m = plan.mem
    if op is Op.LEA and plan.reg is not None and m is not None and m.segment is None:
        dst = REG_INDEX[plan.reg]
        mask = _MASK64 if plan.opsize == 8 else _MASK32
        disp, scale = m.disp, m.scale
        base = REG_INDEX[m.base] if m.base is not None else None
        index = REG_INDEX[m.index] if m.index is not None else None
        if base is not None and index is not None:

            def lea_bi(w: memoryview, mem: Memory) -> None:
                w[dst] = (w[base] + w[index] * scale + disp) & mask
                w[_RIP] = nxt

            return lea_bi
        if base is not None:

            def lea_b(w: memoryview, mem: Memory) -> None:
                w[dst] = (w[base] + disp) & mask
                w[_RIP] = nxt

            return lea_b
    handler = _HANDLERS[op]

    def generic(w: memoryview, mem: Memory) -> None:
        handler(plan, w, mem)

    return generic
