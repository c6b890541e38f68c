"""The compact frame tables (kprobes/symbols/frametable.py) against the full decoder.

Every FDE of real files is decoded by the trap tier's decoder (symbols/cfi_decode.py, through
pyelftools: ``find_fde``), and its rows translated into what a compact row must say, by the
rules written here a second time, apart from the compiler's: the CFA on rsp or rbp, the
return address at CFA-8 (or undefined: the outermost frame), rbp saved at CFA+n or left
alone; anything else (an expression, a signal frame, another register) must be a marker
row, never a wrong one. Both tables are functions of the address that change only at their
rows' starts, so comparing them at every start of either (and at every FDE's end) compares
them everywhere. The files: libc, the dynamic loader, libgcc_s, libpython3.11 if present,
and small programs built at -O2 with and without frame pointers (tests/programs/frames.c and
stacks.c, and libstk.so).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from support import symbol

from kprobes.symbols.cfa import Fde, Row, Rule
from kprobes.symbols.cfi import find_fde
from kprobes.symbols.ehframe import RawEhFrame
from kprobes.symbols.elf import read_sections
from kprobes.symbols.frametable import (
    ROW,
    FrameTable,
    Kind,
    TableRow,
    compile_eh_frame,
    compile_file,
    table_of,
)

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
LIBPYTHON = Path("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")
Info = tuple[Kind, int, int, int]  # kind, base, cfa_offset, rbp_offset


def expected(fde: Fde | None, vaddr: int) -> Info:
    """What the compact row at ``vaddr`` must say, from the full decode."""
    if fde is None:
        return (Kind.UNCOVERED, 0, 0, 0)
    row = fde.row_at(vaddr)
    assert row is not None
    return translate(fde, row)


def translate(fde: Fde, row: Row) -> Info:
    unsupported = (Kind.UNSUPPORTED, 0, 0, 0)
    if fde.is_signal_frame or fde.ra_column != 16:
        return unsupported
    if row.cfa_expr is not None or row.cfa_reg not in (6, 7) or 7 in row.rules:
        return unsupported
    ra = row.rules.get(16)
    if ra is None or ra[0] is Rule.UNDEFINED:
        return (Kind.OUTERMOST, 0, 0, 0)
    if ra != (Rule.OFFSET, -8):
        return unsupported
    rbp = row.rules.get(6)
    if rbp is None or rbp[0] is Rule.SAME_VALUE:
        return (Kind.CFA, row.cfa_reg, row.cfa_offset, 0)
    if rbp[0] is Rule.OFFSET and isinstance(rbp[1], int) and rbp[1] != 0:
        return (Kind.CFA, row.cfa_reg, row.cfa_offset, rbp[1])
    return unsupported


def info(row: TableRow) -> Info:
    return (row.kind, row.base, row.cfa_offset, row.rbp_offset)


def compare(path: Path, every: int = 1) -> tuple[FrameTable, dict[Kind, int]]:
    """Compare the table of ``path`` with the full decode at every row start of both and
    every FDE's end (every ``every``-th FDE of the file for the full decode's own rows);
    the number of rows of each kind."""
    table = compile_file(str(path))
    assert len(table) > 0
    address, data = read_sections(str(path), (".eh_frame",))[".eh_frame"]
    points = {table.starts[i] for i in range(len(table))}
    for n, raw in enumerate(RawEhFrame(data, address).iter_fdes()):
        if n % every == 0 and raw.end > raw.start:
            fde = find_fde(str(path), raw.start)
            assert fde is not None, hex(raw.start)
            points.update(fde.pcs)
            points.add(fde.end)
    wrong = []
    for vaddr in sorted(points):
        want = expected(find_fde(str(path), vaddr), vaddr)
        got = info(table.row_at(vaddr))
        if got != want:
            wrong.append(f"{vaddr:#x}: table {got}, decoder {want}")
    assert not wrong, "\n".join(wrong[:20])
    kinds = {k: 0 for k in Kind}
    for i in range(len(table)):
        kinds[table.row(i).kind] += 1
    return table, kinds


def test_libc_agrees_with_the_full_decoder() -> None:
    _, kinds = compare(LIBC)
    # libc has every kind: the PLT's CFA expression and the signal trampoline are markers,
    # _start's and clone's undefined return address the outermost frames.
    assert all(kinds[k] for k in Kind), kinds
    assert kinds[Kind.UNSUPPORTED] < kinds[Kind.CFA] // 100, kinds


@pytest.mark.parametrize(
    "path", ["/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libgcc_s.so.1"]
)
def test_hand_written_unwind_info_agrees(path: str) -> None:
    """The dynamic loader's and libgcc's assembly carry CFI written by hand (the loader's
    trampolines, libgcc's stack probes): markers where the rows cannot follow, never a wrong
    row."""
    _, kinds = compare(Path(path))
    assert kinds[Kind.UNSUPPORTED] > 0, kinds


@pytest.mark.skipif(not LIBPYTHON.exists(), reason="libpython3.11 is not installed")
def test_libpython_agrees_with_the_full_decoder() -> None:
    compare(LIBPYTHON, every=3)


@pytest.mark.parametrize("name", ["frames", "frames-fp", "stacks", "stacks-fp", "libstk.so"])
def test_programs_agree_with_the_full_decoder(build: Callable[[str], Path], name: str) -> None:
    _, kinds = compare(build(name))
    assert kinds[Kind.CFA] > 0, kinds
    if not name.endswith(".so"):
        assert kinds[Kind.OUTERMOST] > 0, kinds  # _start's


def test_frame_pointer_code_has_rbp_based_rows(build: Callable[[str], Path]) -> None:
    """With frame pointers, a function's body finds its CFA from rbp (and rbp saved at
    CFA-16); without, from rsp, except where alloca moves rsp (``grow``)."""

    def bases(name: str, function: str) -> set[int]:
        path = build(name)
        sym = symbol(path, function)
        table = table_of(str(path))
        return {
            table.row_at(a).base
            for a in range(sym.value, sym.value + sym.size)
            if table.row_at(a).kind is Kind.CFA
        }

    assert bases("frames-fp", "deep") == {6, 7}
    assert bases("frames", "deep") == {7}
    assert bases("frames", "grow") == {6, 7}


# -- hand-written tables ---------------------------------------------------------------------


def cie(instructions: bytes, augmentation: bytes = b"zR") -> bytes:
    """A CIE (version 1, code alignment 1, data alignment -8, return column 16, FDE
    pointers pcrel sdata4) with these initial instructions."""
    body = b"\0\0\0\0\x01" + augmentation + b"\0\x01\x78\x10"
    if augmentation.startswith(b"z"):
        body += b"\x01\x1b"
    body += instructions
    body += b"\0" * (-(len(body) + 4) % 8)
    return struct.pack("<I", len(body)) + body


def fde(section: bytes, start: int, size: int, instructions: bytes, address: int) -> bytes:
    """``section`` with an FDE for [start, start+size) appended (its CIE at offset 0)."""
    pos = len(section)
    pointer = start - (address + pos + 8)
    body = struct.pack("<Iii", pos + 4, pointer, size) + b"\0" + instructions
    body += b"\0" * (-(len(body) + 4) % 8)
    return section + struct.pack("<I", len(body)) + body


CIE_RSP8 = b"\x0c\x07\x08\x90\x01"  # def_cfa rsp+8; offset ra at cfa-8


def rows(table: FrameTable) -> list[tuple[int, Info]]:
    return [(table.starts[i], info(table.row(i))) for i in range(len(table))]


def test_state_is_remembered_and_restored_with_the_cfa() -> None:
    address = 0x1000
    insns = bytes(
        [
            0x41, 0x0E, 0x10, 0x86, 0x02,  # +1: cfa rsp+16; rbp at cfa-16
            0x41, 0x0A,  # +1: remember
            0x0E, 0x08, 0xC6,  # cfa rsp+8; rbp restored (to no rule)
            0x41, 0x0B,  # +1: restore: cfa rsp+16, rbp at cfa-16 again
            0x41, 0x07, 0x10,  # +1: ra undefined
        ]
    )  # fmt: skip
    data = fde(cie(CIE_RSP8), 0x2000, 0x10, insns, address)
    table = compile_eh_frame(data + b"\0" * 4, address)
    assert rows(table) == [
        (0x2000, (Kind.CFA, 7, 8, 0)),
        (0x2001, (Kind.CFA, 7, 16, -16)),
        (0x2002, (Kind.CFA, 7, 8, 0)),
        (0x2003, (Kind.CFA, 7, 16, -16)),
        (0x2004, (Kind.OUTERMOST, 0, 0, 0)),
        (0x2010, (Kind.UNCOVERED, 0, 0, 0)),
    ]
    assert table.row_at(0x1FFF).kind is Kind.UNCOVERED
    assert table.row_at(0x200F) == TableRow(0x2004, Kind.OUTERMOST)
    assert len(table.to_bytes()) == len(table) * (4 + ROW.size)


@pytest.mark.parametrize(
    ("insns", "why"),
    [
        (b"\x41\x0f\x02\x77\x08", "a CFA expression"),
        (b"\x41\x0d\x03", "a CFA on rbx"),
        (b"\x41\x08\x10", "the return address's same value"),
        (b"\x41\x09\x06\x03", "rbp in rbx"),
        (b"\x41\x10\x06\x02\x77\x08", "rbp at an expression"),
        (b"\x41\x14\x07\x00", "a rule for rsp"),
        (b"\x41\x3f", "an opcode of no x86-64 program"),
    ],
)
def test_what_the_rows_cannot_say_is_a_marker(insns: bytes, why: str) -> None:
    address = 0x1000
    data = fde(cie(CIE_RSP8), 0x2000, 0x10, insns, address)
    table = compile_eh_frame(data, address)
    kinds = [k for _, (k, *_) in rows(table)]
    if why.startswith("an opcode"):  # the whole FDE, its instructions cannot be read on
        assert kinds == [Kind.UNSUPPORTED, Kind.UNCOVERED], why
    else:
        assert kinds == [Kind.CFA, Kind.UNSUPPORTED, Kind.UNCOVERED], why


def test_a_signal_frame_is_a_marker_and_later_fdes_win() -> None:
    address = 0x1000
    data = cie(CIE_RSP8)
    signal = cie(CIE_RSP8, b"zRS")
    data = fde(data, 0x2000, 0x20, b"", address)
    data = fde(data, 0x2010, 0x8, b"\x41\x0e\x10", address)  # overlaps the first's end
    at = len(data)
    data += signal
    body = fde(b"\0" * at, 0x3000, 0x8, b"", address)[at:]
    # Point the last FDE at the signal CIE: its CIE pointer is relative to its own field.
    body = body[:4] + struct.pack("<I", len(data) + 4 - at) + body[8:]
    body = body[:8] + struct.pack("<i", 0x3000 - (address + len(data) + 8)) + body[12:]
    table = compile_eh_frame(data + body, address)
    assert rows(table) == [
        (0x2000, (Kind.CFA, 7, 8, 0)),
        (0x2011, (Kind.CFA, 7, 16, 0)),  # the later FDE from its start (its first row is
        (0x2018, (Kind.UNCOVERED, 0, 0, 0)),  # the same as the earlier's), until its end
        (0x3000, (Kind.UNSUPPORTED, 0, 0, 0)),
        (0x3008, (Kind.UNCOVERED, 0, 0, 0)),
    ]
