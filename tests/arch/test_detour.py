"""Detour machine code, bytes out: the template around each action, the actions, the patch,
and every refusal to build one out of reach. (tests/arch/test_detour_live.py runs them.)

The listings below are the specification: each line is the encoding and its Intel text, with
rip-relative operands shown as the absolute address they reach.
"""

from __future__ import annotations

import errno

import pytest
from iced_x86 import (
    Code,
    Decoder,
    Formatter,
    FormatterSyntax,
    Instruction,
    Mnemonic,
    OpKind,
    Register,
)

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.abi import RED_ZONE
from kprobes.arch.x86_64.capture import Bytes, CapturePlan, Reg, String, Value, Word
from kprobes.arch.x86_64.detour import (
    ARITH,
    DETOUR_MAX,
    EFLAGS,
    Block,
    CountAction,
    Detour,
    FlagsSave,
    Frame,
    build_detour,
)
from kprobes.arch.x86_64.jumpopt import Region, find_region
from kprobes.arch.x86_64.record import CpuId, RecordAction, ThreadId
from kprobes.errors import InternalError, NotRelocatable

A = 0x401000
D = 0x402000
GIB = 1 << 30
COUNTER = 0x500040
AREA = 0x600000
LAYOUT = sa.AreaLayout(ncounters=4, capacity=1024)

# push rbp; mov rbp, rsp; sub rsp, 16; mov rax, [rip+0x1000]; leave; ret
FP_PROLOGUE = bytes.fromhex("55 4889e5 4883ec10 488b0500100000 c9 c3")
# endbr64; mov rax, [rip+0x2ff9]; imul rax, rdi; ret
ENDBR_RIP = bytes.fromhex("f30f1efa 488b05f92f0000 480fafc7 c3")


def formatter() -> Formatter:
    f = Formatter(FormatterSyntax.INTEL)
    f.space_after_operand_separator = True
    f.hex_prefix = "0x"
    f.hex_suffix = ""
    f.uppercase_hex = False
    f.show_branch_size = False
    f.branch_leading_zeros = False
    f.leading_zeros = False
    return f


FORMATTER = formatter()


def listing(code: bytes, at: int) -> list[tuple[str, str]]:
    return [
        (code[i.ip - at : i.ip - at + i.len].hex(" "), FORMATTER.format(i))
        for i in Decoder(64, code, ip=at)
    ]


def region_of(code: bytes, addr: int = A) -> Region:
    got = find_region(code, addr, addr, len(code))
    assert isinstance(got, Region), got
    return got


COUNT_LAHF = [
    ("48 8d 64 24 80", "lea rsp, [rsp-0x80]"),
    ("50", "push rax"),
    ("0f 90 c0", "seto al"),
    ("9f", "lahf"),
    ("f0 48 ff 05 2e e0 0f 00", "lock inc qword ptr [0x500040]"),
    ("80 c0 7f", "add al, 0x7f"),
    ("9e", "sahf"),
    ("58", "pop rax"),
    ("48 8d a4 24 80 00 00 00", "lea rsp, [rsp+0x80]"),
    ("55", "push rbp"),
    ("48 89 e5", "mov rbp, rsp"),
    ("48 83 ec 10", "sub rsp, 0x10"),
    ("e9 dc ef ff ff", "jmp 0x401008"),
]

COUNT_PUSHF_UNLOCKED = [
    ("48 8d 64 24 80", "lea rsp, [rsp-0x80]"),
    ("9c", "pushfq"),
    ("48 ff 05 33 e0 0f 00", "inc qword ptr [0x500040]"),
    ("9d", "popfq"),
    ("48 8d a4 24 80 00 00 00", "lea rsp, [rsp+0x80]"),
    ("55", "push rbp"),
    ("48 89 e5", "mov rbp, rsp"),
    ("48 83 ec 10", "sub rsp, 0x10"),
    ("e9 e5 ef ff ff", "jmp 0x401008"),
]

# The record of the probe at A (endbr64; mov rax, [rip+...]) with id 3, ring at AREA (1024
# slots), with the registers, no captures: 32 + 144 bytes, 3 slots. The frame is eflags, rax,
# the arithmetic flags, rcx, rdx, rbx, rsi: [rsp] is rsi, [rsp+0x28] rax, [rsp+0x30] eflags, and
# the program's rsp is rsp + 7 * 8 + 128.
RECORD_LAHF = [
    ("48 8d 64 24 80", "lea rsp, [rsp-0x80]"),
    ("9c", "pushfq"),
    ("50", "push rax"),
    ("0f 90 c0", "seto al"),
    ("9f", "lahf"),
    ("50", "push rax"),
    ("51", "push rcx"),
    ("52", "push rdx"),
    ("53", "push rbx"),
    ("56", "push rsi"),
    # reserve tickets rax .. rax+2: head is AREA+0x40, tail AREA+0x80, drops AREA+0xc0
    ("48 8b 05 29 e0 1f 00", "mov rax, [0x600040]"),
    ("48 8d 48 03", "lea rcx, [rax+3]"),  # retry: the new head
    ("48 8b d1", "mov rdx, rcx"),
    ("48 2b 15 5b e0 1f 00", "sub rdx, [0x600080]"),
    ("48 81 fa 00 04 00 00", "cmp rdx, 0x400"),  # used slots past the capacity: full
    ("0f 8f ef 00 00 00", "jg 0x402121"),  # signed: a stale head gives rdx < 0
    ("f0 48 0f b1 0d 05 e0 1f 00", "lock cmpxchg [0x600040], rcx"),
    ("75 da", "jne 0x402017"),  # rax is the head another producer set: retry
    # rbx = ring + (ticket % 1024) * 64; the ticket stays in rsi
    ("48 8b f0", "mov rsi, rax"),
    ("81 e0 ff 03 00 00", "and eax, 0x3ff"),
    ("48 c1 e0 06", "shl rax, 6"),
    ("48 8d 1d af ff 1f 00", "lea rbx, [0x602000]"),
    ("48 03 d8", "add rbx, rax"),
    # the header: thread (fs base), tsc, then meta = cpu << 48 | regs | 3 slots << 32 | id 3
    ("f3 48 0f ae c1", "rdfsbase rcx"),
    ("48 89 4b 10", "mov [rbx+0x10], rcx"),
    ("0f 31", "rdtsc"),
    ("f3 0f c7 f9", "rdpid rcx"),
    ("48 c1 e2 20", "shl rdx, 0x20"),
    ("48 0b c2", "or rax, rdx"),
    ("48 89 43 18", "mov [rbx+0x18], rax"),
    ("81 e1 ff 0f 00 00", "and ecx, 0xfff"),  # TSC_AUX: the node above bit 12
    ("48 c1 e1 30", "shl rcx, 0x30"),
    ("48 b8 03 00 00 00 03 00 00 80", "mov rax, 0x8000000300000003"),
    ("48 0b c8", "or rcx, rax"),
    ("48 89 4b 08", "mov [rbx+8], rcx"),
    # the registers block at 0x20: rip (the probe), eflags, rsp, then r15 .. rdi; those the
    # action changed come from the frame
    ("48 8d 0d 70 ef ff ff", "lea rcx, [0x401000]"),
    ("48 89 4b 20", "mov [rbx+0x20], rcx"),
    ("48 8b 4c 24 30", "mov rcx, [rsp+0x30]"),
    ("48 89 4b 28", "mov [rbx+0x28], rcx"),
    ("48 8d 8c 24 b8 00 00 00", "lea rcx, [rsp+0xb8]"),
    ("48 89 4b 30", "mov [rbx+0x30], rcx"),
    ("4c 89 7b 38", "mov [rbx+0x38], r15"),
    ("4c 89 73 40", "mov [rbx+0x40], r14"),
    ("4c 89 6b 48", "mov [rbx+0x48], r13"),
    ("4c 89 63 50", "mov [rbx+0x50], r12"),
    ("48 89 6b 58", "mov [rbx+0x58], rbp"),
    ("48 8b 4c 24 08", "mov rcx, [rsp+8]"),  # rbx
    ("48 89 4b 60", "mov [rbx+0x60], rcx"),
    ("4c 89 5b 68", "mov [rbx+0x68], r11"),
    ("4c 89 53 70", "mov [rbx+0x70], r10"),
    ("4c 89 4b 78", "mov [rbx+0x78], r9"),
    ("4c 89 83 80 00 00 00", "mov [rbx+0x80], r8"),
    ("48 8b 4c 24 28", "mov rcx, [rsp+0x28]"),  # rax
    ("48 89 8b 88 00 00 00", "mov [rbx+0x88], rcx"),
    ("48 8b 4c 24 18", "mov rcx, [rsp+0x18]"),  # rcx
    ("48 89 8b 90 00 00 00", "mov [rbx+0x90], rcx"),
    ("48 8b 4c 24 10", "mov rcx, [rsp+0x10]"),  # rdx
    ("48 89 8b 98 00 00 00", "mov [rbx+0x98], rcx"),
    ("48 8b 0c 24", "mov rcx, [rsp]"),  # rsi
    ("48 89 8b a0 00 00 00", "mov [rbx+0xa0], rcx"),
    ("48 89 bb a8 00 00 00", "mov [rbx+0xa8], rdi"),
    # the commit word, last: COMMIT_TAG | ticket + 1
    ("48 b9 01 00 00 00 00 00 50 4b", "mov rcx, 0x4b50000000000001"),
    ("48 03 ce", "add rcx, rsi"),
    ("48 89 0b", "mov [rbx], rcx"),
    ("eb 08", "jmp 0x402129"),
    ("f0 48 ff 05 97 df 1f 00", "lock inc qword ptr [0x6000c0]"),  # full: a drop
    ("5e", "pop rsi"),
    ("5b", "pop rbx"),
    ("5a", "pop rdx"),
    ("59", "pop rcx"),
    ("58", "pop rax"),
    ("80 c0 7f", "add al, 0x7f"),
    ("9e", "sahf"),
    ("58", "pop rax"),
    ("48 8d a4 24 88 00 00 00", "lea rsp, [rsp+0x88]"),  # the red zone and eflags
    ("f3 0f 1e fa", "endbr64"),
    ("48 8b 05 be 1e 00 00", "mov rax, [0x404004]"),
    ("e9 c0 ee ff ff", "jmp 0x40100b"),
]


def test_count_listing() -> None:
    d = build_detour(D, region_of(FP_PROLOGUE), CountAction(COUNTER))
    assert listing(d.code, D) == COUNT_LAHF


def test_count_unlocked_with_pushf_listing() -> None:
    action = CountAction(COUNTER, locked=False)
    d = build_detour(D, region_of(FP_PROLOGUE), action, flags=FlagsSave.PUSHF)
    assert listing(d.code, D) == COUNT_PUSHF_UNLOCKED


def test_record_listing() -> None:
    d = build_detour(D, region_of(ENDBR_RIP), RecordAction(3, LAYOUT.ring_at(AREA)))
    assert listing(d.code, D) == RECORD_LAHF
    assert len(d.code) <= DETOUR_MAX


def stores_to_record(code: bytes, end: int) -> list[Instruction]:
    """Every store through rbx, the record pointer, before ``end`` (the displaced copy)."""
    return [
        i
        for i in Decoder(64, code[: end - D], ip=D)
        if i.op_count and i.op0_kind == OpKind.MEMORY and i.memory_base == Register.RBX
    ]


def stack_delta(code: bytes, end: int) -> int:
    """What the straight path through the entry, the action and the exit does to rsp."""
    delta = 0
    for i in Decoder(64, code[: end - D], ip=D):
        if i.mnemonic in (Mnemonic.PUSH, Mnemonic.PUSHFQ):
            delta -= 8
        elif i.mnemonic in (Mnemonic.POP, Mnemonic.POPFQ):
            delta += 8
        elif i.op0_kind == OpKind.REGISTER and i.op0_register == Register.RSP:
            assert i.mnemonic == Mnemonic.LEA and i.memory_base == Register.RSP
            delta += (i.memory_displacement + (1 << 63)) % (1 << 64) - (1 << 63)  # signed
    return delta


# One read of memory: the stores of a copy loop, and the address and status around it.
SMALL_PLAN = CapturePlan([Value(Reg("rdx")), Bytes(Reg("rsi"), 16, 8, 8)])


@pytest.mark.parametrize("plan", [CapturePlan(), SMALL_PLAN], ids=["no-captures", "captures"])
@pytest.mark.parametrize("with_regs", [True, False], ids=["regs", "lean"])
@pytest.mark.parametrize("cpu_id", list(CpuId), ids=lambda c: c.name)
@pytest.mark.parametrize("flags", list(FlagsSave), ids=lambda f: f.name)
@pytest.mark.parametrize("thread_id", list(ThreadId), ids=lambda t: t.name)
def test_record_writes_each_field_once_commit_last(
    thread_id: ThreadId, flags: FlagsSave, cpu_id: CpuId, with_regs: bool, plan: CapturePlan
) -> None:
    action = RecordAction(
        7, LAYOUT.ring_at(AREA), thread_id, with_regs=with_regs, plan=plan, cpu_id=cpu_id
    )
    d = build_detour(D, region_of(FP_PROLOGUE), action, flags=flags)
    stores = stores_to_record(d.code, d.copy_addr)
    # the copy loop of the Bytes capture: [rbx + rcx + its data]
    loop = [i for i in stores if i.memory_index != Register.NONE]
    assert [(i.memory_index, i.memory_displacement) for i in loop] == (
        [(Register.RCX, action.data_offset + 24)] if plan.captures else []
    )
    offsets = [i.memory_displacement for i in stores if i not in loop]
    # Published last: a reader never sees half a record.
    assert offsets[-1] == sa.REC_COMMIT and offsets.count(sa.REC_COMMIT) == 1
    fields = list(range(8, action.data_offset, 8))  # meta, thread, tsc, the registers
    assert sorted(o for o in offsets if 0 < o < action.data_offset) == fields
    data = [o - action.data_offset for o in offsets if o >= action.data_offset]
    if plan.captures:  # rdx; the address, the status cleared, then copied or faulted
        assert sorted(data) == [0, 8, 16, 16, 16]
    else:
        assert data == []
    assert max(offsets) < action.size == action.data_offset + plan.size
    # Nothing leaves for the exit without the commit, but the drop.
    instrs = list(Decoder(64, d.code[: d.copy_offset], ip=D))
    commit = stores[-1]
    after = [i for i in instrs if i.ip > commit.ip]
    assert after[0].mnemonic == Mnemonic.JMP and after[1].mnemonic == Mnemonic.INC
    assert after[1].has_lock_prefix and after[1].ip_rel_memory_address == AREA + sa.OFF_DROPS
    for i in instrs:
        if i.is_jcc_short_or_near or i.is_jmp_short_or_near:
            target = i.near_branch_target
            assert target <= commit.ip or i is after[0] or target == after[1].ip, i
    full = [i for i in instrs if i.is_jcc_short_or_near and i.near_branch_target == after[1].ip]
    assert len(full) == 1
    mnemonics = {i.mnemonic for i in instrs}
    if thread_id is ThreadId.FSBASE:
        assert Mnemonic.RDFSBASE in mnemonics
    else:
        assert any(i.memory_segment == Register.FS for i in instrs)
    assert (Mnemonic.RDPID in mnemonics) is (cpu_id is CpuId.RDPID)
    assert (Mnemonic.RDTSCP in mnemonics) is (cpu_id is CpuId.RDTSCP)
    assert (Mnemonic.RDTSC in mnemonics) is (cpu_id is not CpuId.RDTSCP)
    # Whatever the entry pushed, the exit popped: rsp is back where the program had it.
    assert stack_delta(d.code, d.copy_addr) == 0
    assert (Mnemonic.POPFQ in mnemonics) is (flags is FlagsSave.PUSHF)
    assert (Mnemonic.SAHF in mnemonics) is (flags is FlagsSave.LAHF)


def test_record_without_a_cpu_id_says_so() -> None:
    """CpuId.NONE: the cpu field reads META_CPU_MASK (reader.py gives cpu -1), not a CPU."""
    action = RecordAction(1, LAYOUT.ring_at(AREA), with_regs=False, cpu_id=CpuId.NONE)
    text = [t for _, t in listing(build_detour(D, region_of(FP_PROLOGUE), action).code, D)]
    assert f"mov ecx, {sa.META_CPU_MASK:#x}" in text
    assert not any(t.startswith("and ecx") for t in text)


def test_record_counts_every_hit_first() -> None:
    action = RecordAction(2, LAYOUT.ring_at(AREA), with_regs=False, counter=COUNTER)
    d = build_detour(D, region_of(FP_PROLOGUE), action)
    instrs = list(Decoder(64, d.code, ip=D))
    incs = [i for i in instrs if i.mnemonic == Mnemonic.INC]
    assert [i.ip_rel_memory_address for i in incs] == [COUNTER, AREA + sa.OFF_DROPS]
    assert all(i.has_lock_prefix for i in incs)
    head = next(i for i in instrs if i.is_ip_rel_memory_operand)
    assert head is incs[0]  # before the reservation: recorded or dropped, the hit counts


def test_record_sizes() -> None:
    ring = LAYOUT.ring_at(AREA)
    assert (RecordAction(1, ring).size, RecordAction(1, ring).slots) == (176, 3)
    lean = RecordAction(1, ring, with_regs=False)
    assert (lean.data_offset, lean.size, lean.slots) == (32, 32, 1)
    assert lean.clobbers == ("rax", "rcx", "rdx", "rbx", "rsi")
    both = RecordAction(1, ring, plan=SMALL_PLAN)
    assert (both.data_offset, both.size, both.slots) == (176, 176 + 8 + 24, 4)
    assert both.clobbers == ("rax", "rcx", "rdx", "rbx", "rsi", "rdi", "r10", "r11")
    # the largest record: the mirror's bytes; one byte more is refused
    fits = CapturePlan([String(Reg("rdi"), 0, sa.MIRROR - 32 - 16)])
    assert RecordAction(1, ring, with_regs=False, plan=fits).slots == sa.MAX_SLOTS
    too_big = CapturePlan([String(Reg("rdi"), 0, sa.MIRROR - 32 - 15)])
    with pytest.raises(InternalError, match="exceeds"):
        RecordAction(1, ring, with_regs=False, plan=too_big)


def test_a_record_detour_with_the_fetch_args_of_a_common_probe_fits() -> None:
    # What recording.py builds for an async handler (with the registers) on a probe with
    # `a=+0(%di):string b=+8(+16(%si)):u32`: 5 captures, 3 of them memory.
    plan = CapturePlan(
        [
            Value(Reg("rdi")),
            String(Reg("rdi"), 0, 256),
            Value(Reg("rsi")),
            Bytes(Reg("rsi"), 16, 8, 8),
            Bytes(Word(3), 8, 4, 4),
        ]
    )
    action = RecordAction(1, LAYOUT.ring_at(AREA), plan=plan)
    d = build_detour(D, region_of(ENDBR_RIP), action)
    assert 512 < len(d.code) <= DETOUR_MAX  # 653 bytes: past the 512 DETOUR_MAX once was


def test_frame_words() -> None:
    record = RecordAction(1, LAYOUT.ring_at(AREA))
    lahf = Frame.of(record, FlagsSave.LAHF)
    assert lahf.words == (EFLAGS, "rax", ARITH, "rcx", "rdx", "rbx", "rsi")
    assert (lahf.offset("rsi"), lahf.offset("rax"), lahf.offset(EFLAGS)) == (0, 40, 48)
    assert lahf.probe_rsp == 7 * 8 + RED_ZONE
    pushf = Frame.of(record, FlagsSave.PUSHF)
    assert pushf.words == (EFLAGS, "rax", "rcx", "rdx", "rbx", "rsi")
    assert pushf.probe_rsp == 6 * 8 + RED_ZONE
    capturing = Frame.of(RecordAction(1, LAYOUT.ring_at(AREA), plan=SMALL_PLAN), FlagsSave.LAHF)
    assert capturing.words == (
        EFLAGS,
        "rax",
        ARITH,
        "rcx",
        "rdx",
        "rbx",
        "rsi",
        "rdi",
        "r10",
        "r11",
    )
    assert capturing.probe_rsp == 10 * 8 + RED_ZONE
    count = CountAction(COUNTER)
    assert Frame.of(count, FlagsSave.LAHF).words == ("rax",)
    assert Frame.of(count, FlagsSave.PUSHF).words == (EFLAGS,)


def test_detour_addresses_and_patch() -> None:
    region = region_of(FP_PROLOGUE)  # push, mov, sub: 8 bytes
    d = build_detour(D, region, CountAction(COUNTER))
    assert isinstance(d, Detour)
    assert d.patch == bytes.fromhex("e9") + (D - (A + 5)).to_bytes(4, "little", signed=True)
    (jmp,) = Decoder(64, d.patch, ip=A)
    assert jmp.near_branch_target == D
    assert d.code[d.copy_offset : d.copy_offset + 8] == FP_PROLOGUE[:8]
    assert d.back_addr == d.copy_addr + 8 == D + len(d.code) - 5
    assert d.original_address(d.copy_addr) == A
    assert d.original_address(d.copy_addr + 4) == A + 4
    assert d.original_address(d.back_addr) == A + 8
    assert d.original_address(D) is None
    assert d.original_address(d.back_addr + 1) is None


@pytest.mark.parametrize("where", [A + 3 * GIB, A - 2 * GIB])
def test_detour_out_of_reach_of_the_probe(where: int) -> None:
    with pytest.raises(NotRelocatable, match="outside rel32") as info:
        build_detour(where, region_of(FP_PROLOGUE), CountAction(where + 0x1000))
    assert info.value.errno == errno.ERANGE


def test_counter_out_of_reach() -> None:
    with pytest.raises(NotRelocatable, match="out of rel32 reach") as info:
        build_detour(D, region_of(FP_PROLOGUE), CountAction(D + 3 * GIB))
    assert info.value.errno == errno.ERANGE


@pytest.mark.parametrize("base", [D + 2 * GIB, D + (1 << 40)])
def test_ring_out_of_reach(base: int) -> None:
    with pytest.raises(NotRelocatable) as info:
        build_detour(D, region_of(FP_PROLOGUE), RecordAction(1, LAYOUT.ring_at(base)))
    assert info.value.errno == errno.ERANGE


def test_displaced_rip_relative_out_of_reach() -> None:
    # mov rax, [rip+0x7fff0000] at A reaches almost 2 GiB up; a detour 1 GiB below A
    # is within reach of A but not of that operand.
    code = bytes.fromhex("488b050000ff7f c3 90 90")
    region = region_of(code, 2 * GIB)
    with pytest.raises(NotRelocatable, match="out of rel32 reach") as info:
        build_detour(GIB, region, CountAction(GIB + 0x1000))
    assert info.value.errno == errno.ERANGE
    build_detour(2 * GIB + 0x10_0000, region, CountAction(2 * GIB))  # nearby: fine


def test_probe_id_must_fit_an_imm32() -> None:
    with pytest.raises(InternalError):
        RecordAction(1 << 31, LAYOUT.ring_at(AREA))


def test_block_labels() -> None:
    block = Block()
    block.branch(Code.JMP_REL8_64, "nowhere")
    with pytest.raises(InternalError, match="nowhere"):
        block.encode(D)
    block = Block()
    block.label("twice")
    with pytest.raises(InternalError, match="twice"):
        block.label("twice")
