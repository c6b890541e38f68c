"""An event's ``format`` file, turned into a decoder for its binary records.

Every tracefs event describes its record in ``events/GROUP/EVENT/format``::

    ID: 2326
    format:
        field:unsigned short common_type;   offset:0;   size:2; signed:0;
        field:int common_pid;               offset:4;   size:4; signed:1;
        field:unsigned long __probe_ip;     offset:8;   size:8; signed:0;
        field:u8 a;                         offset:16;  size:1; signed:0;
        field:u32 f[];                      offset:35;  size:12;    signed:0;
        field:__data_loc char[] s;          offset:47;  size:4; signed:1;
    print fmt: "(%lx) a=%u f={%u,%u,%u} s=\"%s\"", REC->__probe_ip, ...

Probe events pack their fields with no alignment, so offsets are taken as written, never
computed. The C type says how to unpack a field; it does not say how the user asked for it
(``x32`` and ``u32`` are both ``u32``), so each argument's spec type is recovered from its
conversion in the print format (``0x%x`` → x, ``%u`` → u, ``%d`` → s, ``'%c'`` → char,
``%pS`` → symbol, ``"%s"`` → string).

``compile`` makes one ``struct.Struct`` covering every fixed field, so decoding a record is one
``unpack_from`` plus the few conversions that need Python (strings, arrays, symbols). A
``__data_loc`` word holds a string's offset from the record start (low 16 bits) and its length
including the NUL (high 16 bits); ``__rel_loc`` counts the offset from the end of the word.
Length 0 is the kernel's "(fault)": the fetch failed, and the value is None.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Final

from kprobes.model import ArgValue
from kprobes.values import dataclass

_FIELD = re.compile(
    r"field:(?P<decl>[^;]+);\s*offset:(?P<offset>\d+);\s*size:(?P<size>\d+);"
    r"(?:\s*signed:(?P<signed>\d+);)?"
)
_CODES: Final = {1: "b", 2: "h", 4: "i", 8: "q"}
PROBE_FIELDS: Final = frozenset({"__probe_ip", "__probe_func", "__probe_ret_ip"})


@dataclass(frozen=True, slots=True)
class Field:
    """One ``field:`` line of a format file."""

    name: str
    ctype: str  # "u32", "unsigned long", "char[]" for a __data_loc string
    offset: int
    size: int
    is_signed: bool
    count: int = 0  # array length; 0 = not an array
    loc: str = ""  # "data_loc" or "rel_loc" for dynamic data, else ""

    @property
    def elem_size(self) -> int:
        if self.loc:
            return 4
        return self.size // self.count if self.count else self.size


def _parse_decl(decl: str) -> tuple[str, str, int | None, str]:
    """``__data_loc char[][2] g`` → ("char[]", "g", 2, "data_loc")."""
    decl = decl.strip()
    loc = ""
    for marker in ("__data_loc", "__rel_loc"):
        if decl.startswith(marker + " "):
            loc = marker.strip("_")
            decl = decl[len(marker) + 1 :]
    m = re.fullmatch(r"(?P<type>.*?)\s*(?P<name>\w+)\s*(?:\[(?P<n>\d*)\])?", decl)
    if m is None:
        raise ValueError(f"cannot read the field declaration {decl!r}")
    ctype, name, n = m["type"], m["name"], m["n"]
    count: int | None = None
    if n is not None:
        count = int(n) if n else -1  # "u32 f[]": the count comes from the size
    if loc:
        # "char[][2] g": an array of string locations (the [2] sits on the type).
        arr = re.fullmatch(r"(.*\[\])\[(\d+)\]", ctype)
        if arr:
            ctype, count = arr.group(1), int(arr.group(2))
    return ctype, name, count, loc


def _c_string(text: str, start: int) -> tuple[str, int]:
    """The C string literal starting at ``text[start] == '"'``, unescaped, and its end."""
    out = []
    i = start + 1
    while i < len(text) and text[i] != '"':
        if text[i] == "\\" and i + 1 < len(text):
            i += 1
            out.append({"n": "\n", "t": "\t"}.get(text[i], text[i]))
        else:
            out.append(text[i])
        i += 1
    return "".join(out), i + 1


def _conversion_kind(conv: str) -> str:
    """The spec type letter or name a printf conversion stands for."""
    if conv.startswith("{"):
        conv = conv[1:].split(",")[0]
    if conv.startswith("0x"):
        return "x"
    if conv == "'%c'":
        return "char"
    if conv.startswith("%p"):
        return "symbol"
    if '"' in conv or conv.endswith("%s"):
        return "string"
    if conv.endswith("d"):
        return "s"
    return "u"


@dataclass(frozen=True, slots=True)
class EventFormat:
    """The layout of one event's records."""

    id: int
    group: str
    name: str
    fields: tuple[Field, ...]
    print_fmt: str
    arg_types: tuple[str, ...]  # spec type of each argument field, in order

    @property
    def common(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.name.startswith("common_"))

    @property
    def probe_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.name in PROBE_FIELDS)

    @property
    def arg_fields(self) -> tuple[Field, ...]:
        return tuple(
            f
            for f in self.fields
            if not f.name.startswith("common_") and f.name not in PROBE_FIELDS
        )

    @property
    def is_return(self) -> bool:
        return any(f.name == "__probe_ret_ip" for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    @classmethod
    def parse(cls, text: str, group: str = "") -> EventFormat:
        name_m = re.search(r"^name:\s*(\S+)", text, re.M)
        id_m = re.search(r"^ID:\s*(\d+)", text, re.M)
        if name_m is None or id_m is None:
            raise ValueError("not an event format file (no name: or ID: line)")
        fields = []
        for m in _FIELD.finditer(text):
            ctype, fname, count, loc = _parse_decl(m["decl"])
            size = int(m["size"])
            if count == -1:
                elem = int(re.sub(r"\D", "", ctype) or 8) // 8 if ctype[0] in "us" else 1
                count = max(1, size // max(1, elem))
            fields.append(
                Field(
                    name=fname,
                    ctype=ctype,
                    offset=int(m["offset"]),
                    size=size,
                    is_signed=m["signed"] == "1",
                    count=count or 0,
                    loc=loc,
                )
            )
        fmt_pos = text.find("print fmt:")
        print_fmt = ""
        if fmt_pos >= 0:
            quote = text.find('"', fmt_pos)
            if quote >= 0:
                print_fmt, _ = _c_string(text, quote)
        conversions = dict(re.findall(r"(\w+)=(\S+)", print_fmt))
        arg_types = []
        for f in fields:
            if f.name.startswith("common_") or f.name in PROBE_FIELDS:
                continue
            kind = _conversion_kind(conversions.get(f.name, "%u"))
            if f.loc:
                typ = "string"
            elif kind in ("char", "symbol"):
                typ = kind
            else:
                typ = f"{'s' if kind == 's' else kind}{f.elem_size * 8}"
            if f.count:
                typ += f"[{f.count}]"
            arg_types.append(typ)
        return cls(
            id=int(id_m.group(1)),
            group=group,
            name=name_m.group(1),
            fields=tuple(fields),
            print_fmt=print_fmt,
            arg_types=tuple(arg_types),
        )


def _is_arg(f: Field) -> bool:
    return not f.name.startswith("common_") and f.name not in PROBE_FIELDS


# (tid, ip, func_ip, argument values) of one record. For an entry probe ``ip`` is the probed
# address and ``func_ip`` 0; for a return probe ``ip`` is the return address (in the caller)
# and ``func_ip`` the probed function.
Decoded = tuple[int, int, int, tuple[ArgValue, ...]]
Decoder = Callable[[bytes, int], Decoded]


def _string(data: bytes, start: int, word: int, word_offset: int, relative: bool) -> str | None:
    length = word >> 16
    if length == 0:
        return None
    begin = start + (word & 0xFFFF) + (word_offset + 4 if relative else 0)
    raw = data[begin : begin + length]
    nul = raw.find(b"\0")
    return (raw if nul < 0 else raw[:nul]).decode("utf-8", "replace")


Converter = Callable[[tuple[int, ...], bytes, int], ArgValue]


def _missing(values: tuple[int, ...], data: bytes, start: int) -> ArgValue:
    return None


def _value_at(i: int) -> Converter:
    def convert(values: tuple[int, ...], data: bytes, start: int) -> ArgValue:
        return values[i]

    return convert


def _array_at(where: slice) -> Converter:
    def convert(values: tuple[int, ...], data: bytes, start: int) -> ArgValue:
        return tuple(values[where])

    return convert


def _symbol_at(i: int, symbolize: Callable[[int], str]) -> Converter:
    def convert(values: tuple[int, ...], data: bytes, start: int) -> ArgValue:
        return symbolize(values[i])

    return convert


def _strings_at(where: slice, offset: int, count: int, relative: bool) -> Converter:
    if not count:
        i = where.start

        def one(values: tuple[int, ...], data: bytes, start: int) -> ArgValue:
            return _string(data, start, values[i], offset, relative)

        return one
    offsets = [offset + 4 * k for k in range(count)]

    def many(values: tuple[int, ...], data: bytes, start: int) -> ArgValue:
        return tuple(
            _string(data, start, w, o, relative)
            for w, o in zip(values[where], offsets, strict=True)
        )

    return many


def record_struct(
    fmt: EventFormat, wanted: Callable[[Field], bool] = lambda f: True
) -> tuple[str, dict[str, slice]]:
    """The ``struct`` format reading ``fmt``'s ``wanted`` fixed fields from a record's start,
    and where each one's values land in the unpacked tuple (name → slice).

    Fields not wanted, overlays and fields of a size ``struct`` has no code for are skipped
    as padding; a ``__data_loc``/``__rel_loc`` field unpacks as its u32 location word(s).
    """
    layout = ["<"]
    pos = covered = 0  # bytes the format reads so far; end of the furthest field seen
    slots: dict[str, slice] = {}
    n = 0
    for f in sorted(fmt.fields, key=lambda f: f.offset):
        if f.offset < covered:
            continue  # an overlay (the header's "overwrite" style); skip
        covered = f.offset + f.size
        code = "I" if f.loc else _CODES.get(f.elem_size, "")
        if not code or not wanted(f):
            continue  # padding, up to the next field taken
        if f.offset > pos:
            layout.append(f"{f.offset - pos}x")
        if not f.is_signed or f.loc:
            code = code.upper()
        count = f.count or 1
        layout.append(f"{count}{code}" if count > 1 else code)
        slots[f.name] = slice(n, n + count)
        n += count
        pos = f.offset + f.size
    return "".join(layout), slots


def compile_decoder(fmt: EventFormat, symbolize: Callable[[int], str] | None = None) -> Decoder:
    """A function ``decode(page, start) -> (tid, ip, func_ip, args)`` for ``fmt``'s records.

    The plain reference decoder, one step at a time; the kernel targets use the compiled
    builders of ``records.py``, which the tests hold to this one.
    """
    layout, slots = record_struct(fmt)
    n = sum(s.stop - s.start for s in slots.values())
    unpack = struct.Struct(layout).unpack_from
    pid_at = slots["common_pid"].start
    ip_at = slots.get("__probe_ret_ip", slots.get("__probe_ip", slice(-1, -1))).start
    func_at = slots["__probe_func"].start if "__probe_func" in slots else -1

    # One converter per argument, from the flat tuple to the argument's value.
    converters: list[Converter] = []
    for f, typ in zip(fmt.arg_fields, fmt.arg_types, strict=True):
        where = slots.get(f.name)
        if where is None:
            converters.append(_missing)
        elif f.loc:
            converters.append(_strings_at(where, f.offset, f.count, f.loc == "rel_loc"))
        elif f.count:
            converters.append(_array_at(where))
        elif typ == "symbol" and symbolize is not None:
            converters.append(_symbol_at(where.start, symbolize))
        else:
            converters.append(_value_at(where.start))
    plain = all(
        f.name in slots and not f.loc and not f.count and not (t == "symbol" and symbolize)
        for f, t in zip(fmt.arg_fields, fmt.arg_types, strict=True)
    )
    first_arg = min((slots[f.name].start for f in fmt.arg_fields if f.name in slots), default=n)

    if plain:
        # Every argument is a plain number: the arguments are a slice of the flat tuple.
        def decode_plain(data: bytes, start: int) -> Decoded:
            values = unpack(data, start)
            return (
                values[pid_at],
                values[ip_at] if ip_at >= 0 else 0,
                values[func_at] if func_at >= 0 else 0,
                values[first_arg:],
            )

        return decode_plain

    def decode(data: bytes, start: int) -> Decoded:
        values = unpack(data, start)
        return (
            values[pid_at],
            values[ip_at] if ip_at >= 0 else 0,
            values[func_at] if func_at >= 0 else 0,
            tuple(convert(values, data, start) for convert in converters),
        )

    return decode
