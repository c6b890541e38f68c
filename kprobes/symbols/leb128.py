"""LEB128, DWARF's variable-length integers (DWARF 5, §7.6), read from bytes.

One reader for every table that holds them: ``.eh_frame`` headers (ehframe.py), exception
tables (lsda.py), DWARF expressions in unwind rules (unwind.py) and member offsets
(dwarf_types.py). A number cut short by the end of the bytes raises ``IndexError``, as
indexing past the end would: each reader already treats that as a truncated table.
"""

from __future__ import annotations

from collections.abc import Sequence


def uleb128(data: Sequence[int], pos: int) -> tuple[int, int]:
    """The unsigned number at ``pos`` and where the next field starts."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise IndexError(f"LEB128 number cut short at {pos}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def sleb128(data: Sequence[int], pos: int) -> tuple[int, int]:
    """The signed number at ``pos`` and where the next field starts."""
    value, end = uleb128(data, pos)
    bits = 7 * (end - pos)
    if value & (1 << (bits - 1)):
        value -= 1 << bits
    return value, end
