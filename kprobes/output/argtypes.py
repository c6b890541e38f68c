"""How a fetch-arg value prints: the kernel's probe-event print functions, in Python.

The kernel keeps each fetched argument in the ring buffer at its type's size and prints it with
one function per type (``DEFINE_BASIC_PRINT_TYPE_FUNC`` in kernel/trace/trace_probe.c): ``u*``
as ``%u``, ``s*`` as ``%d``, ``x*`` as ``0x%x``, ``char`` as ``'%c'``, ``string`` / ``ustring``
/ ``symstr`` quoted, ``symbol`` as ``%pS``, a ``TYPE[N]`` array as ``{a,b,c}``
(``trace_probe_print_args``) and a string that could not be read as ``(fault)``. A bitfield
``b<w>@<o>/<c>`` is stored and printed as the unsigned type of its container.

An :data:`~kprobes.model.ArgValue` is a Python int of any size, so it is first cut to the type's
width as the kernel's store would: a ``u8`` of -1 is 255, an ``s32`` of 0xffffffff is -1. The
text, JSON and Perfetto outputs all read values through here, so they never disagree about a
number. Rejected: trusting producers to hand over already-normalised ints (the Process target
reads raw register words; only the type knows the width).
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Callable

from kprobes.model import ArgValue
from kprobes.values import dataclass

FAULT = "(fault)"  # the kernel's FAULT_STRING

# A value as JSON carries it: arrays become lists, a fault None.
JsonValue = int | str | None | list["JsonValue"]


class Kind(enum.Enum):
    """How the kernel prints one element of a fetch type."""

    UNSIGNED = "u"  # u8..u64 and bitfields: %u
    SIGNED = "s"  # s8..s64: %d
    HEX = "x"  # x8..x64: 0x%x
    CHAR = "char"  # '%c'
    STRING = "string"  # string, ustring, symstr, %pd, %pD: "\"%s\""
    SYMBOL = "symbol"  # %pS: the producer already resolved it to sym+off/size
    RAW = "raw"  # a type this module does not know: printed plainly


@dataclass(frozen=True, slots=True)
class FetchType:
    """A parsed ``:TYPE`` of a fetch-arg: element kind, integer width, array length."""

    kind: Kind
    bits: int  # width of the integer kinds (8, 16, 32, 64); 0 for the others
    count: int | None = None  # N of ``TYPE[N]``; None for a scalar

    @property
    def is_array(self) -> bool:
        return self.count is not None


_ARRAY = re.compile(r"^(?P<base>.+)\[(?P<count>\d+)\]$")
_INTEGER = re.compile(r"^(?P<sign>[usx])(?P<bits>8|16|32|64)$")
_BITFIELD = re.compile(r"^b(?P<width>\d+)@(?P<offset>\d+)/(?P<container>8|16|32|64)$")
_STRING_TYPES = frozenset({"string", "ustring", "symstr", "%pd", "%pD"})
_SIGNS = {"u": Kind.UNSIGNED, "s": Kind.SIGNED, "x": Kind.HEX}

# The kernel's default fetch type on a 64-bit machine when ``:TYPE`` is omitted.
DEFAULT_TYPE = "x64"


@functools.lru_cache(maxsize=256)
def parse_type(text: str) -> FetchType:
    """Parse a fetch-arg type as written after ``:`` in a probe spec (``""`` = the default)."""
    text = text.strip() or DEFAULT_TYPE
    count: int | None = None
    array = _ARRAY.match(text)
    if array is not None:
        text, count = array["base"], int(array["count"])
    if (m := _INTEGER.match(text)) is not None:
        return FetchType(_SIGNS[m["sign"]], int(m["bits"]), count)
    if (m := _BITFIELD.match(text)) is not None:
        return FetchType(Kind.UNSIGNED, int(m["container"]), count)
    if text == "char":
        return FetchType(Kind.CHAR, 8, count)
    if text in _STRING_TYPES:
        return FetchType(Kind.STRING, 0, count)
    if text == "symbol":
        return FetchType(Kind.SYMBOL, 0, count)
    return FetchType(Kind.RAW, 0, count)


def _unsigned(value: int, bits: int) -> int:
    return value & ((1 << bits) - 1)


def _signed(value: int, bits: int) -> int:
    value = _unsigned(value, bits)
    return value - (1 << bits) if value >> (bits - 1) else value


def format_value(type_text: str, value: ArgValue) -> str:
    """One value as the kernel's trace file shows it after ``name=``."""
    return _format(parse_type(type_text), value)


def text_formatter(type_text: str) -> Callable[[ArgValue], str]:
    """``format_value`` of one type, the type parsed once (a batch formatter's)."""
    return functools.partial(_format, parse_type(type_text))


def json_formatter(type_text: str) -> Callable[[ArgValue], str]:
    """A value of one type as JSON text, as ``format_json`` writes it in ``args``."""
    ftype = parse_type(type_text)

    def dump(value: ArgValue) -> str:
        return json.dumps(_json(ftype, value, False), separators=(", ", ": "))

    return dump


def _format(ftype: FetchType, value: ArgValue) -> str:
    if value is None:
        return FAULT
    if isinstance(value, tuple):
        return "{" + ",".join(_format(ftype, v) for v in value) + "}"
    if isinstance(value, str):
        match ftype.kind:
            case Kind.STRING:
                return f'"{value}"'
            case Kind.CHAR:
                return f"'{value}'"
            case _:  # a symbol, or a producer that resolved a number to text: print as given
                return value
    match ftype.kind:
        case Kind.UNSIGNED:
            return str(_unsigned(value, ftype.bits))
        case Kind.SIGNED:
            return str(_signed(value, ftype.bits))
        case Kind.CHAR:
            return f"'{chr(_unsigned(value, 8))}'"
        case Kind.RAW:
            return str(value)
        case Kind.HEX:
            return f"0x{_unsigned(value, ftype.bits):x}"
        case Kind.STRING | Kind.SYMBOL:
            # An address where text was expected (%pS of an unknown address prints it so).
            return f"0x{_unsigned(value, 64):x}"


def json_value(type_text: str, value: ArgValue, *, hex_as_text: bool = False) -> JsonValue:
    """One value for JSON: ints cut to the type's width, ``char`` as a one-letter string.

    ``hex_as_text`` keeps ``x*`` values as their ``0x...`` text, for viewers read by people.
    """
    return _json(parse_type(type_text), value, hex_as_text)


def _json(ftype: FetchType, value: ArgValue, hex_as_text: bool) -> JsonValue:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return [_json(ftype, v, hex_as_text) for v in value]
    match ftype.kind:
        case Kind.UNSIGNED:
            return _unsigned(value, ftype.bits)
        case Kind.SIGNED:
            return _signed(value, ftype.bits)
        case Kind.HEX:
            unsigned = _unsigned(value, ftype.bits)
            return f"0x{unsigned:x}" if hex_as_text else unsigned
        case Kind.CHAR:
            return chr(_unsigned(value, 8))
        case Kind.RAW:
            return value
        case Kind.STRING | Kind.SYMBOL:
            return _unsigned(value, 64)
