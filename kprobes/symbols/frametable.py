"""Compact frame tables: a file's ``.eh_frame`` compiled into CFA-only rows, SFrame-like.

A stack walked inside the program (the fast tier's detour, issue 23 item 5) cannot run the
DWARF call frame instructions, and a Python walker should not have to either. Nearly every
row of x86-64 code says one of a few things: the Canonical Frame Address is ``rsp`` or ``rbp``
plus a constant, the return address is at CFA-8, and ``rbp`` is saved at CFA plus a constant
or not touched. This module runs every FDE's instructions once, keeps only those three
facts, and writes one row per address range where they change (the kernel's SFrame format
keeps the same facts, for the same reason). What the rows cannot say is not guessed: a
row whose CFA is a DWARF expression (the PLT, a realigned ``main``) or another register, a
signal frame, a return address anywhere but CFA-8, ``rbp`` saved another way, becomes an
``UNSUPPORTED`` row, where a walk ends with a marker. A row whose return address is
undefined (``_start``, ``clone``) is ``OUTERMOST``: the walk is complete there. Addresses no
FDE covers are ``UNCOVERED`` rows (the walker tries the frame pointer there, as unwind.py does).

**The instructions are interpreted here**, over the raw bytes (ehframe.py finds the CIEs and
FDEs), not through pyelftools: its decode of one FDE costs ~0.6 ms, 2.4 s for libc's 3,713,
while this loop keeps three registers' rules and reads each byte once (docs/performance.md).
``cfi_decode.py`` (pyelftools) remains the reference; tests/symbols/test_frametable.py
checks every row against it.

The table is two arrays: the rows' start addresses (``u32``, link-time, sorted: one
bisection finds a row, in Python or in machine code), and the rows (8 bytes each: CFA
offset ``i32``, ``rbp``'s offset from the CFA ``i16``, 0 meaning not saved, the CFA's base
register ``u8``, the kind ``u8``). A row holds until the next row's start. Files are
compiled once per file identity (path, inode, mtime) in a process.

Rows that differ only in where another register (``rbx``, ``r12``) was saved are one row:
libc's 3,713 FDEs give 28,274 rows (24,861 CFA rows, 3,404 gaps between functions, 7
markers: the PLT's CFA expression, the signal trampoline), 339 KB.

Rejected: keeping every register's rule (the walk needs no other register: a CFA based on
one is a marker); pyelftools with a cache on disk (the first attach to a program still pays
seconds per library, and the decode keeps what the rows drop).
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
from array import array
from enum import IntEnum
from typing import Final

from kprobes.symbols.ehframe import Cie, RawEhFrame, RawFde
from kprobes.symbols.elf import read_sections
from kprobes.values import dataclass

RBP: Final = 6  # DWARF register numbers (System V psABI, figure 3.36)
RSP: Final = 7
RA: Final = 16
RA_OFFSET: Final = -8  # where a call leaves the return address: just below the CFA
ROW: Final = struct.Struct("<ihBB")  # cfa_offset, rbp_offset, base, kind
_MAX_ADDRESS: Final = 1 << 32


class Kind(IntEnum):
    """What a row says."""

    CFA = 0  # CFA = base + cfa_offset; return address at CFA-8; rbp at CFA + rbp_offset
    OUTERMOST = 1  # the return address is undefined: the outermost frame
    UNSUPPORTED = 2  # a rule these rows cannot express: the walk ends with a marker
    UNCOVERED = 3  # no FDE covers these addresses


@dataclass(frozen=True, slots=True)
class TableRow:
    """One row, decoded; valid from ``start`` to the next row's start."""

    start: int
    kind: Kind
    base: int = 0  # RSP or RBP, for Kind.CFA
    cfa_offset: int = 0
    rbp_offset: int = 0  # rbp's caller value is at CFA + rbp_offset; 0: rbp is unchanged


_Info = tuple[int, int, int, int]  # (cfa_offset, rbp_offset, base, kind): ROW's fields
_UNSUPPORTED: Final[_Info] = (0, 0, 0, Kind.UNSUPPORTED)
_OUTERMOST: Final[_Info] = (0, 0, 0, Kind.OUTERMOST)
_UNCOVERED: Final[_Info] = (0, 0, 0, Kind.UNCOVERED)


class FrameTable:
    """The compact rows of one file, by link-time address."""

    def __init__(self, starts: array[int], rows: bytes) -> None:
        if len(rows) != ROW.size * len(starts):
            raise ValueError(f"{len(starts)} starts and {len(rows)} bytes of rows")
        self.starts = starts
        self.rows = rows

    def __len__(self) -> int:
        return len(self.starts)

    def row_at(self, vaddr: int) -> TableRow:
        """The row holding link-time address ``vaddr`` (UNCOVERED before the first row)."""
        index = bisect.bisect_right(self.starts, vaddr) - 1
        if index < 0:
            return TableRow(vaddr, Kind.UNCOVERED)
        return self.row(index)

    def row(self, index: int) -> TableRow:
        cfa_offset, rbp_offset, base, kind = ROW.unpack_from(self.rows, ROW.size * index)
        return TableRow(self.starts[index], Kind(kind), base, cfa_offset, rbp_offset)

    def to_bytes(self) -> bytes:
        """The table as the program's walker reads it: the starts, then the rows."""
        return self.starts.tobytes() + self.rows


# -- the compiler --------------------------------------------------------------------------


def compile_eh_frame(data: bytes, address: int) -> FrameTable:
    """The compact table of the ``.eh_frame`` section ``data`` loaded at ``address``."""
    raw = RawEhFrame(data, address)
    fdes = sorted(
        (fde for fde in raw.iter_fdes() if fde.end > fde.start), key=lambda f: f.start
    )  # sorted is stable: of two FDEs at one start, the later one in the section wins
    out = _Rows()
    for fde in fdes:
        if fde.end > _MAX_ADDRESS:
            break
        out.cut(fde.start)
        if fde.cie.is_signal_frame or fde.cie.ra_column != RA:
            out.add(fde.start, _UNSUPPORTED)
        else:
            _Interpreter(raw, fde, out).run()
        out.add(fde.end, _UNCOVERED)
    return out.table()


class _Rows:
    """The rows being written: merged when equal, later FDEs overriding earlier ones."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.infos: list[_Info] = []

    def cut(self, start: int) -> None:
        """A new FDE at ``start``: the rows of earlier ones from there on are dropped (the
        one with the greatest start holding an address is the one found, as in cfi.py)."""
        while self.starts and self.starts[-1] >= start:
            self.starts.pop()
            self.infos.pop()

    def add(self, start: int, info: _Info) -> None:
        if self.starts and self.starts[-1] == start:
            self.starts.pop()  # the previous row covered nothing
            self.infos.pop()
        if self.infos and self.infos[-1] == info:
            return
        self.starts.append(start)
        self.infos.append(info)

    def table(self) -> FrameTable:
        rows = b"".join(ROW.pack(*info) for info in self.infos)
        return FrameTable(array("I", self.starts), rows)


# The state of one row: CFA register (None: none, or an expression), CFA offset, and the
# rules of the return address, rbp and rsp as (how, offset) with how one of these:
_NONE: Final = 0  # no rule (rbp, rsp: unchanged; the return address: undefined)
_AT: Final = 1  # saved at CFA + offset
_UNDEF: Final = 2
_OTHER: Final = 3  # same value, register, val_offset, expressions: what a row cannot say
_SAME: Final = 4
_Rule = tuple[int, int]
_State = tuple[int | None, int, _Rule, _Rule, _Rule]  # cfa_reg, cfa_offset, ra, rbp, rsp
_TRACKED: Final = (RA, RBP, RSP)


def _classify(state: _State) -> _Info:
    """What a row with this state says in the compact form (the order of the checks is the
    walk's: the CFA, then the return address, then rbp)."""
    cfa_reg, cfa_offset, ra, rbp, rsp = state
    if cfa_reg not in (RSP, RBP) or not -(1 << 31) <= cfa_offset < 1 << 31:
        return _UNSUPPORTED
    if rsp[0] != _NONE:
        return _UNSUPPORTED  # the caller's rsp would not be the CFA
    if ra[0] in (_NONE, _UNDEF):
        return _OUTERMOST
    if ra != (_AT, RA_OFFSET):
        return _UNSUPPORTED
    if rbp[0] in (_NONE, _SAME):
        return (cfa_offset, 0, cfa_reg, Kind.CFA)
    if rbp[0] != _AT or rbp[1] == 0 or not -(1 << 15) <= rbp[1] < 1 << 15:
        return _UNSUPPORTED
    return (cfa_offset, rbp[1], cfa_reg, Kind.CFA)


class _Unreadable(Exception):
    """An FDE whose instructions this interpreter cannot read to the end."""


class _Interpreter:
    """The DWARF call frame instructions of one FDE (DWARF 5, §6.4.2), for three registers."""

    def __init__(self, raw: RawEhFrame, fde: RawFde, out: _Rows) -> None:
        self.raw = raw
        self.fde = fde
        self.cie: Cie = fde.cie
        self.out = out
        self.pc = fde.start
        self.cfa_reg: int | None = None
        self.cfa_offset = 0
        self.rules: dict[int, _Rule] = {}
        self.initial: dict[int, _Rule] = {}
        self.saved: list[tuple[int | None, int, dict[int, _Rule]]] = []
        self.emitting = False

    def run(self) -> None:
        """Step 1: the CIE's initial instructions (their rules are what ``restore`` returns
        to); Step 2: the FDE's, each advance closing a row; Step 3: the last row."""
        cie, fde = self.cie, self.fde
        try:
            self.execute(cie.initial, cie.initial_end)
            self.initial = dict(self.rules)
            self.emitting = True
            self.execute(fde.insns, fde.insns_end)
        except (_Unreadable, IndexError, struct.error):
            self.out.cut(fde.start)
            self.out.add(fde.start, _UNSUPPORTED)
            return
        self.close_row()

    def state(self) -> _State:
        rules = self.rules
        none = (_NONE, 0)
        return (
            self.cfa_reg,
            self.cfa_offset,
            rules.get(RA, none),
            rules.get(RBP, none),
            rules.get(RSP, none),
        )

    def close_row(self) -> None:
        if self.emitting and self.pc < self.fde.end:
            self.out.add(self.pc, _classify(self.state()))

    def advance(self, to: int) -> None:
        if to < self.pc:
            raise _Unreadable  # rows out of order (a set_loc backwards)
        self.close_row()
        self.pc = to

    def set_rule(self, reg: int, rule: _Rule) -> None:
        if reg in _TRACKED:
            self.rules[reg] = rule

    def restore(self, reg: int) -> None:
        if reg in self.initial:
            self.rules[reg] = self.initial[reg]
        else:
            self.rules.pop(reg, None)

    def execute(self, pos: int, end: int) -> None:
        data = self.raw.data
        code_align, data_align = self.cie.code_align, self.cie.data_align
        while pos < end:
            op = data[pos]
            pos += 1
            high = op & 0xC0
            if high == 0x40:  # advance_loc
                self.advance(self.pc + (op & 0x3F) * code_align)
            elif high == 0x80:  # offset
                value, pos = _uleb(data, pos)
                self.set_rule(op & 0x3F, (_AT, value * data_align))
            elif high == 0xC0:  # restore
                self.restore(op & 0x3F)
            else:
                pos = self.extended(op, data, pos)

    def extended(self, op: int, data: bytes, pos: int) -> int:
        """One instruction of the primary opcode ``op`` (its operands at ``pos``); returns
        where the next one starts."""
        data_align = self.cie.data_align
        if op in _ADVANCES:
            size = _ADVANCES[op]
            delta = int.from_bytes(data[pos : pos + size], "little")
            self.advance(self.pc + delta * self.cie.code_align)
            return pos + size
        if op in _ONE_ULEB:  # the CFA's register or offset, a rule without operand, args_size
            value, pos = _uleb(data, pos)
            self.one_operand(op, value)
            return pos
        if op in _TWO_OPERANDS:
            reg, pos = _uleb(data, pos)
            signed = _TWO_OPERANDS[op]
            value, pos = _sleb(data, pos) if signed else _uleb(data, pos)
            self.two_operands(op, reg, value, data_align)
            return pos
        if op in (0x0F, 0x10, 0x16):  # def_cfa_expression, expression, val_expression
            reg = -1
            if op != 0x0F:
                reg, pos = _uleb(data, pos)
            length, pos = _uleb(data, pos)
            if op == 0x0F:
                self.cfa_reg, self.cfa_offset = None, 0
            else:
                self.set_rule(reg, (_OTHER, 0))
            return pos + length
        if op == 0x13:  # def_cfa_offset_sf
            value, pos = _sleb(data, pos)
            self.cfa_offset = value * data_align
            return pos
        return self.state_op(op, pos)

    def one_operand(self, op: int, value: int) -> None:
        match op:
            case 0x0D:  # def_cfa_register
                self.cfa_reg = value
            case 0x0E:  # def_cfa_offset
                self.cfa_offset = value
            case 0x06:  # restore_extended
                self.restore(value)
            case 0x07:  # undefined
                self.set_rule(value, (_UNDEF, 0))
            case 0x08:  # same_value
                self.set_rule(value, (_SAME, 0))
            case _:  # GNU_args_size: nothing for the CFA
                pass

    def two_operands(self, op: int, reg: int, value: int, data_align: int) -> None:
        match op:
            case 0x0C:  # def_cfa
                self.cfa_reg, self.cfa_offset = reg, value
            case 0x12:  # def_cfa_sf
                self.cfa_reg, self.cfa_offset = reg, value * data_align
            case 0x05 | 0x11:  # offset_extended, offset_extended_sf
                self.set_rule(reg, (_AT, value * data_align))
            case 0x2F:  # GNU_negative_offset_extended
                self.set_rule(reg, (_AT, -value * data_align))
            case _:  # register, val_offset, val_offset_sf
                self.set_rule(reg, (_OTHER, 0))

    def state_op(self, op: int, pos: int) -> int:
        match op:
            case 0x00:  # nop
                pass
            case 0x01:  # set_loc
                to = self.raw.pointer(pos, self.cie.fde_encoding)
                if to is None:
                    raise _Unreadable
                self.advance(to)
                return _pointer_end(self.raw.data, pos, self.cie.fde_encoding)
            case 0x0A:  # remember_state
                self.saved.append((self.cfa_reg, self.cfa_offset, dict(self.rules)))
            case 0x0B:  # restore_state
                if self.saved:
                    self.cfa_reg, self.cfa_offset, self.rules = self.saved.pop()
            case _:
                raise _Unreadable  # an opcode of another architecture, or none
        return pos


_ADVANCES: Final = {0x02: 1, 0x03: 2, 0x04: 4}  # advance_loc1, 2, 4: operand size
_ONE_ULEB: Final = frozenset({0x06, 0x07, 0x08, 0x0D, 0x0E, 0x2E})
_TWO_OPERANDS: Final = {  # opcode: is the second operand signed
    0x05: False, 0x09: False, 0x0C: False, 0x11: True, 0x12: True,
    0x14: False, 0x15: True, 0x2F: False,
}  # fmt: skip
_FIXED_SIZES: Final = {0x00: 8, 0x02: 2, 0x03: 4, 0x04: 8, 0x0A: 2, 0x0B: 4, 0x0C: 8}


def _pointer_end(data: bytes, pos: int, encoding: int) -> int:
    size = _FIXED_SIZES.get(encoding & 0x0F)
    if size is None:
        raise _Unreadable  # a LEB128 address in set_loc: not written by any toolchain
    return pos + size


def _uleb(data: bytes, pos: int) -> tuple[int, int]:
    byte = data[pos]
    if byte < 0x80:  # the common case: one byte
        return byte, pos + 1
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _sleb(data: bytes, pos: int) -> tuple[int, int]:
    start = pos
    value, pos = _uleb(data, pos)
    bits = 7 * (pos - start)
    if value & (1 << (bits - 1)):
        value -= 1 << bits
    return value, pos


# -- the files -----------------------------------------------------------------------------

_CacheKey = tuple[str, int, int, int, int]
_cache: dict[_CacheKey, FrameTable] = {}
_cache_lock = threading.Lock()
_EMPTY: Final = FrameTable(array("I"), b"")


def compile_file(path: str) -> FrameTable:
    """The compact table of the ``.eh_frame`` of the ELF file at ``path`` (empty without
    one, or for a file that cannot be read)."""
    try:
        found = read_sections(path, (".eh_frame",))
    except (OSError, ValueError, struct.error):
        return _EMPTY
    if ".eh_frame" not in found:
        return _EMPTY
    address, data = found[".eh_frame"]
    return compile_eh_frame(data, address)


def table_of(path: str) -> FrameTable:
    """``compile_file(path)``, once per file identity."""
    try:
        st = os.stat(path)
    except OSError:
        return _EMPTY
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    table = compile_file(path)
    with _cache_lock:
        return _cache.setdefault(key, table)
