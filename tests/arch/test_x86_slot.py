"""Slot bytes (relocated copy + jmp back / int3), the encoders, and the step fixup."""

from __future__ import annotations

import errno

import pytest
from iced_x86 import Code, Decoder, Instruction

from kprobes.arch.x86_64.encode import (
    INT3,
    in_rel32_reach,
    jmp_abs64,
    jmp_rel32,
    relocate_rip_relative,
)
from kprobes.arch.x86_64.plan import (
    SLOT_SIZE,
    Plan,
    PlanKind,
    build_slot,
    plan_instruction,
    step_fixup,
)
from kprobes.errors import InternalError, NotRelocatable

A = 0x401000
GIB = 1 << 30


def decode_all(code: bytes, ip: int) -> list[Instruction]:
    return list(Decoder(64, code, ip=ip))


def planned(raw: str, *, post: bool = False, addr: int = A) -> tuple[Plan, bytes]:
    code = bytes.fromhex(raw)
    return plan_instruction(code, addr, has_post_handler=post), code


# ---- encoders ---------------------------------------------------------------------------------


def test_jmp_rel32_bytes() -> None:
    assert jmp_rel32(0x1000, 0x1005) == bytes.fromhex("e9 00 00 00 00")
    assert jmp_rel32(0x1000, 0x1000) == bytes.fromhex("e9 fb ff ff ff")
    assert jmp_rel32(0x1000, 0x2005) == bytes.fromhex("e9 00 10 00 00")


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (0x1000, 0x7FFF_0000),
        (0x7FFF_1000_0000, 0x7FFF_1000_0000 - 0x7FFF_0000),
        (0x5555_5555_4000, 0x5555_5555_4000 + (1 << 31) - 1 + 5),
    ],
)
def test_jmp_rel32_decodes_to_its_target(src: int, dst: int) -> None:
    (jmp,) = decode_all(jmp_rel32(src, dst), src)
    assert (jmp.code, jmp.near_branch_target) == (Code.JMP_REL32_64, dst)


def test_jmp_rel32_out_of_reach() -> None:
    with pytest.raises(NotRelocatable, match="outside rel32") as info:
        jmp_rel32(0x1000, 0x1000 + 3 * GIB)
    assert info.value.errno == errno.ERANGE


def test_in_rel32_reach_edges() -> None:
    assert in_rel32_reach(0x1_0000_0000, 0x1_0000_0000 + (1 << 31) - 1)
    assert not in_rel32_reach(0x1_0000_0000, 0x1_0000_0000 + (1 << 31))
    assert in_rel32_reach(0x1_0000_0000, 0x1_0000_0000 - (1 << 31))
    assert not in_rel32_reach(0x1_0000_0000, 0x1_0000_0000 - (1 << 31) - 1)


def test_jmp_abs64() -> None:
    dst = 0x7F12_3456_789A
    code = jmp_abs64(dst)
    assert len(code) == 14
    jmp = decode_all(code[:6], 0x5000)[0]
    assert (jmp.code, jmp.ip_rel_memory_address) == (Code.JMP_RM64, 0x5006)
    assert int.from_bytes(code[6:], "little") == dst


def test_relocate_leaves_position_independent_code_alone() -> None:
    code = bytes.fromhex("48 83 ec 10")
    assert relocate_rip_relative(code + b"\xcc", A, A + 5 * GIB) == code


# ---- build_slot -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "8b 05 e4 2e 00 00",  # mov eax, [rip+0x2ee4]
        "48 89 05 10 00 00 00",  # mov [rip+0x10], rax
        "83 3d 10 00 00 00 05",  # cmp dword ptr [rip+0x10], 5: an immediate after the disp
        "c5 f9 6f 05 f0 ff ff ff",  # vmovdqa xmm0, [rip-0x10]: VEX
        "f0 48 0f b1 0d 10 00 00 00",  # lock cmpxchg [rip+0x10], rcx
        "64 48 8b 05 10 00 00 00",  # mov rax, fs:[rip+0x10]
    ],
)
@pytest.mark.parametrize("distance", [0x1000, -0x1000, GIB, -GIB])
def test_boost_slot_keeps_the_rip_relative_target(raw: str, distance: int) -> None:
    addr = 0x5555_5555_4000  # a PIE's text
    plan, code = planned(raw, addr=addr)
    assert (plan.kind, plan.rip_relative) == (PlanKind.BOOST, True)
    slot = addr + distance
    body = build_slot(plan, code, slot)
    original = decode_all(code, addr)[0]
    copy, jmp = decode_all(body, slot)
    # Same instruction, same length, same absolute operand: only the disp32 differs.
    assert (copy.code, copy.len) == (original.code, original.len)
    assert copy.ip_rel_memory_address == original.ip_rel_memory_address
    decoder = Decoder(64, code, ip=addr)
    disp_at = decoder.get_constant_offsets(decoder.decode()).displacement_offset
    differing = {i for i in range(len(code)) if body[i] != code[i]}
    assert differing and differing <= set(range(disp_at, disp_at + 4))
    # Then back to the instruction after the probe.
    assert (jmp.code, jmp.near_branch_target) == (Code.JMP_REL32_64, addr + len(code))
    assert len(body) == len(code) + 5 <= SLOT_SIZE


def test_boost_slot_of_position_independent_code() -> None:
    plan, code = planned("48 83 ec 10")
    assert build_slot(plan, code, A + 0x2000) == code + jmp_rel32(A + 0x2004, A + 4)
    assert build_slot(plan, code, A - 0x1000) == code + jmp_rel32(A - 0x1000 + 4, A + 4)


def test_step_slot_ends_with_int3() -> None:
    plan, code = planned("8b 05 e4 2e 00 00", post=True)
    assert plan.kind is PlanKind.STEP
    body = build_slot(plan, code, A + 0x1000)
    assert len(body) == 7 and body[-1:] == INT3
    assert decode_all(body[:6], A + 0x1000)[0].ip_rel_memory_address == A + 6 + 0x2EE4


def test_singlestep_slot_is_the_copy_and_a_guard_int3() -> None:
    plan, code = planned("0f 05")
    assert build_slot(plan, code, A + 0x1000) == code + INT3


def test_emulated_instructions_need_no_slot() -> None:
    plan, code = planned("48 89 e5")
    assert build_slot(plan, code, A + 0x1000) == b""


def test_a_15_byte_instruction_fits_a_boost_slot() -> None:
    # lock add qword ptr fs:[rip+0x12345678], 0x12345678, padded with redundant prefixes
    code = bytes.fromhex("2e 2e 64 f0 48 81 05 78 56 34 12 78 56 34 12")
    plan = plan_instruction(code, A, has_post_handler=False)
    assert (plan.kind, plan.length, plan.rip_relative) == (PlanKind.BOOST, 15, True)
    body = build_slot(plan, code, A + 0x1000)
    assert len(body) == 20 <= SLOT_SIZE
    copy = decode_all(body[:15], A + 0x1000)[0]
    assert copy.ip_rel_memory_address == A + 15 + 0x12345678
    assert copy.immediate(1) == 0x12345678


def test_rip_relative_out_of_reach() -> None:
    plan, code = planned("8b 05 e4 2e 00 00")
    with pytest.raises(NotRelocatable, match="out of rel32 reach") as info:
        build_slot(plan, code, A + 3 * GIB)
    assert info.value.errno == errno.ERANGE


def test_jmp_back_out_of_reach() -> None:
    plan, code = planned("48 83 ec 10")
    with pytest.raises(NotRelocatable, match="cannot reach") as info:
        build_slot(plan, code, A + 3 * GIB)
    assert info.value.errno == errno.ERANGE


def test_step_and_singlestep_reach_only_matters_for_rip_relative() -> None:
    far = A + 3 * GIB
    plan, code = planned("48 83 ec 10", post=True)
    assert build_slot(plan, code, far) == code + INT3
    plan, code = planned("8b 05 e4 2e 00 00", post=True)
    with pytest.raises(NotRelocatable):
        build_slot(plan, code, far)


def test_build_slot_rejects_bytes_that_disagree_with_the_plan() -> None:
    plan, _ = planned("48 83 ec 10")
    with pytest.raises(InternalError):
        build_slot(plan, bytes.fromhex("55"), A + 0x1000)


# ---- step_fixup -------------------------------------------------------------------------------

SLOT = 0x7F00_0000_1000


def test_step_fixup_after_the_int3() -> None:
    plan, _ = planned("48 83 ec 10", post=True)
    assert step_fixup(plan, SLOT, SLOT + 5) == A + 4


@pytest.mark.parametrize("rip", [SLOT, SLOT + 4, SLOT + 6, A + 4])
def test_step_fixup_elsewhere_is_a_bug(rip: int) -> None:
    plan, _ = planned("48 83 ec 10", post=True)
    with pytest.raises(InternalError):
        step_fixup(plan, SLOT, rip)


@pytest.mark.parametrize(
    ("rip", "expected"),
    [
        (SLOT + 2, A + 2),  # syscall returned normally
        (SLOT, A),  # stopped before completing (e.g. a fault): restart at the probe
        (SLOT + 3, A + 2),  # stopped by the guard int3 after the copy
        (0x7FFF_1234_5678, 0x7FFF_1234_5678),  # rt_sigreturn moved rip: leave it
    ],
)
def test_singlestep_fixup(rip: int, expected: int) -> None:
    plan, _ = planned("0f 05")
    assert plan.kind is PlanKind.SINGLESTEP
    assert step_fixup(plan, SLOT, rip) == expected


@pytest.mark.parametrize("raw", ["c3", "90", "eb 05", "e8 00 00 00 00"])
def test_no_fixup_for_an_emulated_instruction(raw: str) -> None:
    plan, _ = planned(raw)
    assert plan.kind is PlanKind.EMULATE
    with pytest.raises(InternalError):
        step_fixup(plan, SLOT, SLOT + 1)


@pytest.mark.parametrize("raw", ["55", "48 83 ec 10"])
def test_a_boosted_copy_stepped_once_maps_back(raw: str) -> None:
    """A boosted copy is single-stepped once when a signal came as it began (issue 18):
    stopped on its jmp back, the thread is after the probed instruction; still at the
    slot's start (a ``rep`` iteration), at it."""
    plan, code = planned(raw)
    assert plan.kind is PlanKind.BOOST
    assert step_fixup(plan, SLOT, SLOT + len(code)) == A + len(code)
    assert step_fixup(plan, SLOT, SLOT) == A
