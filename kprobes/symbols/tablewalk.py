"""Stack walks over the compact frame tables (frametable.py): the reference of the in-program
walker.

The fast tier is to walk a thread's stack inside the program, in the detour, with the rows
of ``frametable.py`` in the shared area (issue 23, item 5). This is the same walk in Python,
over the same rows, through the same callbacks as ``unwind.py``'s (memory, the module at an
address, the return trampoline's translation): what the detour must record, and a second
opinion on the trap tier's stacks. Per frame it needs three registers only: the CFA is
``rsp`` or ``rbp`` plus the row's offset, the return address is at CFA-8, and the caller's
``rbp`` is read at CFA plus the row's offset or kept; the caller's ``rsp`` is the CFA.

Where ``unwind.py`` would go on and these rows cannot (a DWARF expression, a signal frame,
a CFA on another register: an ``UNSUPPORTED`` row), the walk ends with
``StopReason.UNSUPPORTED``, which the stacks show as a marker frame; it never guesses.
Addresses no FDE covers take the frame-pointer fallback that ``unwind.py`` takes there
(``frame_pointer_caller``). On the code that compilers write, the two walks give the same
frames (tests/test_tablewalk.py).

Rejected: one walker with a flag in ``unwind.py`` (it would carry the DWARF rules' register
set and expression evaluator into a walk that must stay as small as the machine code that
will mirror it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from kprobes.errors import TargetError
from kprobes.symbols.frametable import RSP, FrameTable, Kind, table_of
from kprobes.symbols.unwind import (
    FoundBy,
    Frame,
    ModuleAt,
    ReadWord,
    StopReason,
    TranslateReturn,
    frame_pointer_caller,
)
from kprobes.values import dataclass

_MASK64: Final = (1 << 64) - 1
TableOf = Callable[[str], FrameTable]


@dataclass(frozen=True, slots=True)
class _Cursor:
    pc: int
    rsp: int
    rbp: int | None  # None: lost (its saved copy could not be read)
    how: FoundBy


@dataclass(frozen=True, slots=True)
class _Step:
    cfa: int | None
    caller: _Cursor | None  # None: the walk ends here
    stop: StopReason | None = None


def walk(
    regs: Mapping[str, int],
    read_word: ReadWord,
    module_at: ModuleAt,
    translate_return: TranslateReturn | None = None,
    max_frames: int = 64,
    tables: TableOf = table_of,
) -> list[Frame]:
    """The frames of a stopped thread whose registers are ``regs`` (``rip``, ``rsp``,
    ``rbp``), innermost first, as ``unwind.unwind`` gives them; ``tables(path)`` is the
    compact table of the file at ``path``. Never raises for a stack it cannot walk: the last
    frame's ``stop`` says why it ended."""
    if max_frames < 1:
        return []
    rbp = regs.get("rbp")
    cursor = _Cursor(
        regs["rip"] & _MASK64,
        regs["rsp"] & _MASK64,
        None if rbp is None else rbp & _MASK64,
        FoundBy.FIRST,
    )
    frames: list[Frame] = []
    while True:
        try:
            step = _step(cursor, read_word, module_at, translate_return, tables)
        except (TargetError, OSError):
            step = _Step(None, None, StopReason.UNREADABLE)
        if step.caller is not None and len(frames) + 1 == max_frames:
            step = _Step(step.cfa, None, StopReason.MAX_FRAMES)
        frames.append(Frame(cursor.pc, step.cfa, cursor.how, step.stop))
        if step.caller is None:
            return frames
        cursor = step.caller


def _step(
    cursor: _Cursor,
    read_word: ReadWord,
    module_at: ModuleAt,
    translate_return: TranslateReturn | None,
    tables: TableOf,
) -> _Step:
    """One frame: its CFA and its caller, from its row or the frame pointer."""
    # Step 1: the row. A return address follows its call, whose row is one byte back
    # (unwind.py says why).
    lookup = cursor.pc if cursor.how is FoundBy.FIRST else cursor.pc - 1
    where = module_at(lookup)
    kind = Kind.UNCOVERED
    if where is not None:
        path, bias = where
        row = tables(path).row_at(lookup - bias)
        kind = row.kind
        if kind is Kind.CFA:
            base = cursor.rsp if row.base == RSP else cursor.rbp
            if base is None:
                return _Step(None, None, StopReason.UNKNOWN_REGISTER)
            return _step_row(
                cursor,
                (base + row.cfa_offset) & _MASK64,
                row.rbp_offset,
                read_word,
                translate_return,
            )
        if kind is Kind.OUTERMOST:
            return _Step(None, None, StopReason.OUTERMOST)
        if kind is Kind.UNSUPPORTED:
            return _Step(None, None, StopReason.UNSUPPORTED)
    # Step 2: no row: the frame pointer, as unwind.py falls back to it.
    found = frame_pointer_caller(cursor.rbp, cursor.rsp, read_word, translate_return)
    if found is None:
        reason = StopReason.NO_MODULE if where is None else StopReason.NO_UNWIND_INFO
        return _Step(None, None, reason)
    cfa, ra, saved_rbp = found
    if ra == 0:
        return _Step(cfa, None, StopReason.OUTERMOST)
    return _Step(cfa, _Cursor(ra, cfa, saved_rbp, FoundBy.FP))


def _step_row(
    cursor: _Cursor,
    cfa: int,
    rbp_offset: int,
    read_word: ReadWord,
    translate_return: TranslateReturn | None,
) -> _Step:
    """The caller, from a CFA row: the return address at CFA-8, rbp where it was saved."""
    if cfa <= cursor.rsp:  # a caller's frame is above its callee's
        return _Step(cfa, None, StopReason.NOT_OUTWARD)
    slot = cfa - 8
    ra = read_word(slot)
    if translate_return is not None:
        ra = translate_return(slot, ra)
    if ra == 0:
        return _Step(cfa, None, StopReason.OUTERMOST)
    rbp = cursor.rbp
    if rbp_offset:
        try:
            rbp = read_word((cfa + rbp_offset) & _MASK64)
        except (TargetError, OSError):
            rbp = None  # lost in the caller; a row that needs it will say so
    return _Step(cfa, _Cursor(ra, cfa, rbp, FoundBy.CFI))
