"""Decoding and the instruction-boundary check, on a hand-assembled function."""

from __future__ import annotations

import errno

import pytest

from kprobes.arch.x86_64.decode import MAX_INSN_LEN, Insn, check_boundary, decode_at, iter_insns
from kprobes.errors import NotABoundary

FUNC = 0x401130
# (address, bytes, iced text) of a small function, as objdump -d -M intel shows it.
LISTING = [
    (0x401130, "f3 0f 1e fa", "endbr64"),
    (0x401134, "8b 05 e4 2e 00 00", "mov eax, [rip+0x2ee4]"),
    (0x40113A, "55", "push rbp"),
    (0x40113B, "48 89 e5", "mov rbp, rsp"),
    (0x40113E, "41 54", "push r12"),
    (0x401140, "48 83 ec 10", "sub rsp, 0x10"),
    (0x401144, "74 05", "je 0x40114b"),
    (0x401146, "e8 b5 fe ff ff", "call 0x401000"),
    (0x40114B, "c9", "leave"),
    (0x40114C, "c3", "ret"),
]
CODE = b"".join(bytes.fromhex(raw) for _, raw, _ in LISTING)


def test_listing_is_contiguous() -> None:
    ends = [addr + len(bytes.fromhex(raw)) for addr, raw, _ in LISTING]
    assert [addr for addr, _, _ in LISTING[1:]] == ends[:-1]


@pytest.mark.parametrize(("addr", "raw", "text"), LISTING)
def test_decode_at(addr: int, raw: str, text: str) -> None:
    offset = addr - FUNC
    insn = decode_at(CODE[offset:], addr)
    assert insn == Insn(addr, len(bytes.fromhex(raw)), bytes.fromhex(raw), text)
    assert insn.end == addr + insn.length


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("06", "not a valid instruction"),  # push es: invalid in 64-bit mode
        ("ce", "not a valid instruction"),  # into: invalid in 64-bit mode
        ("48 8b", "cut short"),  # mov rax, ... without its ModRM
        ("", "cut short"),
    ],
)
def test_decode_at_invalid(raw: str, why: str) -> None:
    with pytest.raises(NotABoundary, match=why) as info:
        decode_at(bytes.fromhex(raw), 0x1000)
    assert info.value.errno == errno.EILSEQ
    assert "0x1000" in str(info.value)


def test_decode_at_reads_at_most_one_instruction() -> None:
    long_nop = bytes.fromhex("66 2e 0f 1f 84 00 00 00 00 00")
    insn = decode_at(long_nop + b"\x90" * 20, 0x2000)
    assert insn.length == len(long_nop)
    assert insn.code == long_nop
    assert MAX_INSN_LEN == 15


def test_iter_insns_sweeps_the_function() -> None:
    got = [(i.addr, i.code.hex(" "), i.text) for i in iter_insns(CODE, FUNC)]
    assert got == LISTING


def test_iter_insns_drops_a_truncated_tail() -> None:
    got = list(iter_insns(CODE[:-1] + b"\x48\x8b", FUNC))
    assert [i.addr for i in got] == [addr for addr, _, _ in LISTING[:-1]]


def test_iter_insns_raises_on_an_invalid_instruction() -> None:
    code = bytes.fromhex("55 06 c3")
    it = iter_insns(code, 0x3000)
    assert next(it).text == "push rbp"
    with pytest.raises(NotABoundary, match="0x3001"):
        next(it)


@pytest.mark.parametrize(("addr", "raw", "text"), LISTING)
def test_check_boundary_accepts_each_start(addr: int, raw: str, text: str) -> None:
    insn = check_boundary(CODE, FUNC, addr)
    assert (insn.addr, insn.code, insn.text) == (addr, bytes.fromhex(raw), text)


def test_check_boundary_names_the_straddling_instruction() -> None:
    with pytest.raises(NotABoundary) as info:
        check_boundary(CODE, FUNC, 0x401136)
    assert str(info.value) == (
        "0x401136 is not an instruction boundary: it is inside "
        "`mov eax, [rip+0x2ee4]` at 0x401134 (6 bytes)"
    )
    assert info.value.errno == errno.EILSEQ


@pytest.mark.parametrize(
    "addr",
    [a + k for a, raw, _ in LISTING for k in range(1, len(bytes.fromhex(raw)))],
)
def test_check_boundary_rejects_every_inner_byte(addr: int) -> None:
    with pytest.raises(NotABoundary, match="is not an instruction boundary"):
        check_boundary(CODE, FUNC, addr)


def test_check_boundary_reports_an_invalid_instruction_before_addr() -> None:
    code = bytes.fromhex("55 06 48 89 e5 c3")
    with pytest.raises(NotABoundary, match="invalid instruction at 0x5001") as info:
        check_boundary(code, 0x5000, 0x5002)
    assert info.value.errno == errno.EILSEQ


def test_check_boundary_reports_an_invalid_instruction_at_addr() -> None:
    with pytest.raises(NotABoundary, match="at 0x5001 are not a valid instruction"):
        check_boundary(bytes.fromhex("55 06 c3"), 0x5000, 0x5001)


@pytest.mark.parametrize("addr", [FUNC - 1, FUNC + len(CODE)])
def test_check_boundary_outside_the_code(addr: int) -> None:
    with pytest.raises(NotABoundary, match="outside"):
        check_boundary(CODE, FUNC, addr)
