"""The code of optimized return probes (arch/x86_64/retstack.py), bytes in, listing out.

The live behaviour (pairing, release, recovery, unhooking) is tested on real programs in
tests/test_fast_returns.py; here, what the code must hold whatever runs it: the trampoline
keeps every register, reaches everything by absolute address (it may be placed anywhere),
reads what its site asks for; the entry caps the depth; the layouts fit.
"""

from __future__ import annotations

import pytest
from iced_x86 import Code, Decoder, Formatter, FormatterSyntax, Instruction, OpKind, Register

from kprobes.arch.x86_64 import retstack as rs
from kprobes.arch.x86_64 import rettramp as rt
from kprobes.arch.x86_64 import shadow
from kprobes.arch.x86_64.detour import build_detour
from kprobes.arch.x86_64.jumpopt import find_region
from kprobes.errors import InternalError
from kprobes.process.fast.returns import NCOUNTERS

SHADOW, TRAMP, COUNTERS = 0x7F00_0000_0000, 0x5000_0000, 0x6000_0000
SITE = rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS)
_FMT = Formatter(FormatterSyntax.INTEL)


def listing(code: bytes, at: int) -> list[Instruction]:
    return list(Decoder(64, code, ip=at))


def text(instrs: list[Instruction]) -> list[str]:
    return [_FMT.format(i) for i in instrs]


def test_trampoline_keeps_every_register_it_uses() -> None:
    instrs = listing(rt.build_trampoline(SITE, 1 << 31), TRAMP)
    pushes = [i.op0_register for i in instrs if i.code == Code.PUSH_R64]
    ret = next(n for n, i in enumerate(instrs) if i.code == Code.RETNQ)
    pops = [i.op0_register for i in instrs[:ret] if i.code == Code.POP_R64]
    assert pushes == list(reversed(pops))
    written = {i.op0_register for i in instrs if i.op_count and i.op0_kind == OpKind.REGISTER}
    gprs = {Register.RAX, Register.RCX, Register.RDX, Register.RSI, Register.RDI}
    gprs |= {Register.R8, Register.R9, Register.R10, Register.R11}
    assert written - {Register.RSP, Register.EAX, Register.ECX, Register.EDX, Register.ESI,
                      Register.R9D} <= set(pushes) == gprs  # fmt: skip
    # lea rsp,[rsp-8] first: the word the final ret takes the real return address from.
    assert text(instrs[:1]) == ["lea rsp,[rsp-8]"]


@pytest.mark.parametrize("bits", [0, 32, 64])
def test_trampoline_reaches_everything_by_absolute_address(bits: int) -> None:
    site = rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, value_bits=bits)
    code = rt.build_trampoline(site, 1 << 31)
    assert len(code) <= rt.TRAMPOLINE_MAX
    instrs = listing(code, TRAMP)
    assert not [i for i in instrs if i.is_ip_rel_memory_operand]
    imm64 = {i.immediate64 for i in instrs if i.code == Code.MOV_R64_IMM64}
    assert {SHADOW, COUNTERS} <= imm64
    # A released entry is counted abandoned by its own probe: the counters it names.
    body = text(instrs)
    assert f"mov rdx,[r10+{shadow.E_OWNER:X}h]" in body
    assert f"lock inc qword ptr [rdx+{rs.C_ABANDONED:X}h]" in body
    assert f"lock dec qword ptr [rdx+{rs.C_LIVE:X}h]" in body


def test_trampoline_aggregates_what_its_site_asks_for() -> None:
    def body(bits: int) -> list[str]:
        site = rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, value_bits=bits)
        return text(listing(rt.build_trampoline(site, 1 << 31), TRAMP))

    saved_rax = f"mov rax,[rsp+{8 * 8:X}h]"
    assert "rdtsc" in body(0) and "mul rcx" in body(0) and saved_rax not in body(0)
    assert saved_rax in body(64) and "rdtsc" not in body(64) and "mov eax,eax" not in body(64)
    assert saved_rax in body(32) and "mov eax,eax" in body(32)


def test_the_code_hashes_the_thread_pointer_as_the_tool_does() -> None:
    instrs = text(listing(rt.build_trampoline(SITE, 1 << 31), TRAMP))
    start = instrs.index("rdfsbase rcx")
    assert instrs[start + 1 : start + 6] == [
        "mov rsi,rcx",
        "shr rsi,0Ch",
        "imul rsi,61C88647h",
        "shr rsi,10h",
        "and esi,0FFh",  # NTHREADS - 1
    ]
    for fs_base in (0x7F12_3456_7740, 0x7FFF_F7D8_A740, 0x1000):
        want = ((((fs_base >> 12) * 0x61C88647) & (2**64 - 1)) >> 16) & (rs.NTHREADS - 1)
        assert rs.first_index(fs_base) == want


def test_the_entry_caps_each_threads_depth() -> None:
    code = bytes.fromhex("554889e54883ec10c9c3")  # push rbp; mov rbp,rsp; sub rsp,16
    region = find_region(code, 0x40_1000, 0x40_1000, len(code))
    assert not isinstance(region, str)
    site = rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, cap=7)
    detour = build_detour(0x40_0000, region, rs.RetEntryAction(site))  # type: ignore[arg-type]
    instrs = text(listing(detour.code, 0x40_0000))
    assert "cmp rsi,7" in instrs
    assert f"mov rax,{TRAMP:X}h" in instrs  # the hook: this probe's trampoline


def test_bad_sites_are_refused() -> None:
    with pytest.raises(InternalError):
        rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, cap=rs.CAPACITY + 1)
    with pytest.raises(InternalError):
        rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, value_bits=16)
    with pytest.raises(InternalError):
        rt.build_trampoline(SITE, 0)


def test_layouts_fit() -> None:
    assert rs.T_LOST + rs.LOST_MAX * shadow.LOST <= rs.SLOT_STRIDE
    assert rs.SLOT_STRIDE % shadow.PAGE == 0
    assert shadow.E_ARGS + 8 * shadow.ENTRY_REGS_MAX <= shadow.ENTRY
    assert shadow.E_TSC < shadow.E_ARGS
    assert rs.COUNTERS_SIZE <= NCOUNTERS * 64
    assert rs.C_HIST + 8 * rs.HIST_SLOTS == rs.COUNTERS_SIZE


def _record_site(entry_regs: tuple[str, ...] = ()) -> rs.ReturnSite:
    from kprobes.arch.x86_64 import shared_area as sa
    from kprobes.arch.x86_64.capture import ENTRY_TSC, CapturePlan, Reg, Value, entry_word
    from kprobes.arch.x86_64.record import RecordAction

    ring = sa.RingAddrs(TRAMP + 0x8000, TRAMP + 0x8008, TRAMP + 0x8010, TRAMP + 0x8018,
                        TRAMP + 0x9000, 64)  # fmt: skip
    plan = CapturePlan()
    for name in ("rax", "rip", ENTRY_TSC, *map(entry_word, entry_regs)):
        plan.add(Value(Reg(name)))
    record = RecordAction(3, ring, with_regs=True, plan=plan, counter=None)
    return rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, record=record,
                         entry_regs=entry_regs)  # fmt: skip


@pytest.mark.parametrize(
    "entry_regs", [(), ("rsi",), ("rdi", "rsi", "rdx", "rcx", "r8", "r9")], ids=["0", "1", "6"]
)
def test_a_recording_trampoline_gives_back_every_word_it_took(entry_regs: tuple[str, ...]) -> None:
    """Its frame: the return address's word, the nine registers, rbx, the flags, the entry
    time (and the entry's registers): all taken back before the ret, rbx popped."""
    site = _record_site(entry_regs)
    frame = rt.record_frame(site)
    assert frame.words[0] == "rip" and frame.probe_rsp == 8 * len(frame.words)
    instrs = listing(rt.build_trampoline(site, 1 << 31), TRAMP)
    ret = next(n for n, i in enumerate(instrs) if i.code == Code.RETNQ)
    taken = 8 + 8 * sum(i.code in (Code.PUSH_R64, Code.PUSHFQ) for i in instrs[:ret])
    popped = 8 * sum(i.code == Code.POP_R64 for i in instrs[:ret])
    leas = [i for i in instrs[:ret] if i.code == Code.LEA_R64_M and i.op0_register == Register.RSP]
    given = sum(i.memory_displacement for i in leas[1:])  # the first is Step 1's lea rsp,[rsp-8]
    assert taken == popped + given + 8  # the last word is the real return address, for the ret


def test_the_entry_keeps_the_registers_a_return_record_asks_for() -> None:
    """Each in its word of the shadow entry, in order; the trampoline copies each back into
    its frame word for the record (``entry_word``)."""
    from kprobes.arch.x86_64.capture import entry_word

    code = bytes.fromhex("554889e54883ec10c9c3")
    region = find_region(code, 0x40_1000, 0x40_1000, len(code))
    assert not isinstance(region, str)
    site = _record_site(("rsi", "r9", "rdi"))
    detour = build_detour(0x40_0000, region, rs.RetEntryAction(site))  # type: ignore[arg-type]
    instrs = text(listing(detour.code, 0x40_0000))
    stores = [line for line in instrs if line.startswith("mov [r10+") and line.endswith(",rax")]
    kept = [f"mov [r10+{rs.E_ARGS + 8 * i:X}h],rax" for i in range(3)]
    assert [line for line in stores if line in kept] == kept
    tramp = text(listing(rt.build_trampoline(site, 1 << 31), TRAMP))
    frame = rt.record_frame(site)
    for i, reg in enumerate(("rsi", "r9", "rdi")):
        assert f"mov rax,[r10+{rs.E_ARGS + 8 * i:X}h]" in tramp
        offset = frame.offset(entry_word(reg))  # iced's spelling: [rsp], [rsp+8], [rsp+10h]
        where = "" if offset == 0 else f"+{offset}" if offset < 10 else f"+{offset:X}h"
        assert f"mov [rsp{where}],rax" in tramp
    with pytest.raises(InternalError):
        rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, entry_regs=("rsi",))  # no record
    with pytest.raises(InternalError):
        _record_site(("rsi", "rsi"))
    with pytest.raises(InternalError):
        _record_site(("rsi", "rbx"))  # not a register the entry saves


def test_an_entry_record_and_the_hook_share_one_detour() -> None:
    """``Actions``: the entry's record first, then the hook; their labels ("full", "done",
    "drop" in both) kept apart, the registers either clobbers saved."""
    from kprobes.arch.x86_64.detour import Actions

    code = bytes.fromhex("554889e54883ec10c9c3")
    region = find_region(code, 0x40_1000, 0x40_1000, len(code))
    assert not isinstance(region, str)
    from kprobes.arch.x86_64.capture import CapturePlan, Reg, Value
    from kprobes.arch.x86_64.record import RecordAction

    ring_record = _record_site().record
    assert ring_record is not None
    plan = CapturePlan()
    plan.add(Value(Reg("rdi")))
    record = RecordAction(4, ring_record.ring, with_regs=False, plan=plan, counter=None)
    both = Actions((record, rs.RetEntryAction(SITE)))
    assert set(both.clobbers) == set(record.clobbers) | set(rs.RetEntryAction(SITE).clobbers)
    detour = build_detour(0x5000_2000, region, both)  # type: ignore[arg-type]
    instrs = text(listing(detour.code, 0x5000_2000))
    commit = next(i for i, t in enumerate(instrs) if t.startswith("lock cmpxchg"))
    hook = instrs.index(f"mov rax,{TRAMP:X}h")
    assert commit < hook


def test_an_instance_is_taken_by_a_signed_compare() -> None:
    """A fork child gives back the instances of the frames it inherited, as its parent
    does: the shared count may go below zero, which must admit calls, not refuse them all
    (an unsigned compare would)."""
    code = bytes.fromhex("554889e54883ec10c9c3")
    region = find_region(code, 0x40_1000, 0x40_1000, len(code))
    assert not isinstance(region, str)
    site = rs.ReturnSite(SHADOW, TRAMP, TRAMP, 0x10000, 0, COUNTERS, maxactive=3)
    detour = build_detour(0x40_0000, region, rs.RetEntryAction(site))  # type: ignore[arg-type]
    instrs = listing(detour.code, 0x40_0000)
    body = text(instrs)
    at = body.index(f"lock xadd [r11+{rs.C_LIVE:X}h],rax")
    assert body[at + 1] == "cmp rax,3"
    assert body[at + 2].startswith("jl ")  # not jb

