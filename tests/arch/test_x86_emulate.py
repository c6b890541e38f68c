"""emulate(): before/after register tables against a dict-backed memory, from the bytes on."""

from __future__ import annotations

import itertools

import pytest

from kprobes.arch.x86_64.emulate import condition_holds, emulate
from kprobes.arch.x86_64.plan import Op, Plan, PlanKind, plan_instruction
from kprobes.arch.x86_64.regs import CF, OF, PF, SF, ZF, Regs
from kprobes.errors import InternalError

A = 0x401000
STACK = 0x7FFF_FFFF_E000
MASK64 = (1 << 64) - 1


class FakeMemory:
    """Byte-addressed memory; reading a byte never written raises, like a fault."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def read(self, addr: int, size: int) -> bytes:
        try:
            return bytes(self.bytes[addr + i] for i in range(size))
        except KeyError:
            raise OSError(f"fault reading {addr:#x}") from None

    def write(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.bytes[addr + i] = b

    def put64(self, addr: int, value: int) -> None:
        self.write(addr, (value & MASK64).to_bytes(8, "little"))

    def get64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")


class ReadOnlyMemory(FakeMemory):
    def write(self, addr: int, data: bytes) -> None:
        raise OSError(f"fault writing {addr:#x}")


def make_regs(**values: int) -> Regs:
    regs = Regs()
    regs.set("rip", A)
    regs.set("rsp", STACK)
    for name, value in values.items():
        regs.set(name, value)
    return regs


def run(raw: str, mem: FakeMemory | None = None, **values: int) -> tuple[Regs, FakeMemory, Plan]:
    plan = plan_instruction(bytes.fromhex(raw), A, has_post_handler=True)
    assert plan.kind is PlanKind.EMULATE
    regs = make_regs(**values)
    mem = FakeMemory() if mem is None else mem
    emulate(plan, regs, mem)
    return regs, mem, plan


def changed(regs: Regs, **before: int) -> dict[str, int]:
    """The registers whose value differs from make_regs(**before)."""
    base = make_regs(**before).as_dict()
    return {k: v for k, v in regs.as_dict().items() if base[k] != v}


# ---- straight-line ops --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw", ["90", "0f 1f 44 00 00", "f3 0f 1e fa", "66 2e 0f 1f 84 00 00 00 00 00"]
)
def test_nop(raw: str) -> None:
    regs, mem, _ = run(raw)
    assert changed(regs) == {"rip": A + len(bytes.fromhex(raw))}
    assert mem.bytes == {}


@pytest.mark.parametrize(("raw", "reg"), [("55", "rbp"), ("41 54", "r12"), ("41 57", "r15")])
def test_push(raw: str, reg: str) -> None:
    regs, mem, _ = run(raw, **{reg: 0x1122_3344_5566_7788})
    assert changed(regs, **{reg: 0x1122_3344_5566_7788}) == {
        "rip": A + len(bytes.fromhex(raw)),
        "rsp": STACK - 8,
    }
    assert mem.get64(STACK - 8) == 0x1122_3344_5566_7788


def test_push_rsp_pushes_the_old_value() -> None:
    regs, mem, _ = run("54")
    assert regs.rsp == STACK - 8
    assert mem.get64(STACK - 8) == STACK


@pytest.mark.parametrize(
    ("raw", "before", "after"),
    [
        ("48 89 e5", {"rbp": 1}, {"rbp": STACK}),  # mov rbp, rsp
        ("48 8b ec", {"rbp": 1}, {"rbp": STACK}),  # mov rbp, rsp (8B form)
        ("4c 89 c7", {"r8": MASK64, "rdi": 0}, {"rdi": MASK64}),  # mov rdi, r8
        # 32-bit moves zero-extend: the upper half of the destination is cleared
        ("89 c7", {"rax": 0xDEAD_BEEF_8000_0001, "rdi": MASK64}, {"rdi": 0x8000_0001}),
        ("45 89 c1", {"r8": 0xFFFF_FFFF_FFFF_FFFF, "r9": 5}, {"r9": 0xFFFF_FFFF}),
        ("89 c0", {"rax": 0x1_0000_0002}, {"rax": 2}),  # mov eax, eax
        ("48 89 ec", {"rbp": 0x1000}, {"rsp": 0x1000}),  # mov rsp, rbp
    ],
)
def test_mov_reg(raw: str, before: dict[str, int], after: dict[str, int]) -> None:
    regs, mem, _ = run(raw, **before)
    assert changed(regs, **before) == after | {"rip": A + len(bytes.fromhex(raw))}
    assert mem.bytes == {}


@pytest.mark.parametrize(
    ("raw", "before", "after"),
    [
        # lea rax, [rbx+rcx*4+0x10]
        ("48 8d 44 8b 10", {"rbx": 0x1000, "rcx": 3}, {"rax": 0x1000 + 12 + 0x10}),
        # lea rdx, [rbx+r14*8-0x8]
        ("4a 8d 54 f3 f8", {"rbx": 0x1000, "r14": 2}, {"rdx": 0x1000 + 16 - 8}),
        # lea rax, [rsp+8]
        ("48 8d 44 24 08", {}, {"rax": STACK + 8}),
        # lea rax, [rip+0x10]: the absolute address of the original site
        ("48 8d 05 10 00 00 00", {}, {"rax": A + 7 + 0x10}),
        # lea eax, [rbx+rcx*4]: 32-bit result, zero-extended
        ("8d 04 8b", {"rbx": 0x1_FFFF_FFFF, "rcx": 1, "rax": MASK64}, {"rax": 0x3}),
        # lea rax, [rax-1] wraps around
        ("48 8d 40 ff", {"rax": 0}, {"rax": MASK64}),
        # lea rax, fs:[rsp]: lea ignores the segment
        ("64 48 8d 04 24", {"fs_base": 0x7000_0000}, {"rax": STACK}),
    ],
)
def test_lea(raw: str, before: dict[str, int], after: dict[str, int]) -> None:
    regs, mem, _ = run(raw, **before)
    assert changed(regs, **before) == after | {"rip": A + len(bytes.fromhex(raw))}
    assert mem.bytes == {}


# ---- branches -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "target"),
    [("eb 10", A + 2 + 0x10), ("eb fe", A), ("e9 00 01 00 00", A + 5 + 0x100)],
)
def test_jmp(raw: str, target: int) -> None:
    regs, _, _ = run(raw)
    assert regs.rip == target
    assert changed(regs).keys() <= {"rip"}


# The SDM's definitions of the sixteen conditions, in terms of named flags.
SDM_CONDITIONS = {
    "o": lambda cf, pf, zf, sf, of: of,
    "no": lambda cf, pf, zf, sf, of: not of,
    "b": lambda cf, pf, zf, sf, of: cf,
    "ae": lambda cf, pf, zf, sf, of: not cf,
    "e": lambda cf, pf, zf, sf, of: zf,
    "ne": lambda cf, pf, zf, sf, of: not zf,
    "be": lambda cf, pf, zf, sf, of: cf or zf,
    "a": lambda cf, pf, zf, sf, of: not cf and not zf,
    "s": lambda cf, pf, zf, sf, of: sf,
    "ns": lambda cf, pf, zf, sf, of: not sf,
    "p": lambda cf, pf, zf, sf, of: pf,
    "np": lambda cf, pf, zf, sf, of: not pf,
    "l": lambda cf, pf, zf, sf, of: sf != of,
    "ge": lambda cf, pf, zf, sf, of: sf == of,
    "le": lambda cf, pf, zf, sf, of: zf or sf != of,
    "g": lambda cf, pf, zf, sf, of: not zf and sf == of,
}
FLAG_COMBOS = list(itertools.product([False, True], repeat=5))


def eflags_of(cf: bool, pf: bool, zf: bool, sf: bool, of: bool) -> int:
    # bit 1 is always set; IF as a user process has it
    return 0x202 | cf * CF | pf * PF | zf * ZF | sf * SF | of * OF


@pytest.mark.parametrize(("cond", "name"), list(enumerate(SDM_CONDITIONS)))
@pytest.mark.parametrize("form", ["short", "near"])
def test_jcc_all_conditions(cond: int, name: str, form: str) -> None:
    raw = f"{0x70 + cond:02x} 10" if form == "short" else f"0f {0x80 + cond:02x} 00 01 00 00"
    length = len(bytes.fromhex(raw))
    target = A + length + (0x10 if form == "short" else 0x100)
    plan = plan_instruction(bytes.fromhex(raw), A, has_post_handler=True)
    assert plan.text.startswith(f"j{name} ")
    for flags in FLAG_COMBOS:
        regs = make_regs(eflags=eflags_of(*flags))
        emulate(plan, regs, FakeMemory())
        expected = target if SDM_CONDITIONS[name](*flags) else A + length
        assert regs.rip == expected, (name, flags)
        assert changed(regs, eflags=eflags_of(*flags)).keys() <= {"rip"}


def test_condition_holds_matches_the_sdm() -> None:
    for cond, name in enumerate(SDM_CONDITIONS):
        for flags in FLAG_COMBOS:
            assert condition_holds(cond, eflags_of(*flags)) == SDM_CONDITIONS[name](*flags)


def test_call_rel32_pushes_the_return_address() -> None:
    regs, mem, _ = run("e8 00 01 00 00")
    assert changed(regs) == {"rip": A + 5 + 0x100, "rsp": STACK - 8}
    assert mem.get64(STACK - 8) == A + 5


@pytest.mark.parametrize(
    ("raw", "before", "memory", "target"),
    [
        ("ff d0", {"rax": 0x402000}, {}, 0x402000),  # call rax
        ("41 ff d3", {"r11": 0x402000}, {}, 0x402000),  # call r11
        # call qword ptr [rip+0x10]: through the GOT slot at A+6+0x10
        ("ff 15 10 00 00 00", {}, {A + 6 + 0x10: 0x7F00_1234_5678}, 0x7F00_1234_5678),
        # call qword ptr [r12+rax*8]
        ("41 ff 14 c4", {"r12": 0x600000, "rax": 3}, {0x600018: 0x403000}, 0x403000),
        # call qword ptr fs:[0x28]
        (
            "64 ff 14 25 28 00 00 00",
            {"fs_base": 0x7F00_0000_0000},
            {0x7F00_0000_0028: 0x404000},
            0x404000,
        ),
        # call qword ptr [rsp]: read before the push moves rsp
        ("ff 14 24", {}, {STACK: 0x405000}, 0x405000),
    ],
)
def test_call_indirect(
    raw: str, before: dict[str, int], memory: dict[int, int], target: int
) -> None:
    mem = FakeMemory()
    for addr, value in memory.items():
        mem.put64(addr, value)
    regs, mem, _ = run(raw, mem, **before)
    assert changed(regs, **before) == {"rip": target, "rsp": STACK - 8}
    assert mem.get64(STACK - 8) == A + len(bytes.fromhex(raw))


def test_call_rsp_uses_the_old_rsp() -> None:
    regs, mem, _ = run("ff d4")  # call rsp
    assert regs.rip == STACK
    assert mem.get64(STACK - 8) == A + 2


@pytest.mark.parametrize(
    ("raw", "before", "memory", "target"),
    [
        ("ff e0", {"rax": 0x402000}, {}, 0x402000),  # jmp rax
        ("ff 25 10 00 00 00", {}, {A + 6 + 0x10: 0x7F00_0000_1000}, 0x7F00_0000_1000),
        ("65 ff 24 25 10 00 00 00", {"gs_base": 0x5000_0000}, {0x5000_0010: 0x406000}, 0x406000),
        # notrack jmp qword ptr [rdx+rax*8+0x40] (a switch table)
        ("3e ff 64 c2 40", {"rdx": 0x600000, "rax": 2}, {0x600050: 0x407000}, 0x407000),
    ],
)
def test_jmp_indirect(
    raw: str, before: dict[str, int], memory: dict[int, int], target: int
) -> None:
    mem = FakeMemory()
    for addr, value in memory.items():
        mem.put64(addr, value)
    regs, mem, _ = run(raw, mem, **before)
    assert changed(regs, **before) == {"rip": target}


@pytest.mark.parametrize(
    ("raw", "popped"), [("c3", 8), ("f3 c3", 8), ("c2 08 00", 16), ("c2 00 01", 8 + 256)]
)
def test_ret(raw: str, popped: int) -> None:
    mem = FakeMemory()
    mem.put64(STACK, 0x401234)
    regs, _, _ = run(raw, mem)
    assert changed(regs) == {"rip": 0x401234, "rsp": STACK + popped}


# ---- rcx-counted branches ---------------------------------------------------------------------

LOOP_TARGET = A + 2 - 0x10


@pytest.mark.parametrize(
    ("raw", "before", "after"),
    [
        # loop: decrement rcx first, then jump if it is not zero
        ("e2 f0", {"rcx": 1}, {"rcx": 0, "rip": A + 2}),
        ("e2 f0", {"rcx": 2}, {"rcx": 1, "rip": LOOP_TARGET}),
        ("e2 f0", {"rcx": 0}, {"rcx": MASK64, "rip": LOOP_TARGET}),
        # addr32 loop: ecx, and the write zero-extends into rcx (checked on hardware)
        ("67 e2 f0", {"rcx": 0x1_0000_0005}, {"rcx": 4, "rip": A + 3 - 0x10}),
        ("67 e2 f0", {"rcx": 0x1_0000_0001}, {"rcx": 0, "rip": A + 3}),
        # loope: count != 0 and ZF
        ("e1 f0", {"rcx": 2, "eflags": 0x202 | ZF}, {"rcx": 1, "rip": LOOP_TARGET}),
        ("e1 f0", {"rcx": 2, "eflags": 0x202}, {"rcx": 1, "rip": A + 2}),
        ("e1 f0", {"rcx": 1, "eflags": 0x202 | ZF}, {"rcx": 0, "rip": A + 2}),
        # loopne: count != 0 and not ZF
        ("e0 f0", {"rcx": 2, "eflags": 0x202}, {"rcx": 1, "rip": LOOP_TARGET}),
        ("e0 f0", {"rcx": 2, "eflags": 0x202 | ZF}, {"rcx": 1, "rip": A + 2}),
        ("e0 f0", {"rcx": 1, "eflags": 0x202}, {"rcx": 0, "rip": A + 2}),
        # jrcxz / jecxz: test only, no decrement
        ("e3 f0", {"rcx": 0}, {"rip": LOOP_TARGET}),
        ("e3 f0", {"rcx": 1}, {"rip": A + 2}),
        ("e3 f0", {"rcx": 0x1_0000_0000}, {"rip": A + 2}),
        ("67 e3 f0", {"rcx": 0x1_0000_0000}, {"rip": A + 3 - 0x10}),
        ("67 e3 f0", {"rcx": 1}, {"rip": A + 3}),
    ],
)
def test_loops(raw: str, before: dict[str, int], after: dict[str, int]) -> None:
    regs, mem, _ = run(raw, **before)
    assert changed(regs, **before) == after
    assert mem.bytes == {}


# ---- failure behaviour ------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["55", "e8 00 01 00 00", "ff d0"])
def test_a_faulting_push_leaves_registers_alone(raw: str) -> None:
    plan = plan_instruction(bytes.fromhex(raw), A, has_post_handler=True)
    regs = make_regs(rax=0x402000)
    before = regs.as_dict()
    with pytest.raises(OSError):
        emulate(plan, regs, ReadOnlyMemory())
    assert regs.as_dict() == before


@pytest.mark.parametrize("raw", ["c3", "ff 25 10 00 00 00"])
def test_a_faulting_load_leaves_registers_alone(raw: str) -> None:
    plan = plan_instruction(bytes.fromhex(raw), A, has_post_handler=True)
    regs = make_regs()
    before = regs.as_dict()
    with pytest.raises(OSError):
        emulate(plan, regs, FakeMemory())
    assert regs.as_dict() == before


@pytest.mark.parametrize("raw", ["48 83 ec 10", "0f 05"])
def test_only_emulate_plans_are_emulated(raw: str) -> None:
    plan = plan_instruction(bytes.fromhex(raw), A, has_post_handler=True)
    with pytest.raises(InternalError):
        emulate(plan, make_regs(), FakeMemory())


EVERY_OP = [
    "90", "eb 00", "74 00", "e8 00 00 00 00", "ff d0", "ff e0", "c3",
    "55", "48 89 e5", "48 8d 00", "e2 00", "e1 00", "e0 00", "e3 00",
]  # fmt: skip


def test_every_op_is_emulated() -> None:
    plans = [plan_instruction(bytes.fromhex(raw), A, has_post_handler=True) for raw in EVERY_OP]
    assert {plan.op for plan in plans} == set(Op)
    for plan in plans:
        mem = FakeMemory()
        mem.put64(STACK, 0x1234)
        regs = make_regs(rax=0x402000, rip=0)
        emulate(plan, regs, mem)
        assert regs.rip != 0
