"""The instructions of an FDE, run into the rows of its table (``cfa.py``), with pyelftools.

pyelftools parses the CIE and FDE records; the rows come from our own interpreter of their
instructions, not from pyelftools' ``get_decoded()``, which rejects ``DW_CFA_GNU_args_size``
and scales ``DW_CFA_def_cfa_sf`` by the wrong factor. ``cfi.py`` imports this module only
when an FDE must be decoded in full (an unwind, or a header ``ehframe.py`` cannot read
alone): placing probes needs no more than FDE headers, and pyelftools costs ~30 ms to import.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterable
from typing import Any, Final

from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct.core import ConstructError
from elftools.dwarf.callframe import FDE, CallFrameInfo
from elftools.dwarf.constants import DW_CFA
from elftools.dwarf.structs import DWARFStructs

from kprobes.symbols.cfa import Fde, RegRule, Row, Rule

PARSE_ERRORS: Final = (
    ELFError,
    DWARFError,
    ConstructError,
    AssertionError,  # pyelftools asserts on pointer encodings it does not support
    KeyError,
    IndexError,
    ValueError,
    struct.error,
)


def call_frame_info(data: bytes, address: int, *, for_eh_frame: bool) -> CallFrameInfo:
    """pyelftools' reader of one section's CIEs and FDEs (parsed when asked)."""
    return CallFrameInfo(
        stream=io.BytesIO(data),
        size=len(data),
        address=address,
        base_structs=DWARFStructs(little_endian=True, dwarf_format=32, address_size=8),
        for_eh_frame=for_eh_frame,
    )


def full_index(info: CallFrameInfo) -> tuple[list[int], list[int]]:
    """(starts, offsets) of every FDE of a section without a search table, by start."""
    fdes = sorted(
        (entry["initial_location"], entry.offset)
        for entry in info.get_entries()
        if isinstance(entry, FDE)
    )
    return [start for start, _ in fdes], [offset for _, offset in fdes]


def decode_at(info: CallFrameInfo, offset: int) -> Fde | None:
    """The FDE at ``offset`` of the section, decoded; None for a CIE or a damaged entry."""
    try:
        # A private method, but the one pyelftools itself uses to follow an FDE's pointer
        # to its CIE; pyelftools is pinned in pyproject.toml.
        entry = info._parse_entry_at(offset)
        return _decode(entry) if isinstance(entry, FDE) else None
    except PARSE_ERRORS:
        return None  # a damaged entry: as if there were none


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
