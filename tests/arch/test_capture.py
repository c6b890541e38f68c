"""Fetch-args captured in the program (kprobes/arch/x86_64/capture.py), and read back.

Three layers. The plan and ``Captured`` as values: offsets, sizes, the checks of a plan, and
the reads the evaluator may make of a capture (the bytes that were read at the hit, nothing
else). The code, bytes out: one listing, checked by hand. And the code run for real, in
tests/programs/detour_harness.c's ``inspect(s, o, i, t)``, whose calls pass good pointers and
bad ones (NULL, an unmapped page, a string that runs into one, a PROT_NONE page in the middle
of an array, a non-canonical address, a file's page past its end) from 1 and 4 threads; the
harness implements the fetch fixup convention itself, so that no tracer is involved. Each
record's raw captures are compared with a model of the harness's memory at that call (what
``setup()`` wrote; every other address faults), and the records of real probe specs are
evaluated as reader.py does (``plan_captures``, ``Captured``, ``ArgFetcher``) and compared
with the values the program passed: the optimized probe's event.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from test_detour import AREA, FP_PROLOGUE, LAYOUT, D, listing, region_of
from test_detour_live import (
    BEST_CPU_ID,
    THREAD_IDS,
    Area,
    Finished,
    Harness,
    Run,
    Worker,
    build_harness,
    create_area,
    drain,
    finish,
    install,
    launch,
)

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import (
    COUNT_MASK,
    FAULTED,
    TRUNCATED,
    Bytes,
    Capture,
    Captured,
    CapturePlan,
    Const,
    Reg,
    String,
    Value,
    Word,
    capture_size,
)
from kprobes.arch.x86_64.detour import build_detour
from kprobes.arch.x86_64.record import CpuId, RecordAction, ThreadId
from kprobes.arch.x86_64.regs import REG_INDEX, Regs
from kprobes.errors import InternalError, TargetError
from kprobes.model import ArgValue
from kprobes.process.fetch.evaluate import ArgFetcher, Memory
from kprobes.process.fetch.fast import STRING_LIMIT, plan_captures
from kprobes.spec import parse

MASK = (1 << 64) - 1
RDI, RSI, RDX, RCX = Reg("rdi"), Reg("rsi"), Reg("rdx"), Reg("rcx")

# ---- the plan ---------------------------------------------------------------------------------


def test_sizes_and_offsets() -> None:
    plan = CapturePlan()
    captures: list[Capture] = [
        Value(RDI),  # 8
        Bytes(RSI, 16, 8, 8),  # address, status, 8 bytes
        Bytes(Word(1), 8, 4, 4),  # 4 bytes, in 8
        String(RDI, 0, 33),  # 33 bytes, in 40
        Bytes(Const(0x601040), 0, 6, 2),  # 6, in 8
    ]
    assert [plan.add(c) for c in captures] == [0, 1, 2, 3, 4]
    assert [capture_size(c) for c in captures] == [8, 24, 24, 56, 24]
    assert plan.offsets() == [0, 8, 32, 56, 112]
    assert plan.size == 136
    assert plan.reads_memory and plan.registers() == {"rdi", "rsi"}
    only_values = CapturePlan([Value(RDX), Value(Reg("rip"))])
    assert not only_values.reads_memory and only_values.registers() == {"rdx", "rip"}
    assert CapturePlan().size == 0 and CapturePlan().offsets() == []


def test_the_same_capture_is_made_once() -> None:
    plan = CapturePlan()
    assert plan.add(Value(RSI)) == 0
    assert plan.add(Bytes(RSI, 16, 8, 8)) == 1
    assert plan.add(Value(RSI)) == 0
    assert plan.add(Bytes(RSI, 16, 8, 8)) == 1
    assert plan.add(Bytes(RSI, 16, 8, 4)) == 2  # read by other elements: another capture
    assert plan.add(Bytes(Word(1), 0, 4, 4)) == 3
    assert plan.add(Bytes(Word(1), 0, 4, 4)) == 3
    assert len(plan.captures) == 4


@pytest.mark.parametrize(
    "word",
    [Word(0), Word(1, 1), Word(2), Word(3), Word(-1)],
    ids=["a-value", "past-the-bytes", "a-string", "no-capture", "negative"],
)
def test_a_word_must_be_one_an_earlier_capture_read(word: Word) -> None:
    plan = CapturePlan()
    plan.add(Value(RDI))
    plan.add(Bytes(RSI, 0, 8, 8))
    plan.add(String(RDI, 0, 16))
    for c in (Bytes(word, 0, 8, 8), String(word, 0, 16)):
        with pytest.raises(InternalError):
            plan.add(c)
    assert len(plan.captures) == 3


def test_a_word_of_a_longer_read() -> None:
    plan = CapturePlan([Bytes(RSI, 0, 24, 8)])
    assert plan.add(String(Word(0, 2), 0, 16)) == 1
    assert plan.add(Bytes(Word(0, 1), 4, 2, 2)) == 2


@pytest.mark.parametrize(("size", "elem"), [(0, 1), (-8, 8), (6, 4), (8, 3), (16, 16)], ids=str)
def test_bad_bytes(size: int, elem: int) -> None:
    with pytest.raises(InternalError):
        Bytes(RSI, 0, size, elem)


@pytest.mark.parametrize("limit", [0, -1])
def test_a_string_reads_at_least_a_byte(limit: int) -> None:
    with pytest.raises(InternalError):
        String(RDI, 0, limit)


def test_registers_that_can_be_captured() -> None:
    for name in ("rax", "r15", "rsp", "rip", "eflags"):
        Reg(name)
    for name in ("di", "fs_base", "orig_rax", "xmm0"):
        with pytest.raises(InternalError):
            Reg(name)


# ---- what the evaluator reads back ----------------------------------------------------------


def pack(plan: CapturePlan, values: list[int | tuple[int, int, bytes]]) -> bytes:
    """A record's captures: an int for a Value, (address, status, bytes) for the others."""
    out = bytearray(plan.size)
    for c, at, v in zip(plan.captures, plan.offsets(), values, strict=True):
        if isinstance(c, Value):
            assert isinstance(v, int)
            struct.pack_into("<Q", out, at, v)
        else:
            assert isinstance(v, tuple)
            addr, status, data = v
            struct.pack_into("<QQ", out, at, addr, status)
            out[at + 16 : at + 16 + len(data)] = data
    return bytes(out)


def captured(values: list[int | tuple[int, int, bytes]]) -> Captured:
    plan = CapturePlan(
        [
            Value(RDI),
            Bytes(RSI, 16, 16, 8),
            Bytes(RDX, 0, 8, 4),
            String(RDI, 0, 16),
            String(RCX, 0, 16),
            String(RSI, 0, 16),
            Bytes(Word(1), 0, 8, 8),
        ]
    )
    return Captured(plan, pack(plan, values))


GOOD_CAPTURES: list[int | tuple[int, int, bytes]] = [
    0x7000,
    (0x5010, 16, bytes(range(16))),
    (0x6000, 4 | FAULTED, b"\xaa\xbb\xcc\xdd" + b"\xee" * 4),  # stale bytes past the count
    (0x7000, 6, b"hello\0" + b"x" * 10),
    (0x7100, 16 | TRUNCATED, b"0123456789abcdef"),
    (0x5010, 3 | FAULTED, b"abc"),  # the string at rsi+16 ran into a bad page
    (0x0706050403020100, 0, b"\xff" * 8),  # skipped (a status of 0): nothing read
]


def test_captured_registers() -> None:
    c = captured(GOOD_CAPTURES)
    assert c.regs == {"rdi": 0x7000}


def test_read_answers_only_what_was_read() -> None:
    c = captured(GOOD_CAPTURES)
    assert c.read(0x5010, 16) == bytes(range(16))
    assert c.read(0x5010, 8) == bytes(range(8))
    assert c.read(0x5018, 8) == bytes(range(8, 16))
    assert c.read(0x5013, 2) == b"\x03\x04"
    assert c.read(0x6000, 4) == b"\xaa\xbb\xcc\xdd"  # before the fault
    for addr, size in [
        (0x500F, 2),  # starts before
        (0x501C, 8),  # runs past the end
        (0x6000, 8),  # past the fault
        (0x6004, 1),
        (0x7000, 5),  # a string's bytes are not memory the evaluator may read as such
        (0x0706050403020100, 8),  # the address of a skipped capture is not one
        (0x4000, 1),
    ]:
        with pytest.raises(TargetError):
            c.read(addr, size)


def test_read_string() -> None:
    c = captured(GOOD_CAPTURES)
    assert c.read_string(0x7000, 4096) == b"hello"  # up to the NUL, without it
    assert c.read_string(0x7000, 3) == b"hel"  # the evaluator's own limit
    assert c.read_string(0x7100, 4096) == b"0123456789abcdef"  # truncated at the capture's
    assert c.read_string(0x7100, 10) == b"0123456789"
    with pytest.raises(TargetError):  # faulted before its NUL: the kernel's -EFAULT
        c.read_string(0x5010, 4096)
    with pytest.raises(TargetError):  # inside a string: not where one was read
        c.read_string(0x7001, 4096)
    with pytest.raises(TargetError):  # bytes read as bytes are not a string read
        c.read_string(0x6000, 4096)
    with pytest.raises(TargetError):  # skipped
        c.read_string(0x0706050403020100, 4096)


def test_a_string_with_its_nul_before_the_fault_and_an_empty_one() -> None:
    values = list(GOOD_CAPTURES)
    values[3] = (0x7000, 1, b"\0")
    values[5] = (0x5010, 0 | FAULTED, b"")  # faulted at its first byte
    c = captured(values)
    assert c.read_string(0x7000, 4096) == b""
    with pytest.raises(TargetError):
        c.read_string(0x5010, 4096)


# ---- the code ---------------------------------------------------------------------------------

# A lean record (no registers) of probe 3 at A with the hit counter at 0x500040, its thread
# from fs:0 and its CPU from rdtscp, capturing rdx, 8 bytes at rsi+16, 4 bytes at that word
# plus 8, and the string at rdi (32 bytes at most). The record: header 32, then the captures
# at 0x20 (rdx), 0x28 (the address, the status at 0x30, the bytes at 0x38), 0x40 (0x48,
# 0x50) and 0x58 (0x60, 0x68): 136 bytes, 3 slots. The frame: r11 at [rsp], r10, rdi, rsi,
# rbx, rdx at [rsp+0x28], rcx, the arithmetic flags, rax, eflags at [rsp+0x48].
CAPTURE_PLAN = CapturePlan([Value(RDX), Bytes(RSI, 16, 8, 8), Bytes(Word(1), 8, 4, 4),
                            String(RDI, 0, 32)])  # fmt: skip
CAPTURE_LISTING = [
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
    ("57", "push rdi"),  # the captures' address
    ("41 52", "push r10"),  # and the fixup's continuation
    ("41 53", "push r11"),  # and its magic
    ("f0 48 ff 05 23 e0 0f 00", "lock inc qword ptr [0x500040]"),  # the hit, first
    ("48 8b 05 1c e0 1f 00", "mov rax, [0x600040]"),
    ("48 8d 48 03", "lea rcx, [rax+3]"),
    ("48 8b d1", "mov rdx, rcx"),
    ("48 2b 15 4e e0 1f 00", "sub rdx, [0x600080]"),
    ("48 81 fa 00 04 00 00", "cmp rdx, 0x400"),
    ("0f 8f 5a 01 00 00", "jg 0x402199"),
    ("f0 48 0f b1 0d f8 df 1f 00", "lock cmpxchg [0x600040], rcx"),
    ("75 da", "jne 0x402024"),
    ("48 8b f0", "mov rsi, rax"),
    ("81 e0 ff 03 00 00", "and eax, 0x3ff"),
    ("48 c1 e0 06", "shl rax, 6"),
    ("48 8d 1d a2 ff 1f 00", "lea rbx, [0x602000]"),
    ("48 03 d8", "add rbx, rax"),
    ("64 48 8b 0c 25 00 00 00 00", "mov rcx, fs:[0]"),  # the TCB's self pointer
    ("48 89 4b 10", "mov [rbx+0x10], rcx"),
    ("0f 01 f9", "rdtscp"),  # ecx = TSC_AUX
    ("48 c1 e2 20", "shl rdx, 0x20"),
    ("48 0b c2", "or rax, rdx"),
    ("48 89 43 18", "mov [rbx+0x18], rax"),
    ("81 e1 ff 0f 00 00", "and ecx, 0xfff"),
    ("48 c1 e1 30", "shl rcx, 0x30"),
    ("48 b8 03 00 00 00 03 00 00 00", "mov rax, 0x300000003"),  # no registers bit
    ("48 0b c8", "or rcx, rax"),
    ("48 89 4b 08", "mov [rbx+8], rcx"),
    # Step 1: every status cleared (the slots are reused), r11 = b"KPFETCH!"
    ("48 c7 43 30 00 00 00 00", "mov qword ptr [rbx+0x30], 0"),
    ("48 c7 43 48 00 00 00 00", "mov qword ptr [rbx+0x48], 0"),
    ("48 c7 43 60 00 00 00 00", "mov qword ptr [rbx+0x60], 0"),
    ("49 bb 4b 50 46 45 54 43 48 21", "mov r11, 0x214843544546504b"),
    # Value(rdx): the program's rdx, saved in the frame
    ("48 8b 4c 24 28", "mov rcx, [rsp+0x28]"),
    ("48 89 4b 20", "mov [rbx+0x20], rcx"),
    # Bytes(rsi+16, 8 by 8): the address, then the copy with r10 at the fault label
    ("48 8b 7c 24 18", "mov rdi, [rsp+0x18]"),  # the program's rsi
    ("48 8d 7f 10", "lea rdi, [rdi+0x10]"),
    ("48 89 7b 28", "mov [rbx+0x28], rdi"),
    ("33 c9", "xor ecx, ecx"),
    ("4c 8d 15 1f 00 00 00", "lea r10, [0x4020f7]"),
    ("48 8b 04 0f", "mov rax, [rdi+rcx]"),  # the load that may fault
    ("48 89 84 0b 38 00 00 00", "mov [rbx+rcx+0x38], rax"),
    ("48 83 c1 08", "add rcx, 8"),
    ("48 81 f9 08 00 00 00", "cmp rcx, 8"),
    ("72 e7", "jb 0x4020d8"),
    ("48 89 4b 30", "mov [rbx+0x30], rcx"),  # status: 8 bytes
    ("eb 09", "jmp 0x402100"),
    ("48 0f ba e9 20", "bts rcx, 0x20"),  # 0x4020f7, the fault: the bytes before, FAULTED
    ("48 89 4b 30", "mov [rbx+0x30], rcx"),
    # Bytes(word 0 of capture 1, +8, 4 by 4): skipped unless that word was read
    ("8b 43 30", "mov eax, [rbx+0x30]"),
    ("81 f8 08 00 00 00", "cmp eax, 8"),
    ("72 3b", "jb 0x402146"),
    ("48 8b 7b 38", "mov rdi, [rbx+0x38]"),
    ("48 8d 7f 08", "lea rdi, [rdi+8]"),
    ("48 89 7b 40", "mov [rbx+0x40], rdi"),
    ("33 c9", "xor ecx, ecx"),
    ("4c 8d 15 1d 00 00 00", "lea r10, [0x40213d]"),
    ("8b 04 0f", "mov eax, [rdi+rcx]"),
    ("89 84 0b 50 00 00 00", "mov [rbx+rcx+0x50], eax"),
    ("48 83 c1 04", "add rcx, 4"),
    ("48 81 f9 04 00 00 00", "cmp rcx, 4"),
    ("72 e9", "jb 0x402120"),
    ("48 89 4b 48", "mov [rbx+0x48], rcx"),
    ("eb 09", "jmp 0x402146"),
    ("48 0f ba e9 20", "bts rcx, 0x20"),
    ("48 89 4b 48", "mov [rbx+0x48], rcx"),
    # String(rdi, 32): byte by byte, the NUL kept; at the limit, TRUNCATED
    ("48 8b 7c 24 10", "mov rdi, [rsp+0x10]"),  # the program's rdi, from the frame
    ("48 89 7b 58", "mov [rbx+0x58], rdi"),
    ("33 c9", "xor ecx, ecx"),
    ("4c 8d 15 26 00 00 00", "lea r10, [0x40217e]"),
    ("0f b6 04 0f", "movzx eax, byte ptr [rdi+rcx]"),
    ("88 84 0b 68 00 00 00", "mov [rbx+rcx+0x68], al"),
    ("48 ff c1", "inc rcx"),
    ("84 c0", "test al, al"),
    ("74 0e", "je 0x402178"),
    ("48 81 f9 20 00 00 00", "cmp rcx, 0x20"),
    ("72 e5", "jb 0x402158"),
    ("48 0f ba e9 21", "bts rcx, 0x21"),
    ("48 89 4b 60", "mov [rbx+0x60], rcx"),
    ("eb 09", "jmp 0x402187"),
    ("48 0f ba e9 20", "bts rcx, 0x20"),
    ("48 89 4b 60", "mov [rbx+0x60], rcx"),
    # the commit, the drop, the exit, the displaced prologue
    ("48 b9 01 00 00 00 00 00 50 4b", "mov rcx, 0x4b50000000000001"),
    ("48 03 ce", "add rcx, rsi"),
    ("48 89 0b", "mov [rbx], rcx"),
    ("eb 08", "jmp 0x4021a1"),
    ("f0 48 ff 05 1f df 1f 00", "lock inc qword ptr [0x6000c0]"),
    ("41 5b", "pop r11"),
    ("41 5a", "pop r10"),
    ("5f", "pop rdi"),
    ("5e", "pop rsi"),
    ("5b", "pop rbx"),
    ("5a", "pop rdx"),
    ("59", "pop rcx"),
    ("58", "pop rax"),
    ("80 c0 7f", "add al, 0x7f"),
    ("9e", "sahf"),
    ("58", "pop rax"),
    ("48 8d a4 24 88 00 00 00", "lea rsp, [rsp+0x88]"),
    ("55", "push rbp"),
    ("48 89 e5", "mov rbp, rsp"),
    ("48 83 ec 10", "sub rsp, 0x10"),
    ("e9 43 ee ff ff", "jmp 0x401008"),
]


def test_capture_listing() -> None:
    action = RecordAction(
        3,
        LAYOUT.ring_at(AREA),
        ThreadId.FS0,
        with_regs=False,
        plan=CAPTURE_PLAN,
        cpu_id=CpuId.RDTSCP,
        counter=0x500040,
    )
    assert (action.data_offset, action.size, action.slots) == (32, 136, 3)
    d = build_detour(D, region_of(FP_PROLOGUE), action)
    assert listing(d.code, D) == CAPTURE_LISTING


# ---- the code, run: the harness's memory as a model -------------------------------------------

# inspect's cases in detour_harness.c, by i % NCASES
GOOD, NUL_PTRS, GAP, INTO_GAP, EDGE, AT_LIMIT, LONGER, EMPTY, BUS = range(9)
NCASES = 9
CASE_NAMES = ["GOOD", "NUL_PTRS", "GAP", "INTO_GAP", "EDGE", "AT_LIMIT", "LONGER", "EMPTY", "BUS"]
PAGE = 4096
NONCANONICAL = 1 << 63
# struct inner: pad, value, h[3], b[4], pad2[2], words[2]; struct outer: id, i, inner, name,
# words[2]
INNER = struct.Struct("<QI3H4B2x2Q")
OUTER = struct.Struct("<6Q")
assert (INNER.size, OUTER.size) == (40, 48)


def letter(i: int) -> str:
    return chr(ord("a") + i % 26)


def inner_bytes(i: int, t: int) -> bytes:
    return INNER.pack(0, 7 * i & 0xFFFF_FFFF, i & 0xFFFF, t, 0xBEEF, 1, 2, 3, i & 0xFF, i, t)


def the_string(case: int, i: int, t: int, limit: int) -> bytes | None:
    """What s points to in the harness's string buffer (None: s points elsewhere)."""
    if case == GOOD:
        return f"call {i} of {t}".encode()
    lengths = {EDGE: limit - 1, AT_LIMIT: limit, LONGER: limit + 50, EMPTY: 0}
    return letter(i).encode() * lengths[case] if case in lengths else None


@dataclass
class Call:
    """inspect's call i on thread t: its registers and the memory a capture can read."""

    i: int
    t: int
    case: int
    regs: dict[str, int]
    regions: list[tuple[int, bytes]]

    def byte(self, addr: int) -> int | None:
        for start, data in self.regions:
            if start <= addr < start + len(data):
                return data[addr - start]
        return None

    def read(self, addr: int, size: int) -> bytes | None:
        out = bytearray()
        for k in range(size):
            b = self.byte((addr + k) & MASK)
            if b is None:
                return None
            out.append(b)
        return bytes(out)


def model(i: int, t: int, w: Worker, addrs: dict[str, int], limit: int) -> Call:
    """What detour_harness.c's setup() made of memory for call i on thread t."""
    case = i % NCASES
    gap, bus, edge = addrs["gap"], addrs["bus"], w.addrs["edge"]
    regions = [
        (gap - PAGE, bytes(PAGE - 10) + b"0123456789"),
        (gap + PAGE, bytes(PAGE)),
        (bus - PAGE, bytes(PAGE - 5) + b"abcde"),
        (addrs["bias"], (7).to_bytes(8, "little")),
        (w.addrs["name"], f"thread-{t}".encode() + b"\0"),
        (w.addrs["inner"], inner_bytes(i, t)),
    ]
    inner = w.addrs["inner"]
    if case == INTO_GAP:
        inner = 0
    elif case == EDGE:
        inner = edge + PAGE - 32
        regions.append((edge, bytes(PAGE - 32) + inner_bytes(i, t)[:32]))  # then PROT_NONE
    outer = OUTER.pack(t, i, inner, w.addrs["name"], i, ~i & MASK)
    regions.append((w.addrs["outer"], outer))
    s, o = w.addrs["str"], w.addrs["outer"]
    text = the_string(case, i, t, limit)
    if text is not None:
        regions.append((s, text + b"\0"))  # what lies past the NUL is not known
    if case == NUL_PTRS:
        s = o = 0
    elif case == GAP:
        s, o = gap, gap - 16
    elif case == INTO_GAP:
        s = gap - 10
    elif case == EMPTY:
        o = NONCANONICAL
    elif case == BUS:
        s, o = bus - 5, bus - 16
    return Call(i, t, case, {"rdi": s, "rsi": o, "rdx": i, "rcx": t}, regions)


Raw = int | tuple[int | None, int, bytes]  # a Value's word; (address, status, bytes)


def expect(plan: CapturePlan, call: Call) -> list[Raw]:
    """What each capture must hold after the hit: the capture's rules run on the model."""
    out: list[Raw] = []
    for c in plan.captures:
        if isinstance(c, Value):
            out.append(call.regs[c.reg.name])
            continue
        base = c.base
        if isinstance(base, Reg):
            addr = call.regs[base.name]
        elif isinstance(base, Const):
            addr = base.value
        else:
            src = out[base.capture]
            assert isinstance(src, tuple)
            if src[1] & COUNT_MASK < 8 * (base.index + 1):
                out.append((None, 0, b""))  # skipped: its address is not even written
                continue
            addr = int.from_bytes(src[2][8 * base.index : 8 * base.index + 8], "little")
        addr = (addr + c.offset) & MASK
        data = b""
        if isinstance(c, Bytes):
            status = c.size
            for k in range(0, c.size, c.elem):
                elem = call.read(addr + k, c.elem)
                if elem is None:
                    status = k | FAULTED
                    break
                data += elem
        else:
            while True:
                b = call.byte((addr + len(data)) & MASK)
                if b is None:
                    status = len(data) | FAULTED
                    break
                data += bytes([b])
                if b == 0:
                    status = len(data)
                    break
                if len(data) == c.limit:
                    status = len(data) | TRUNCATED
                    break
        out.append((addr, status, data))
    return out


def raw_captures(plan: CapturePlan, data: bytes) -> list[Raw]:
    out: list[Raw] = []
    for c, at in zip(plan.captures, plan.offsets(), strict=True):
        if isinstance(c, Value):
            out.append(int.from_bytes(data[at : at + 8], "little"))
            continue
        addr, status = struct.unpack_from("<QQ", data, at)
        count = status & COUNT_MASK
        out.append((addr if status else None, status, data[at + 16 : at + 16 + count]))
    return out


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return build_harness(tmp_path_factory.mktemp("capture"))


@pytest.fixture
def new_area() -> Iterator[Callable[[sa.AreaLayout], Area]]:
    made: list[Area] = []

    def make(layout: sa.AreaLayout) -> Area:
        made.append(create_area(layout))
        return made[-1]

    yield make
    for area in made:
        os.close(area.fd)


CALLS = 40 * NCASES  # per thread
LIMIT = 40  # the strings of the hand-made plans


@dataclass
class Hits:
    run: Run
    done: Finished
    plan: CapturePlan  # what the detour captured: the plan, and rdx if it had not
    records: list[sa.Record]
    calls: dict[int, Call]  # by record ticket


def run_inspect(
    harness: Harness,
    new_area: Callable[[sa.AreaLayout], Area],
    make_plan: Callable[[dict[str, int]], CapturePlan],
    threads: int,
    limit: int,
    *,
    with_regs: bool = False,
) -> Hits:
    """inspect() probed with a record of the plan (made once the harness's addresses are
    known), CALLS calls on each thread; every record matched with its call (rdx and the
    thread's fs base name it) and its raw captures checked against the model."""
    layout = sa.AreaLayout(ncounters=0, capacity=1 << 15)  # room for every call
    area = new_area(layout)
    run = launch(harness, "inspect", area, threads, CALLS, f"limit={limit}")
    plan = CapturePlan(list(make_plan(run.addrs).captures))
    i_at = plan.add(Value(RDX))  # last if it is new: the others keep their offsets
    ring = layout.ring_at(run.area)
    action = RecordAction(
        7, ring, THREAD_IDS[-1], with_regs=with_regs, plan=plan, cpu_id=BEST_CPU_ID
    )
    install(run, action)
    records, dropped = drain(run, area)
    done = finish(run)  # every result of inspect() was right
    assert dropped == 0 and len(records) == threads * CALLS
    thread_of = {w.fsbase: t for t, w in done.workers.items()}
    calls: dict[int, Call] = {}
    faulted = 0
    seen: dict[int, list[int]] = {t: [] for t in done.workers}
    for r in records:
        got = raw_captures(plan, r.data)
        i, t = got[i_at], thread_of[r.thread]
        assert isinstance(i, int)
        seen[t].append(i)
        call = model(i, t, done.workers[t], run.addrs, limit)
        if with_regs:
            assert r.regs is not None
            assert {reg: r.reg(reg) for reg in call.regs} == call.regs
        want = expect(plan, call)
        for c, g, w in zip(plan.captures, got, want, strict=True):
            assert g == w, (CASE_NAMES[call.case], i, t, c)
        faulted += sum(1 for g in got if isinstance(g, tuple) and g[1] & FAULTED)
        calls[r.ticket] = call
    assert all(s == list(range(CALLS)) for s in seen.values())
    assert done.fixups == faulted  # each fault went through the fixup, once
    return Hits(run, done, plan, records, calls)


def bias_plan(addrs: dict[str, int]) -> CapturePlan:
    """bias (a global long, 7) read through constants: as is, with an offset past rel32
    reach, as a negative number (its address minus 2**64), by 4-byte elements."""
    bias = addrs["bias"]
    return CapturePlan(
        [
            Bytes(Const(bias), 0, 8, 8),
            Bytes(Const(bias + (1 << 32)), -(1 << 32), 8, 8),
            Bytes(Const(bias - (1 << 64)), 0, 8, 4),
        ]
    )


PLANS: dict[str, Callable[[dict[str, int]], CapturePlan]] = {
    "strings": lambda _: CapturePlan(
        [Value(RDI), String(RDI, 0, LIMIT), Bytes(RSI, 24, 8, 8), String(Word(2), 0, LIMIT)]
    ),
    "chain": lambda _: CapturePlan(
        [Value(RSI), Bytes(RSI, 16, 8, 8), Bytes(Word(1), 8, 4, 4), Bytes(Word(1), 12, 6, 2)]
    ),
    "arrays": lambda _: CapturePlan(
        [Value(RCX), Bytes(RSI, 32, 16, 8), Bytes(RSI, 16, 8, 8), Bytes(Word(2), 24, 16, 8)]
    ),
    "offsets": lambda _: CapturePlan(
        [Bytes(RSI, 4, 6, 2), Bytes(RSI, 16, 8, 8), Bytes(Word(1), -8, 16, 8)]
    ),  # unaligned elements; a negative offset from a word read
    "constants": bias_plan,
}


def statuses(hits: Hits) -> dict[tuple[str, int], set[int]]:
    """The statuses seen, by case name and capture index."""
    out: dict[tuple[str, int], set[int]] = {}
    for r in hits.records:
        for k, raw in enumerate(raw_captures(hits.plan, r.data)):
            if isinstance(raw, tuple):
                out.setdefault((CASE_NAMES[hits.calls[r.ticket].case], k), set()).add(raw[1])
    return out


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("name", list(PLANS))
def test_captures_live(
    harness: Harness, new_area: Callable[[sa.AreaLayout], Area], name: str, threads: int
) -> None:
    hits = run_inspect(harness, new_area, PLANS[name], threads, LIMIT)
    seen = statuses(hits)
    # Beyond the model: the cases meant to reach each way a capture ends do reach it.
    if name == "strings":
        assert seen["GOOD", 1] == {i for i in seen["GOOD", 1] if 12 <= i <= 20}
        assert seen["EDGE", 1] == {LIMIT}  # the NUL is the limit-th byte
        assert seen["AT_LIMIT", 1] == seen["LONGER", 1] == {LIMIT | TRUNCATED}
        assert seen["INTO_GAP", 1] == {10 | FAULTED} and seen["BUS", 1] == {5 | FAULTED}
        assert seen["NUL_PTRS", 1] == seen["GAP", 1] == {FAULTED}
        assert seen["EMPTY", 1] == {1}
        assert seen["GOOD", 3] == {len("thread-0") + 1}  # through the pointer at +24
        assert seen["NUL_PTRS", 3] == seen["EMPTY", 3] == {0}  # skipped: no pointer read
    elif name == "chain":
        assert seen["GOOD", 2] == {4} and seen["GOOD", 3] == {6}
        assert seen["INTO_GAP", 1] == {8} and seen["INTO_GAP", 2] == {FAULTED}  # NULL + 8
        assert seen["GAP", 2] == seen["BUS", 2] == {0}
    elif name == "arrays":
        assert seen["EDGE", 3] == {8 | FAULTED}  # the second element is in a PROT_NONE page
        assert seen["GOOD", 1] == seen["GOOD", 3] == {16}
    elif name == "offsets":
        assert seen["GAP", 0] == {6} and seen["BUS", 0] == {6}  # next to the bad pages
        assert seen["GOOD", 2] == {16}  # outer.words[1], then inner.pad
    else:
        assert all(v == {8} for (_, k), v in seen.items() if k < 3)


# ---- the event: real specs, evaluated as reader.py does -----------------------------------

SPECS = [
    "a=+0(%di):string b=+8(+16(%si)):u32",
    "c=+12(+16(%si)):u16[3] d=+18(+16(%si)):u8[4] i=%dx:s64",
    "e=+24(+16(%si)):u64[2] t=$arg4",
    "n=+0(+24(%si)):string i=%dx",
    "x=+32(%si):x64[2] y=+8(%si):s32",
    "v=@bias:s64 s=+0(%di):x8 i=%dx",
]


def s32(data: bytes) -> int:
    return int.from_bytes(data, "little", signed=True)


def expected(name: str, call: Call) -> ArgValue:
    """What the program passed, as an event shows it (None: a fault)."""
    case, i, t = call.case, call.i, call.t
    outer_ok = case in (GOOD, INTO_GAP, EDGE, AT_LIMIT, LONGER)
    inner_ok = case in (GOOD, EDGE, AT_LIMIT, LONGER)
    text = the_string(case, i, t, STRING_LIMIT)
    match name:
        case "a":  # strings longer than the capture's limit are cut there
            return None if text is None else text[:STRING_LIMIT].decode()
        case "b":
            return 7 * i if inner_ok else None
        case "c":
            if case == INTO_GAP:
                return (None, None, None)  # the pointer was read: NULL
            return (i, t, 0xBEEF) if inner_ok else None
        case "d":
            if case == INTO_GAP:
                return (None,) * 4
            return (1, 2, 3, i & 0xFF) if inner_ok else None
        case "e":
            if case == INTO_GAP:
                return (None, None)
            if case == EDGE:
                return (i, None)
            return (i, t) if inner_ok else None
        case "n":
            return f"thread-{t}" if outer_ok else None
        case "x":  # the array's address comes from a register: each element faults
            return (i, ~i & MASK) if outer_ok else (None, None)
        case "y":
            if case == GAP:
                return s32(b"2345")  # at gap - 8
            if case == BUS:
                return s32(b"\0\0\0a")  # at bus - 8
            return i if outer_ok else None
        case "v":
            return 7
        case "s":
            first = {INTO_GAP: ord("0"), BUS: ord("a"), EMPTY: 0}
            if case in first:
                return first[case]
            return None if text is None else text[0]
        case "i":
            return i
        case "t":
            return t
    raise AssertionError(name)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("args", SPECS)
def test_events_of_an_optimized_probe(
    harness: Harness, new_area: Callable[[sa.AreaLayout], Area], args: str, threads: int
) -> None:
    spec = parse(f"p:g/e inspect {args}")
    resolvers: dict[str, Callable[[str], int]] = {}

    def make_plan(addrs: dict[str, int]) -> CapturePlan:
        resolvers["data"] = lambda sym: addrs[sym]
        return plan_captures([(spec, (resolvers["data"], no_file))])

    # With the registers, as records.equip() has every asynchronous handler's probe.
    hits = run_inspect(harness, new_area, make_plan, threads, STRING_LIMIT, with_regs=True)
    spec_plan = make_plan(hits.run.addrs)  # what reader.py reads the record with
    fetcher = ArgFetcher(spec, resolvers["data"], no_file)
    tids = {w.fsbase: 1000 + t for t, w in hits.done.workers.items()}
    for r in hits.records:
        # As RingReader._deliver: the registers the record has, the captured ones over them.
        captures = Captured(spec_plan, r.data)
        regs = Regs(tids[r.thread])
        assert r.regs is not None
        for reg, value in zip(sa.REG_ORDER, r.regs, strict=True):
            regs.words[REG_INDEX[reg]] = value
        for reg, value in captures.regs.items():
            regs.words[REG_INDEX[reg]] = value
        regs.words[REG_INDEX["rip"]] = hits.run.probe
        regs.words[REG_INDEX["fs_base"]] = r.thread
        memory = Memory(captures.read, captures.read_string, hex, lambda tid: "")
        event = fetcher.fetch(regs, memory)
        call = hits.calls[r.ticket]
        got = {a.name: a.value for a in event}
        want = {a.name: expected(a.name, call) for a in event}
        assert got == want, (CASE_NAMES[call.case], call.i, call.t)


def no_file(offset: int) -> int:
    raise AssertionError("no file offsets here")
