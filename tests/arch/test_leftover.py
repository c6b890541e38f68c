"""A dead kprobes' jump at a probe site, and the original bytes under it (leftover.py): bytes
in, bytes out, over detours made by our own generator."""

from __future__ import annotations

import pytest

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import CapturePlan, Reg, String, Value
from kprobes.arch.x86_64.detour import Action, CountAction, build_detour
from kprobes.arch.x86_64.encode import jmp_rel32
from kprobes.arch.x86_64.jumpopt import Region, find_region
from kprobes.arch.x86_64.leftover import original_under_jump
from kprobes.arch.x86_64.record import RecordAction

A, D, AREA = 0x401000, 0x402000, 0x500000
RIP_MOV = bytes.fromhex("488b05b82d0000") + bytes.fromhex("4883c001c3")  # mov rax,[rip+X]; add; ret
PROLOGUE = bytes.fromhex("554889e54883ec10") + bytes.fromhex("c9c3")  # push; mov; sub; leave; ret


def region(code: bytes) -> Region:
    r = find_region(code, A, A, len(code))
    assert isinstance(r, Region)
    return r


def record() -> Action:
    plan = CapturePlan()
    plan.add(Value(Reg("rdi")))
    plan.add(String(Reg("rsi"), 0, 64))
    return RecordAction(1, sa.AreaLayout(4, 1024).ring_at(AREA), plan=plan, counter=AREA + 4096)


@pytest.mark.parametrize("code", [RIP_MOV, PROLOGUE], ids=["rip-relative", "prologue"])
@pytest.mark.parametrize(
    "make", [lambda: CountAction(AREA + 4096), record], ids=["count", "record"]
)
def test_the_original_bytes_come_back(code: bytes, make) -> None:
    d = build_detour(D, region(code), make())

    def read(at: int, n: int) -> bytes:
        return d.code[at - D : at - D + n]

    assert original_under_jump(A, d.patch, read) == code[:5]


def test_a_jump_that_is_not_into_a_detour_is_the_programs() -> None:
    other = bytes.fromhex("31c0c3") + bytes(64)
    assert original_under_jump(A, jmp_rel32(A, D), lambda at, n: other[:n]) is None
    assert original_under_jump(A, PROLOGUE[:5], lambda at, n: b"") is None  # no jump at all
    assert original_under_jump(A, jmp_rel32(A, D), lambda at, n: b"") is None  # unreadable
