"""Which out-of-line plan each class of instruction gets, and what the plan precomputes."""

from __future__ import annotations

import errno

import pytest

from kprobes.arch.x86_64.plan import MemOperand, Op, Plan, PlanKind, plan_instruction
from kprobes.errors import NotABoundary, NotRelocatable

A = 0x401000
PAD = b"\x90" * 16  # what follows the instruction in memory: never part of the plan


def plan(raw: str, *, post: bool = False, addr: int = A) -> Plan:
    return plan_instruction(bytes.fromhex(raw) + PAD, addr, has_post_handler=post)


# (bytes, iced text, op): emulated with or without a post handler.
EMULATED = [
    ("90", "nop", Op.NOP),
    ("66 90", "xchg ax, ax", Op.NOP),
    ("0f 1f 00", "nop [rax]", Op.NOP),
    ("0f 1f 44 00 00", "nop [rax+rax]", Op.NOP),
    ("66 2e 0f 1f 84 00 00 00 00 00", "nop [rax+rax]", Op.NOP),
    ("f3 0f 1e fa", "endbr64", Op.NOP),
    ("f3 0f 1e fb", "endbr32", Op.NOP),
    ("eb 10", "jmp 0x401012", Op.JMP),
    ("e9 00 01 00 00", "jmp 0x401105", Op.JMP),
    ("74 10", "je 0x401012", Op.JCC),
    ("0f 84 00 01 00 00", "je 0x401106", Op.JCC),
    ("e8 00 01 00 00", "call 0x401105", Op.CALL),
    ("f2 e8 00 01 00 00", "bnd call 0x401106", Op.CALL),
    ("ff 15 10 00 00 00", "call qword ptr [rip+0x10]", Op.CALL_INDIRECT),
    ("ff d0", "call rax", Op.CALL_INDIRECT),
    ("41 ff d3", "call r11", Op.CALL_INDIRECT),
    ("3e ff d0", "notrack call rax", Op.CALL_INDIRECT),
    ("41 ff 14 c4", "call qword ptr [r12+rax*8]", Op.CALL_INDIRECT),
    ("ff e0", "jmp rax", Op.JMP_INDIRECT),
    ("ff 25 10 00 00 00", "jmp qword ptr [rip+0x10]", Op.JMP_INDIRECT),
    ("c3", "ret", Op.RET),
    ("f3 c3", "rep ret", Op.RET),
    ("c2 08 00", "ret 8", Op.RET),
    ("55", "push rbp", Op.PUSH),
    ("41 54", "push r12", Op.PUSH),
    ("41 57", "push r15", Op.PUSH),
    ("54", "push rsp", Op.PUSH),
    ("48 89 e5", "mov rbp, rsp", Op.MOV_REG),
    ("48 8b ec", "mov rbp, rsp", Op.MOV_REG),
    ("89 e5", "mov ebp, esp", Op.MOV_REG),
    ("45 89 c1", "mov r9d, r8d", Op.MOV_REG),
    ("48 8d 05 10 00 00 00", "lea rax, [rip+0x10]", Op.LEA),
    ("48 8d 44 24 08", "lea rax, [rsp+8]", Op.LEA),
    ("8d 04 8b", "lea eax, [rbx+rcx*4]", Op.LEA),
    ("e2 f0", "loop 0x400ff2", Op.LOOP),
    ("e1 f0", "loope 0x400ff2", Op.LOOPE),
    ("e0 f0", "loopne 0x400ff2", Op.LOOPNE),
    ("e3 f0", "jrcxz 0x400ff2", Op.JRCXZ),
    ("67 e3 f0", "jecxz 0x400ff3", Op.JRCXZ),
]

# (bytes, iced text, rip-relative): instructions that only fall through.
FALL_THROUGH = [
    ("48 83 ec 10", "sub rsp, 0x10", False),
    ("8b 05 10 00 00 00", "mov eax, [rip+0x10]", True),
    ("48 89 05 10 00 00 00", "mov [rip+0x10], rax", True),
    ("83 3d 10 00 00 00 05", "cmp dword ptr [rip+0x10], 5", True),
    ("c5 f9 6f 05 10 00 00 00", "vmovdqa xmm0, [rip+0x10]", True),
    ("9c", "pushfq", False),
    ("9d", "popfq", False),
    ("5d", "pop rbp", False),
    ("c9", "leave", False),
    ("66 55", "push bp", False),  # 16-bit push: not the emulated push r64
    ("6a 01", "push 1", False),
    ("40 88 c6", "mov sil, al", False),
    ("67 8d 04 24", "lea eax, [esp]", False),  # 32-bit address size: not emulated
    ("f3 90", "pause", False),
    ("f3 48 a5", "rep movsq [rdi], [rsi]", False),
    ("f0 48 0f b1 0d 10 00 00 00", "lock cmpxchg [rip+0x10], rcx", True),
    ("64 48 8b 04 25 28 00 00 00", "mov rax, fs:[0x28]", False),
    ("0f 01 d5", "xend", False),
]

# (bytes, substring of the reason): never run out of line.
REFUSED = [
    ("cc", "already a breakpoint (another debugger, or a kernel uprobe of another tool?)"),
    ("cd 80", "software interrupt"),
    ("f1", "int1"),
    ("cb", "far return (lret)"),
    ("ca 08 00", "far return (lret)"),
    ("48 cf", "far return (iret)"),
    ("ff 1c 24", "far call"),
    ("ff 2c 24", "far jmp"),
    ("0f 34", "sysenter"),
    ("0f 35", "sysexit"),
    ("0f 07", "sysret"),
    ("c7 f8 00 01 00 00", "xbegin"),
    ("c6 f8 01", "xabort"),
    ("66 e8 00 01 00 00", "call we do not emulate"),
    ("67 ff 10", "call we do not emulate"),
    ("66 e9 00 01 00 00", "relative branch"),
    ("66 0f 84 00 01 00 00", "relative branch"),
    ("66 74 10", "relative branch"),
]


@pytest.mark.parametrize(("raw", "text", "op"), EMULATED)
@pytest.mark.parametrize("post", [False, True])
def test_emulated(raw: str, text: str, op: Op, post: bool) -> None:
    p = plan(raw, post=post)
    if op is Op.PUSH and not post:
        # the copy pushes for free: boosted, one stop and no stack write through /proc
        assert (p.kind, p.op, p.text) == (PlanKind.BOOST, None, text)
        return
    assert (p.kind, p.op, p.text) == (PlanKind.EMULATE, op, text)
    assert (p.addr, p.length) == (A, len(bytes.fromhex(raw)))
    assert p.reason == f"emulate {op.value}"
    assert not p.rip_relative


@pytest.mark.parametrize(("raw", "text", "rip_relative"), FALL_THROUGH)
def test_fall_through_boosts_without_post_handler(raw: str, text: str, rip_relative: bool) -> None:
    p = plan(raw)
    assert (p.kind, p.text, p.op, p.rip_relative) == (PlanKind.BOOST, text, None, rip_relative)
    assert p.reason.startswith("boost")
    assert p.length == len(bytes.fromhex(raw))


@pytest.mark.parametrize(("raw", "text", "rip_relative"), FALL_THROUGH)
def test_fall_through_steps_with_post_handler(raw: str, text: str, rip_relative: bool) -> None:
    p = plan(raw, post=True)
    assert (p.kind, p.text, p.rip_relative) == (PlanKind.STEP, text, rip_relative)
    assert p.reason.startswith("step")


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ("0f 05", "syscall"),
        ("0f 0b", "ud2"),
        ("66 c3", "ret"),  # 16-bit ret on AMD: let the CPU decide
        ("67 ff 20", "jmp qword ptr [eax]"),
        ("0f b9 05 10 00 00 00", "ud1 eax, [rip+0x10]"),
    ],
)
@pytest.mark.parametrize("post", [False, True])
def test_single_stepped(raw: str, text: str, post: bool) -> None:
    p = plan(raw, post=post)
    assert (p.kind, p.text, p.op) == (PlanKind.SINGLESTEP, text, None)
    assert p.rip_relative == ("rip" in text)


@pytest.mark.parametrize(("raw", "why"), REFUSED)
def test_refused(raw: str, why: str) -> None:
    with pytest.raises(NotRelocatable) as info:
        plan(raw)
    assert str(info.value).startswith("cannot probe `")
    assert "at 0x401000: " in str(info.value)
    assert why in str(info.value)
    assert info.value.errno == errno.EOPNOTSUPP


@pytest.mark.parametrize("raw", ["06", "ce", "0f 0f", "48 8b"])
def test_undecodable(raw: str) -> None:
    with pytest.raises(NotABoundary) as info:
        plan_instruction(bytes.fromhex(raw), A, has_post_handler=False)
    assert info.value.errno == errno.EILSEQ


@pytest.mark.parametrize("cond", range(16))
def test_jcc_condition_nibble_short_and_near(cond: int) -> None:
    short = plan(f"{0x70 + cond:02x} 10")
    near = plan(f"0f {0x80 + cond:02x} 00 01 00 00")
    assert (short.op, short.cond, short.target) == (Op.JCC, cond, A + 2 + 0x10)
    assert (near.op, near.cond, near.target) == (Op.JCC, cond, A + 6 + 0x100)


def test_branch_targets_are_absolute() -> None:
    assert plan("eb fe").target == A  # jmp $
    assert plan("e9 fb ff ff ff").target == A  # jmp $ (rel32 -5)
    assert plan("e8 00 00 00 00").target == A + 5  # call next
    assert plan("e2 fe").target == A


@pytest.mark.parametrize(
    ("raw", "fields"),
    [
        ("41 54", {"reg": "r12", "opsize": 8}),
        ("48 89 e5", {"reg": "rbp", "src": "rsp", "opsize": 8}),
        ("89 e5", {"reg": "rbp", "src": "rsp", "opsize": 4}),
        ("45 89 c1", {"reg": "r9", "src": "r8", "opsize": 4}),
        ("c2 08 00", {"imm": 8}),
        ("c3", {"imm": 0}),
        ("ff d0", {"reg": "rax", "mem": None}),
        ("e2 f0", {"opsize": 8}),
        ("67 e2 f0", {"op": Op.LOOP, "opsize": 4}),
        ("67 e3 f0", {"op": Op.JRCXZ, "opsize": 4}),
        ("8d 04 8b", {"reg": "rax", "opsize": 4}),
    ],
)
def test_precomputed_fields(raw: str, fields: dict[str, object]) -> None:
    p = plan(raw, post=True)
    assert {name: getattr(p, name) for name in fields} == fields


@pytest.mark.parametrize(
    ("raw", "mem"),
    [
        # rip-relative: the absolute address, no base
        ("ff 15 10 00 00 00", MemOperand(None, None, 1, A + 6 + 0x10, None, 8)),
        ("ff 25 f0 ff ff ff", MemOperand(None, None, 1, A + 6 - 0x10, None, 8)),
        ("41 ff 14 c4", MemOperand("r12", "rax", 8, 0, None, 8)),
        ("ff 54 24 f8", MemOperand("rsp", None, 1, -8, None, 8)),
        ("64 ff 14 25 28 00 00 00", MemOperand(None, None, 1, 0x28, "fs", 8)),
        ("65 ff 24 25 10 00 00 00", MemOperand(None, None, 1, 0x10, "gs", 8)),
        ("2e ff 10", MemOperand("rax", None, 1, 0, None, 8)),  # cs: base 0 in 64-bit mode
        ("48 8d 05 10 00 00 00", MemOperand(None, None, 1, A + 7 + 0x10, None, 0)),
        ("4a 8d 84 b3 00 01 00 00", MemOperand("rbx", "r14", 4, 0x100, None, 0)),
        ("64 48 8d 04 24", MemOperand("rsp", None, 1, 0, None, 0)),  # lea ignores the segment
    ],
)
def test_memory_operands(raw: str, mem: MemOperand) -> None:
    assert plan(raw).mem == mem


def test_plan_reads_only_its_instruction() -> None:
    p = plan_instruction(bytes.fromhex("48 83 ec 10 cc cc"), A, has_post_handler=False)
    assert (p.kind, p.length) == (PlanKind.BOOST, 4)
