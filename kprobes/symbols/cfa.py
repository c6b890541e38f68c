"""The decoded unwind table of one function: its rows and the rules each row holds.

What ``cfi.py`` finds and ``cfi_decode.py`` builds, and what ``unwind.py`` walks a stack with;
plain values, apart from the reading of any file.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from enum import Enum

from kprobes.values import dataclass


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
