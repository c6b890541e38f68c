"""LEB128: the DWARF standard's own examples (DWARF 5, tables 7.8 and 7.9), and a cut."""

from __future__ import annotations

import pytest

from kprobes.symbols.leb128 import sleb128, uleb128


@pytest.mark.parametrize(
    ("encoded", "value"),
    [([2], 2), ([127], 127), ([0x80, 1], 128), ([0x81, 1], 129), ([0x82, 1], 130),
     ([0xB9, 0x64], 12857), ([0xE5, 0x8E, 0x26], 624485)],
)  # fmt: skip
def test_unsigned(encoded: list[int], value: int) -> None:
    data = bytes([0xAA, *encoded, 0x55])  # read from inside a larger table
    assert uleb128(data, 1) == (value, 1 + len(encoded))


@pytest.mark.parametrize(
    ("encoded", "value"),
    [([2], 2), ([0x7E], -2), ([0xFF, 0], 127), ([0x81, 0x7F], -127), ([0x80, 1], 128),
     ([0x80, 0x7F], -128), ([0x81, 1], 129), ([0xFF, 0x7E], -129),
     ([0xC0, 0xBB, 0x78], -123456)],
)  # fmt: skip
def test_signed(encoded: list[int], value: int) -> None:
    assert sleb128(bytes(encoded), 0) == (value, len(encoded))


def test_a_number_cut_short_is_an_index_error() -> None:
    with pytest.raises(IndexError, match="cut short at 2"):
        uleb128(bytes([0x80, 0x80]), 0)
