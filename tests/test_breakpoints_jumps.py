"""Breakpoints own the optimizer's jumps as they own the int3s: bytes in, bytes out, on a fake
address space (a bytearray), never a process."""

from __future__ import annotations

from typing import Any, cast

import pytest

from kprobes.errors import InternalError
from kprobes.process.engine.breakpoints import Breakpoints

BASE = 0x1000
CODE = bytes(range(0x40, 0x60))  # stand-in instructions
JMP = b"\xe9\x11\x22\x33\x44"


class Space:
    """The part of Tracee that Breakpoints uses."""

    def __init__(self) -> None:
        self.mem = bytearray(CODE)

    def read(self, addr: int, n: int) -> bytes:
        return bytes(self.mem[addr - BASE : addr - BASE + n])

    read_some = read

    def write(self, addr: int, data: bytes) -> None:
        self.mem[addr - BASE : addr - BASE + len(data)] = data


def armed_and_jumped(at: int = BASE + 4) -> tuple[Breakpoints, Space, Any]:
    bp, space = Breakpoints(), Space()
    spaces = cast(Any, [space])
    bp.arm(spaces, at, CODE[at - BASE])
    bp.patch_jump(spaces, at, JMP, CODE[at - BASE : at - BASE + 5])
    return bp, space, spaces


def test_original_undoes_the_jump_in_any_window():
    bp, space, _ = armed_and_jumped()
    assert space.mem[4:9] == JMP
    for start in range(BASE, BASE + 12):
        for size in (1, 3, 8, 20):
            want = CODE[start - BASE : start - BASE + size]
            assert bp.original(cast(Any, space), start, size) == want


def test_a_trap_from_before_the_jump_is_stale():
    bp, _, _ = armed_and_jumped()
    assert bp.is_stale_trap(BASE + 4)


def test_unpatch_puts_back_the_original_then_the_int3():
    bp, space, spaces = armed_and_jumped()
    bp.unpatch_jump(spaces, BASE + 4, rearm=True)
    assert space.mem[4:9] == b"\xcc" + CODE[5:9]
    assert bp.original(cast(Any, space), BASE, 16) == CODE[:16]
    bp.disarm(spaces, BASE + 4)
    assert bytes(space.mem) == CODE


def test_restore_all_and_sync_for_children():
    bp, _, _ = armed_and_jumped()
    child = Space()
    child.mem[4:9] = JMP  # the fork's copy
    bp.sync(cast(Any, child))
    assert child.mem[4:9] == JMP
    bp.restore_all(cast(Any, child))
    assert bytes(child.mem) == CODE


def test_a_jump_needs_the_int3_it_replaces():
    bp, space = Breakpoints(), Space()
    with pytest.raises(InternalError):
        bp.patch_jump(cast(Any, [space]), BASE, JMP, CODE[:5])
