"""A probe's own output line, printf style: bcc ``trace``'s format strings.

    kprobes trace -c ./prog 'p work i=%di:s64 "work(%d) by %s", i, comm'
    kprobes trace -c ./prog 'r work "work returned %ld after %.6f s", $retval, time'

bcc's ``trace`` writes a C format string and its arguments after the probe (``trace
'do_sys_open "%s", arg2'``), bpftrace ``printf("%s %d\\n", comm, arg0)``: a quoted format,
then names separated by commas. A probe line of ``trace`` may end so, and its events print
as that line instead of the kernel's trace format. A name is one of the probe's fetched
arguments, a common field of every event (``COMMON_FIELDS``), or what the command line adds
for the peers' habits (``$retval``, ``arg1``..``arg6``: ``trace_cmd.py``).

A format is parsed once, before the program is touched (every fault is a ``SpecError`` with
its column), and bound once per probe (each name to where its events carry it), so an event
costs one ``%`` per conversion.

Conversions are C's: flags ``-+ #0``, a width, a precision, a length (``hh h l ll z j t``)
and ``d i u o x X c s p f e E g G``, ``%%``. An integer conversion cuts the value to the
length's width (``hh`` 8, ``h`` 16, the others 64) or, without one, to the argument's fetch
type (``%x`` of an ``s32`` of -1 is ``ffffffff``, as C prints an ``int``), 64 bits for the
common fields; ``%d``/``%i`` read it signed, ``%u %o %x %X`` unsigned, ``%p`` as ``0x`` and
hex. ``%c`` is a character, ``%s`` any value as the trace line prints it but a string
unquoted, ``%f %e %g`` a number as a float (``time`` is in seconds). A value that cannot take
its conversion (a fetch that faulted) prints ``(fault)`` in its place, as the trace line does.
A final ``\\n`` is dropped: each event is one line.

Rejected: a ``--format`` option with the names after it (one format for probes of different
arguments, and the names away from the probe that fetches them); Python's ``{name}``
templates (not what a bcc or bpftrace user writes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from kprobes.errors import SpecError
from kprobes.model import Event
from kprobes.output.argtypes import FAULT, format_value
from kprobes.values import dataclass

# The fields of every event a format may name, as bcc's and bpftrace's (``time``: seconds).
COMMON_FIELDS: dict[str, Callable[[Event], object]] = {
    "tid": lambda ev: ev.tid,
    "pid": lambda ev: ev.pid,
    "comm": lambda ev: ev.comm,
    "cpu": lambda ev: ev.cpu,
    "time": lambda ev: ev.timestamp,
    "probe": lambda ev: ev.event,
    "func": lambda ev: ev.func if ev.is_return else ev.location.partition("+")[0],
}

_CONVERSION = re.compile(
    r"%(?P<flags>[-+ #0]*)(?P<width>\d+)?(?:\.(?P<precision>\d+))?"
    r"(?P<length>hh|h|ll|l|z|j|t)?(?P<conv>[diouxXcspfeEgG%])"
)
_NAME = re.compile(r"\s*,\s*(?P<name>\$?[A-Za-z_][A-Za-z0-9_]*)\s*")
_LENGTH_BITS = {"hh": 8, "h": 16, "l": 64, "ll": 64, "z": 64, "j": 64, "t": 64}
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
_INTEGER = frozenset("diouxXcp")


@dataclass(frozen=True, slots=True)
class Conversion:
    """One ``%...`` of a format and the name it prints."""

    flags: str  # of ``-+ #0``
    width: int
    precision: int | None
    conv: str  # the C conversion letter
    bits: int | None  # the length modifier's width, if one was written
    name: str
    column: int  # of the name, in the text given to ``parse_printf``


@dataclass(frozen=True, slots=True)
class PrintfFormat:
    """A parsed ``"FORMAT", NAME, ...``: the literal texts around the conversions."""

    literals: tuple[str, ...]  # one more than the conversions
    conversions: tuple[Conversion, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.conversions)


def parse_printf(text: str, column: int = 0) -> PrintfFormat:
    """``"FORMAT", NAME, ...`` (``text[column]`` is the opening quote) as a format."""
    literals, specs, pos = _parse_string(text, column)
    names: list[tuple[str, int]] = []
    while pos < len(text):
        m = _NAME.match(text, pos)
        if m is None:
            raise SpecError(
                "expected ', NAME' after the format", column=_skip_spaces(text, pos), text=text
            )
        names.append((m["name"], m.start("name")))
        pos = m.end()
    if len(specs) != len(names):
        at = specs[len(names)][-1] if len(specs) > len(names) else names[len(specs)][1]
        raise SpecError(
            f"the format has {len(specs)} conversion(s) and {len(names)} argument(s)",
            column=at,
            text=text,
        )
    conversions = tuple(
        Conversion(*spec[:-1], name, name_at)
        for spec, (name, name_at) in zip(specs, names, strict=True)
    )
    return PrintfFormat(tuple(literals), conversions)


def _skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


_Spec = tuple[str, int, int | None, str, int | None, int]  # Conversion's first, then column


def _parse_string(text: str, start: int) -> tuple[list[str], list[_Spec], int]:
    """The quoted format at ``text[start]``: its literals, its conversions (flags, width,
    precision, letter, length bits, column) and where the text after the closing quote
    starts."""
    literals: list[str] = []
    specs: list[_Spec] = []
    literal: list[str] = []
    pos = start + 1
    while True:
        if pos >= len(text):
            raise SpecError("the format has no closing quote", column=start, text=text)
        char = text[pos]
        if char == '"':
            break
        if char == "\\":
            escaped = _ESCAPES.get(text[pos + 1 : pos + 2])
            if escaped is None:
                raise SpecError("unknown escape in the format", column=pos, text=text)
            literal.append(escaped)
            pos += 2
            continue
        if char != "%":
            literal.append(char)
            pos += 1
            continue
        m = _CONVERSION.match(text, pos)
        if m is None:
            raise SpecError(
                "unknown conversion in the format (valid: d i u o x X c s p f e E g G, "
                "with flags -+ #0, a width, .precision, hh h l ll z j t)",
                column=pos,
                text=text,
            )
        pos = m.end()
        if m["conv"] == "%":
            literal.append("%")
            continue
        literals.append("".join(literal))
        literal = []
        precision = int(m["precision"]) if m["precision"] is not None else None
        bits = _LENGTH_BITS.get(m["length"] or "")
        specs.append((m["flags"], int(m["width"] or 0), precision, m["conv"], bits, m.start()))
    last = "".join(literal)
    literals.append(last.removesuffix("\n"))
    return literals, specs, pos + 1


# -- binding, once per probe ---------------------------------------------------------------

Field = tuple[str, int | None]  # a fetched argument's name and integer width (None: not one)


def bind_printf(
    fmt: PrintfFormat,
    fields: Sequence[Field],
    text: str,
    aliases: Mapping[str, str] | None = None,
) -> Callable[[Event], str]:
    """The format over the events of a probe whose arguments are ``fields``, in order: a
    function from an event to its line. ``aliases`` are other names of some fields
    (``$retval``); an unknown name is a ``SpecError`` at its column of ``text``."""
    index = {name: (i, bits) for i, (name, bits) in enumerate(fields)}
    aliases = aliases or {}
    parts = []
    for c in fmt.conversions:
        name = c.name if c.name in index else aliases.get(c.name, c.name)
        if name in index:
            i, bits = index[name]
            get: Callable[[Event], object] = _arg_getter(i, as_text=c.conv == "s")
        elif c.name in COMMON_FIELDS:
            get, bits = COMMON_FIELDS[c.name], None
        else:
            known = ", ".join(name for name, _ in fields) or "none"
            raise SpecError(
                f"unknown name {c.name!r} in the format (the probe's arguments: {known}; "
                f"the common fields: {', '.join(COMMON_FIELDS)})",
                column=c.column,
                text=text,
            )
        parts.append((get, _formatter(c, c.bits or bits or 64)))
    literals = fmt.literals
    faults = [_pad(FAULT, c) for c in fmt.conversions]

    def render(ev: Event) -> str:
        out = [literals[0]]
        for n, (get, format_one) in enumerate(parts):
            try:
                out.append(format_one(get(ev)))
            except (TypeError, ValueError, OverflowError):
                out.append(faults[n])
            out.append(literals[n + 1])
        return "".join(out)

    return render


def _arg_getter(i: int, *, as_text: bool) -> Callable[[Event], object]:
    """The ``i``th argument's value, or for ``%s`` its text: as the trace line prints it,
    a string unquoted."""
    if not as_text:
        return lambda ev: ev.args[i].value

    def text(ev: Event) -> str:
        arg = ev.args[i]
        return arg.value if isinstance(arg.value, str) else format_value(arg.type, arg.value)

    return text


def _pad(text: str, c: Conversion) -> str:
    """``text`` in the conversion's width, as ``%s`` would pad it."""
    return text.ljust(c.width) if "-" in c.flags else text.rjust(c.width)


def _formatter(c: Conversion, bits: int) -> Callable[[object], str]:
    """How one value prints: Python's ``%`` but where it is not C's (``#`` of x X o)."""
    convert = _converter(c.conv, bits)
    if "#" in c.flags and c.conv in "xXo":
        return lambda v: _alternate(c, _int(convert(v)))
    flags = c.flags.replace("#", "") if c.conv in "cs" else c.flags
    precision = f".{c.precision}" if c.precision is not None else ""
    letter = {"i": "d", "u": "d", "p": "s"}.get(c.conv, c.conv)
    spec = f"%{flags}{c.width or ''}{precision}{letter}"
    return lambda v: spec % convert(v)


def _alternate(c: Conversion, value: int) -> str:
    """C's ``%#x``/``%#o``: ``0x`` before a hex value but 0, a ``0`` before an octal one
    (Python writes ``0x0`` and ``0o10``)."""
    digits = format(value, c.conv)
    if c.precision is not None:
        digits = digits.zfill(c.precision)
    prefix = ("0" + c.conv if value else "") if c.conv in "xX" else ""
    if c.conv == "o" and not digits.startswith("0"):
        digits = "0" + digits
    if "0" in c.flags and "-" not in c.flags and c.precision is None:
        digits = digits.zfill(c.width - len(prefix))
    return _pad(prefix + digits, c)


def _converter(conv: str, bits: int) -> Callable[[object], object]:
    """How a value becomes what Python's ``%`` takes for ``conv``."""
    mask = (1 << bits) - 1
    if conv in "di":
        return lambda v: _signed(_int(v) & mask, bits)
    if conv in "uoxX":
        return lambda v: _int(v) & mask
    if conv == "p":
        return lambda v: f"0x{_int(v) & mask:x}"
    if conv == "c":
        return lambda v: v[:1] if isinstance(v, str) else chr(_int(v) & 0xFF)
    if conv == "s":
        return str
    return lambda v: float(_number(v))  # f e E g G


def _number(value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"not a number: {value!r}")
    return value


def _int(value: object) -> int:
    return int(_number(value))


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >> (bits - 1) else value
