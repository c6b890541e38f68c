"""The kernel's lexical rules for probe and filter text: words, numbers and names.

Every rule here mirrors one helper the kernel's parser calls, so a line that the kernel would
split or convert differently is rejected here too:

* ``split_words``: ``argv_split()``: a probe line is words separated by ASCII white space. Quotes
  mean nothing to it (``\\"a b"`` is two words, as in the kernel). We keep each word's column,
  which the kernel loses, so an error can point into the text the user wrote.
* ``parse_unsigned`` / ``parse_signed``: ``kstrtoul(s, 0)`` / ``kstrtol(s, 0)``: ``0x`` hex, a
  leading ``0`` octal, decimal otherwise, the whole word, within 64 bits.
* ``is_good_name`` / ``is_good_group_name``: C identifiers; a group may also hold ``-``.

Rejected alternative: Python's ``int(s, 0)``. It takes ``0o17``, ``0b1``, ``1_000`` and refuses
``017``, none of which is what the kernel does.
"""

from __future__ import annotations

from kprobes.errors import SpecError
from kprobes.values import dataclass

WHITESPACE = " \t\n\v\f\r"
"""``isspace()`` in the kernel's ctype: the only separators of a probe line."""

U64_MAX = (1 << 64) - 1
S64_MIN = -(1 << 63)
S64_MAX = (1 << 63) - 1
U32_MAX = (1 << 32) - 1

MAX_EVENT_NAME_LEN = 64
"""Group and event names are stored in 64-byte buffers with their NUL: at most 63 chars."""

_DIGITS = "0123456789"
_HEX_DIGITS = "0123456789abcdefABCDEF"
_OCT_DIGITS = "01234567"
_ALPHA = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NAME_START = frozenset(_ALPHA + "_")
_NAME_CHARS = frozenset(_ALPHA + _DIGITS + "_")


@dataclass(frozen=True, slots=True)
class Word:
    """One white-space separated word of the text, and the column where it starts."""

    text: str
    column: int

    @property
    def end(self) -> int:
        return self.column + len(self.text)


def split_words(text: str) -> list[Word]:
    """Split like ``argv_split()``, remembering where each word starts."""
    words: list[Word] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] in WHITESPACE:
            i += 1
            continue
        start = i
        while i < n and text[i] not in WHITESPACE:
            i += 1
        words.append(Word(text[start:i], start))
    return words


def _parse_magnitude(s: str, base: int | None) -> int | None:
    """The digits of ``_parse_integer_fixup_radix()`` + ``_parse_integer()``, all of ``s``."""
    if base is None:
        if len(s) > 2 and s[0] == "0" and s[1] in "xX" and s[2] in _HEX_DIGITS:
            base, s = 16, s[2:]
        elif s.startswith("0"):
            base = 8
        else:
            base = 10
    allowed = {16: _HEX_DIGITS, 8: _OCT_DIGITS, 10: _DIGITS}[base]
    if not s or any(c not in allowed for c in s):
        return None
    return int(s, base)


def parse_unsigned(s: str, *, base: int | None = None, limit: int = U64_MAX) -> int | None:
    """``kstrtoul(s, base)``: the value, or None if ``s`` is not a number within ``limit``."""
    if s.startswith("+"):
        s = s[1:]
    value = _parse_magnitude(s, base)
    if value is None or value > limit:
        return None
    return value


def parse_signed(s: str) -> int | None:
    """``kstrtol(s, 0)``: an optional sign, then an unsigned number, within signed 64 bits."""
    if s.startswith("-"):
        value = _parse_magnitude(s[1:], None)
        if value is None or value > -S64_MIN:
            return None
        return -value
    value = parse_unsigned(s)
    if value is None or value > S64_MAX:
        return None
    return value


def is_good_name(name: str) -> bool:
    """``is_good_name()``: event and argument names are C identifiers (ASCII)."""
    return bool(name) and name[0] in _NAME_START and all(c in _NAME_CHARS for c in name)


def is_good_group_name(name: str) -> bool:
    """``is_good_system_name()``: a group is a C identifier that may also contain ``-``."""
    return (
        bool(name)
        and (name[0] in _NAME_START or name[0] == "-")
        and all(c in _NAME_CHARS or c == "-" for c in name)
    )


def sanitize_event_name(name: str) -> str:
    """Make a generated event name a C identifier.

    The kernel's ``sanitize_event_name()`` turns ``:`` ``.`` ``*`` into ``_``; we turn every
    other non-identifier character too (``$`` ``@`` of user-space symbols, ``+`` of a file
    name), so a generated name always passes ``is_good_name``.
    """
    return "".join(c if c in _NAME_CHARS else "_" for c in name)[: MAX_EVENT_NAME_LEN - 1]


def format_number(value: int) -> str:
    """A number as the shorter of decimal and ``0x`` hex (decimal on a tie), with its sign.

    Never longer than any spelling ``parse_signed`` accepts for the same value, so rendering
    a fetch argument never pushes it over the kernel's length limit.
    """
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    dec, hexa = str(magnitude), f"0x{magnitude:x}"
    return sign + (hexa if len(hexa) < len(dec) else dec)


def spec_error(message: str, column: int, text: str, hint: str = "") -> SpecError:
    """The one way this package builds its exception (column clamped into the text)."""
    return SpecError(message, column=max(0, min(column, len(text))), text=text, hint=hint)
