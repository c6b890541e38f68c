"""Call frame information: the unwind tables of one ELF file, decoded into rows.

The other half of ``unwind.py`` (which walks a stack with these rows). An FDE is found by one
bisection of ``.eh_frame_hdr``'s search table and parsed alone; files without that table,
and ``.debug_frame``, are indexed in full once. The rows of an FDE come from our own
interpreter of its instructions, not from pyelftools' ``get_decoded()``, which rejects
``DW_CFA_GNU_args_size`` and scales ``DW_CFA_def_cfa_sf`` by the wrong factor. Everything is
cached per file identity (path, inode, mtime) and shared by every process that maps the file.
"""

from __future__ import annotations

import bisect
import io
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct.core import ConstructError
from elftools.dwarf.callframe import FDE, CallFrameInfo
from elftools.dwarf.constants import DW_CFA
from elftools.dwarf.structs import DWARFStructs
from elftools.elf.elffile import ELFFile

from kprobes.symbols.ehframe import FdeHeader, RawEhFrame

# -- decoded unwind tables -----------------------------------------------------------------


class Rule(Enum):
    """DWARF register rules (DWARF 5, §6.4.1); a callee-saved register without one keeps
    its value in the caller, any other is lost."""

    UNDEFINED = "undefined"
    SAME_VALUE = "same value"
    OFFSET = "offset"  # saved at CFA + n
    VAL_OFFSET = "val_offset"  # the value is CFA + n
    REGISTER = "register"  # saved in register n
    EXPRESSION = "expression"  # saved at the address the expression computes
    VAL_EXPRESSION = "val_expression"  # the value is what the expression computes


RegRule = tuple[Rule, int | bytes]


@dataclass(frozen=True, slots=True)
class Row:
    """One row of an FDE's table, valid from ``pc`` to the next row's pc."""

    pc: int  # link-time address
    cfa_reg: int | None  # CFA = value of cfa_reg + cfa_offset ...
    cfa_offset: int
    cfa_expr: bytes | None  # ... or the value of this expression
    rules: Mapping[int, RegRule]


@dataclass(frozen=True, slots=True)
class Fde:
    """The decoded table of one function's unwind information."""

    start: int
    end: int
    is_signal_frame: bool  # CIE augmentation "S": pc is the interrupted instruction itself
    ra_column: int
    pcs: tuple[int, ...]
    rows: tuple[Row, ...]
    lsda: int | None = None  # link-time address of its exception table (lsda.py), if any

    def row_at(self, vaddr: int) -> Row | None:
        index = bisect.bisect_right(self.pcs, vaddr) - 1
        return self.rows[index] if index >= 0 else None


class _Cfi:
    """The FDEs of one section (``.eh_frame`` or ``.debug_frame``), sorted by start."""

    def __init__(
        self,
        info: CallFrameInfo,
        starts: list[int],
        offsets: list[int],
        raw: RawEhFrame | None = None,
    ) -> None:
        self._info = info
        self._starts = starts
        self._offsets = offsets
        self._raw = raw  # .eh_frame's headers, read without decoding the FDEs
        self._decoded: dict[int, Fde | None] = {}  # by offset; None for an unusable entry
        self._lock = threading.Lock()  # pyelftools parses from one shared stream

    def find(self, vaddr: int) -> Fde | None:
        """The FDE whose [start, end) holds the link-time address ``vaddr``."""
        index = bisect.bisect_right(self._starts, vaddr) - 1
        # Entries sharing a start (an empty FDE beside a real one) are all candidates.
        while index >= 0:
            fde = self._fde_at(self._offsets[index])
            if fde is not None and fde.start <= vaddr < fde.end:
                return fde
            if index == 0 or self._starts[index - 1] != self._starts[index]:
                return None
            index -= 1
        return None

    def find_lsda(self, vaddr: int) -> tuple[int, int | None] | None:
        """(start, LSDA or None) of the FDE holding ``vaddr``, from its header alone where it
        can be read so (ehframe.py); None when no FDE holds it."""
        index = bisect.bisect_right(self._starts, vaddr) - 1
        while index >= 0:
            offset = self._offsets[index]
            header = self._raw.header(offset) if self._raw is not None else None
            if header is None:  # a form not read raw: decoded in full
                fde = self._fde_at(offset)
                header = None if fde is None else FdeHeader(fde.start, fde.end, fde.lsda)
            if header is not None and header.start <= vaddr < header.end:
                return header.start, header.lsda
            if index == 0 or self._starts[index - 1] != self._starts[index]:
                return None
            index -= 1
        return None

    def _fde_at(self, offset: int) -> Fde | None:
        with self._lock:
            if offset not in self._decoded:
                try:
                    # A private method, but the one pyelftools itself uses to follow an
                    # FDE's pointer to its CIE; pyelftools is pinned in pyproject.toml.
                    entry = self._info._parse_entry_at(offset)
                    self._decoded[offset] = _decode(entry) if isinstance(entry, FDE) else None
                except _PARSE_ERRORS:
                    self._decoded[offset] = None  # a damaged entry: as if there were none
            return self._decoded[offset]


_PARSE_ERRORS: Final = (
    ELFError,
    DWARFError,
    ConstructError,
    AssertionError,  # pyelftools asserts on pointer encodings it does not support
    KeyError,
    IndexError,
    ValueError,
    struct.error,
)


def _decode(fde: Any) -> Fde:
    """Run the CIE's and the FDE's instructions into the rows of the FDE's table."""
    cie = fde.cie
    code_align: int = cie["code_alignment_factor"]
    data_align: int = cie["data_alignment_factor"]
    start: int = fde["initial_location"]

    # Step 1: the CIE's initial instructions give the state every FDE starts from; its
    # rules are also what DW_CFA_restore returns a register to.
    interp = _Interpreter(code_align, data_align)
    interp.run(cie.instructions)
    interp.begin(start)
    # Step 2: the FDE's own instructions, each advance closing a row.
    interp.run(fde.instructions)
    interp.close_row()
    rows = tuple(interp.rows)
    augmentation: bytes = cie.header.get("augmentation") or b""
    return Fde(
        start=start,
        end=start + fde["address_range"],
        is_signal_frame=augmentation.startswith(b"z") and b"S" in augmentation,
        ra_column=cie["return_address_register"],
        pcs=tuple(row.pc for row in rows),
        rows=rows,
        lsda=getattr(fde, "lsda_pointer", None),
    )


_Cfa = tuple[int | None, int, bytes | None]  # (register, offset, expression)


class _Interpreter:
    """The DWARF call frame instructions, executed into table rows (DWARF 5, §6.4.2)."""

    def __init__(self, code_align: int, data_align: int) -> None:
        self.code_align = code_align
        self.data_align = data_align
        self.pc = 0
        self.cfa: _Cfa = (None, 0, None)
        self.rules: dict[int, RegRule] = {}
        self.initial: dict[int, RegRule] = {}
        self.rows: list[Row] = []
        self._saved: list[tuple[_Cfa, dict[int, RegRule]]] = []

    def begin(self, pc: int) -> None:
        """The CIE is done: its rules become the initial ones, and the FDE starts at ``pc``."""
        self.initial = dict(self.rules)
        self.rows.clear()
        self._saved.clear()
        self.pc = pc

    def close_row(self) -> None:
        reg, offset, expr = self.cfa
        row = Row(self.pc, reg, offset, expr, dict(self.rules))
        if self.rows and self.rows[-1].pc == self.pc:
            self.rows[-1] = row  # nothing was covered by the previous one
        else:
            self.rows.append(row)

    def advance(self, to: int) -> None:
        self.close_row()
        self.pc = to

    def run(self, instructions: Iterable[Any]) -> None:
        for insn in instructions:
            self.execute(insn.opcode, insn.args)

    def execute(self, op: DW_CFA, args: list[Any]) -> None:
        reg, offset, _expr = self.cfa
        match op:
            case (
                DW_CFA.advance_loc | DW_CFA.advance_loc1 | DW_CFA.advance_loc2 | DW_CFA.advance_loc4
            ):
                self.advance(self.pc + args[0] * self.code_align)
            case DW_CFA.set_loc:
                self.advance(args[0])
            case DW_CFA.def_cfa:
                self.cfa = (args[0], args[1], None)
            case DW_CFA.def_cfa_sf:
                self.cfa = (args[0], args[1] * self.data_align, None)
            case DW_CFA.def_cfa_register:
                self.cfa = (args[0], offset, None)
            case DW_CFA.def_cfa_offset:
                self.cfa = (reg, args[0], None)
            case DW_CFA.def_cfa_offset_sf:
                self.cfa = (reg, args[0] * self.data_align, None)
            case DW_CFA.def_cfa_expression:
                self.cfa = (None, 0, bytes(args[0]))
            case DW_CFA.undefined:
                self.rules[args[0]] = (Rule.UNDEFINED, 0)
            case DW_CFA.same_value:
                self.rules[args[0]] = (Rule.SAME_VALUE, 0)
            case DW_CFA.offset | DW_CFA.offset_extended | DW_CFA.offset_extended_sf:
                self.rules[args[0]] = (Rule.OFFSET, args[1] * self.data_align)
            case DW_CFA.val_offset | DW_CFA.val_offset_sf:
                self.rules[args[0]] = (Rule.VAL_OFFSET, args[1] * self.data_align)
            case DW_CFA.register:
                self.rules[args[0]] = (Rule.REGISTER, args[1])
            case DW_CFA.expression:
                self.rules[args[0]] = (Rule.EXPRESSION, bytes(args[1]))
            case DW_CFA.val_expression:
                self.rules[args[0]] = (Rule.VAL_EXPRESSION, bytes(args[1]))
            case DW_CFA.restore | DW_CFA.restore_extended:
                if args[0] in self.initial:
                    self.rules[args[0]] = self.initial[args[0]]
                else:
                    self.rules.pop(args[0], None)
            case DW_CFA.remember_state:
                self._saved.append((self.cfa, dict(self.rules)))
            case DW_CFA.restore_state:
                if self._saved:
                    self.cfa, self.rules = self._saved.pop()
            case _:
                pass  # nop, GNU_args_size, and the AArch64-only instructions


# -- the files -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FileCfi:
    """Every unwind table of one file, in the order they are consulted."""

    sections: tuple[_Cfi, ...]

    def find(self, vaddr: int) -> Fde | None:
        for section in self.sections:
            fde = section.find(vaddr)
            if fde is not None:
                return fde
        return None

    def find_lsda(self, vaddr: int) -> tuple[int, int | None] | None:
        for section in self.sections:
            found = section.find_lsda(vaddr)
            if found is not None:
                return found
        return None


_DW_EH_PE_OMIT: Final = 0xFF
_DW_EH_PE_DATAREL_SDATA4: Final = 0x3B  # what every linker writes in the search table
_DW_EH_PE_UDATA4: Final = 0x03
_EH_PTR_SIZE: Final = {0x00: 8, 0x02: 2, 0x03: 4, 0x04: 8, 0x0A: 2, 0x0B: 4, 0x0C: 8}


def _search_table(hdr: bytes, hdr_addr: int, eh_addr: int) -> tuple[list[int], list[int]] | None:
    """(starts, FDE offsets in .eh_frame) from .eh_frame_hdr; None when it has no table.

    Layout: version 1, eh_frame_ptr_enc, fde_count_enc, table_enc, the encoded eh_frame_ptr,
    the encoded count, then (initial location, FDE address) pairs relative to the header.
    """
    if len(hdr) < 4 or hdr[0] != 1:
        return None
    ptr_enc, count_enc, table_enc = hdr[1], hdr[2], hdr[3]
    ptr_size = _EH_PTR_SIZE.get(ptr_enc & 0x0F)
    if ptr_enc == _DW_EH_PE_OMIT or ptr_size is None:
        return None
    if count_enc != _DW_EH_PE_UDATA4 or table_enc != _DW_EH_PE_DATAREL_SDATA4:
        return None
    pos = 4 + ptr_size
    if len(hdr) < pos + 4:
        return None
    (count,) = struct.unpack_from("<I", hdr, pos)
    pos += 4
    if len(hdr) < pos + 8 * count:
        return None
    pairs = sorted(struct.iter_unpack("<ii", hdr[pos : pos + 8 * count]))
    starts = [hdr_addr + start for start, _fde in pairs]
    offsets = [hdr_addr + fde - eh_addr for _start, fde in pairs]
    return starts, offsets


def _full_index(info: CallFrameInfo) -> tuple[list[int], list[int]]:
    fdes = sorted(
        (entry["initial_location"], entry.offset)
        for entry in info.get_entries()
        if isinstance(entry, FDE)
    )
    return [start for start, _ in fdes], [offset for _, offset in fdes]


def _section_cfi(elf: ELFFile, name: str, *, hdr_name: str | None) -> _Cfi | None:
    section = elf.get_section_by_name(name)
    if section is None or section.header.sh_type == "SHT_NOBITS":
        return None
    data: bytes = section.data()
    address: int = section.header.sh_addr
    info = CallFrameInfo(
        stream=io.BytesIO(data),
        size=len(data),
        address=address,
        base_structs=DWARFStructs(little_endian=True, dwarf_format=32, address_size=8),
        for_eh_frame=name == ".eh_frame",
    )
    hdr = elf.get_section_by_name(hdr_name) if hdr_name else None
    table = None
    if hdr is not None and hdr.header.sh_type != "SHT_NOBITS":
        table = _search_table(hdr.data(), hdr.header.sh_addr, address)
    starts, offsets = table if table is not None else _full_index(info)
    raw = RawEhFrame(data, address) if name == ".eh_frame" else None
    return _Cfi(info, starts, offsets, raw)


def _read_file(path: str) -> _FileCfi:
    sections: list[_Cfi] = []
    try:
        with open(path, "rb") as stream:
            elf = ELFFile(stream)
            for name, hdr_name in ((".eh_frame", ".eh_frame_hdr"), (".debug_frame", None)):
                try:
                    found = _section_cfi(elf, name, hdr_name=hdr_name)
                except _PARSE_ERRORS:
                    continue  # a damaged table: the other one, or frame pointers
                if found is not None:
                    sections.append(found)
    except (OSError, *_PARSE_ERRORS):
        return _FileCfi(())
    return _FileCfi(tuple(sections))


_CacheKey = tuple[str, int, int, int, int]
_cache: dict[_CacheKey, _FileCfi] = {}
_cache_lock = threading.Lock()


def _cfi_of(path: str) -> _FileCfi:
    """The unwind tables of the file at ``path``, read once per file identity."""
    try:
        st = os.stat(path)
    except OSError:
        return _FileCfi(())
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    cfi = _read_file(path)
    with _cache_lock:
        return _cache.setdefault(key, cfi)


def find_lsda(path: str, vaddr: int) -> tuple[int, int] | None:
    """(start of the FDE, its LSDA) when the FDE covering link-time ``vaddr`` of the file at
    ``path`` points to an exception table; None otherwise. ``find_fde(...).lsda``, without
    decoding the FDE's instructions where its header can be read alone (ehframe.py)."""
    found = _cfi_of(path).find_lsda(vaddr)
    if found is None or found[1] is None:
        return None
    return found[0], found[1]


def find_fde(path: str, vaddr: int) -> Fde | None:
    """The unwind table entry of the file at ``path`` covering link-time address ``vaddr``."""
    return _cfi_of(path).find(vaddr)
