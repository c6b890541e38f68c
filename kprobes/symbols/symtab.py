"""The symbol tables of an ELF file: every entry decoded at once, or only those asked for.

``build_tables`` decodes every defined symbol of ``.symtab`` and ``.dynsym`` into a
``Symbol`` and indexes them by name and by address: what a glob, a listing or a "did you
mean" needs. Most commands ask a file about one name or two and which function holds one
address (the jump optimizer asks it of every site): ``NameIndex`` answers both from the raw
bytes and makes a ``Symbol`` only for the entries that answer, with the same choice among
same-named symbols and the same function at each address as the full tables (tests compare
them on every symbol of libc and of test programs). For libc's 3,000 dynamic symbols that
is ~1 ms instead of ~20 ms of the tool's start (docs/performance.md, "a fifth time").

Rejected: the file's own hash tables (``.gnu.hash``, ``.hash``): they cover ``.dynsym``'s
exported symbols alone, not ``.symtab`` nor ``.dynsym``'s locals, and a name's versions
would still need the version table; a search of the string table covers every table alike.
"""

from __future__ import annotations

import array
import bisect
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import Enum
from operator import itemgetter
from typing import Final

from kprobes.values import dataclass

_SYM_FORMAT: Final = "<IBBHQQ"  # Elf64_Sym: st_name st_info st_other st_shndx st_value st_size
_SYM: Final = struct.Struct(_SYM_FORMAT)
_SYM_SIZE: Final = _SYM.size
_SYM_NAME: Final = struct.Struct("<I")  # an Elf64_Sym's st_name, at its offset 0
_SYM_VALUE: Final = struct.Struct("<Q")  # its st_value, at offset 8

# st_info: type in the low nibble, binding in the high nibble (elf.h).
_STT_OBJECT: Final = 1
_STT_FUNC: Final = 2
_STT_SECTION: Final = 3
_STT_FILE: Final = 4
_STT_GNU_IFUNC: Final = 10
_STB_LOCAL: Final = 0
_STB_GLOBAL: Final = 1
_STB_WEAK: Final = 2
_SHN_UNDEF: Final = 0
_FUNCTION_TYPES: Final = (_STT_FUNC, _STT_GNU_IFUNC)
_VERSYM_HIDDEN: Final = 0x8000  # .gnu.version: this entry is not the default version

TABLE_NAMES: Final = (".symtab", ".dynsym")


class SymbolKind(Enum):
    """What a symbol names, reduced to the distinctions probing cares about."""

    FUNC = "func"
    IFUNC = "ifunc"  # STT_GNU_IFUNC: the value is a resolver that returns the implementation
    OBJECT = "object"
    OTHER = "other"

    @property
    def is_function(self) -> bool:
        return self is SymbolKind.FUNC or self is SymbolKind.IFUNC


_KIND_OF_TYPE: Final = {
    _STT_FUNC: SymbolKind.FUNC,
    _STT_GNU_IFUNC: SymbolKind.IFUNC,
    _STT_OBJECT: SymbolKind.OBJECT,
}


@dataclass(frozen=True, slots=True)
class Symbol:
    """A defined symbol; ``value`` is the link-time address, before any load bias."""

    name: str  # without the version suffix
    value: int
    size: int
    kind: SymbolKind
    table: str  # ".symtab" or ".dynsym"


# A decoded entry with the facts used to choose among same-named symbols, best first:
# functions before data, default versions before hidden ones, global before weak before
# local, .symtab before .dynsym. Plain tuples sort and compare without any Python code.
_Ranked = tuple[tuple[int, int, int, int], Symbol]
_Entry = tuple[int, int, int, int, int, int]  # an Elf64_Sym's fields

_BINDING_RANK: Final = {_STB_GLOBAL: 0, _STB_WEAK: 1, _STB_LOCAL: 2}


@dataclass(frozen=True, slots=True)
class RawTable:
    """The undecoded bytes of one symbol table, its string table and its version table."""

    name: str
    symbols: bytes
    strings: bytes
    versions: bytes  # .gnu.version for .dynsym, b"" otherwise


@dataclass(frozen=True, slots=True)
class Tables:
    """Everything derived from the symbol tables, built once per image."""

    by_name: dict[str, tuple[Symbol, ...]]  # best first
    functions: tuple[Symbol, ...]  # FUNC/IFUNC, value != 0, unique by (name, value), by address
    starts: tuple[int, ...]  # sorted start addresses, one per entry of ``at_start``
    at_start: tuple[Symbol, ...]  # the preferred function at each start address


def decode(raw: RawTable, records: Iterable[tuple[int, _Entry]]) -> list[_Ranked]:
    """The defined symbols among ``records`` (an entry's index and its fields) of one
    table, with their rank, skipping the null entry 0.

    The loop runs once per symbol of the file for the full tables (libc's .dynsym: 3,000; a
    program's .symtab can hold a million): what does not depend on the entry is looked up
    before it."""
    strings = raw.strings
    n_strings = len(strings)
    versions = array.array("H", raw.versions[: len(raw.versions) // 2 * 2])
    if sys.byteorder != "little":
        versions.byteswap()
    n_versions = len(versions)
    table_rank = TABLE_NAMES.index(raw.name)
    kind_of, binding_rank, table = _KIND_OF_TYPE.get, _BINDING_RANK.get, raw.name
    other, func, ifunc = SymbolKind.OTHER, SymbolKind.FUNC, SymbolKind.IFUNC
    skipped_types = (_STT_SECTION, _STT_FILE)
    find = strings.find
    out: list[_Ranked] = []
    for index, (st_name, st_info, _other, st_shndx, st_value, st_size) in records:
        if index == 0 or st_shndx == _SHN_UNDEF or st_name >= n_strings:
            continue
        if st_info & 0xF in skipped_types:
            continue
        end = find(b"\0", st_name)
        full = strings[st_name : end if end >= 0 else n_strings].decode("utf-8", "replace")
        if not full:
            continue
        name, at, version = full.partition("@")
        if at:  # .symtab spells versions into the name: "memcpy@GLIBC_2.2.5" is not the default
            is_hidden = not version.startswith("@")
        elif index < n_versions:
            is_hidden = bool(versions[index] & _VERSYM_HIDDEN)
        else:
            is_hidden = False
        kind = kind_of(st_info & 0xF, other)
        rank = (
            0 if kind is func or kind is ifunc else 1,
            int(is_hidden),
            binding_rank(st_info >> 4, 3),
            table_rank,
        )
        out.append((rank, Symbol(name, st_value, st_size, kind, table)))
    return out


def display_rank(symbol: Symbol) -> tuple[int, int, int, str]:
    """Order aliases at one address for display: sized, fewest leading underscores, shortest."""
    stripped = symbol.name.lstrip("_")
    return (
        0 if symbol.size else 1,
        len(symbol.name) - len(stripped),
        len(symbol.name),
        symbol.name,
    )


def build_tables(raw_tables: tuple[RawTable, ...]) -> Tables:
    ranked = [item for raw in raw_tables for item in decode(raw, enumerate(entries(raw)))]
    ranked.sort(key=itemgetter(0))  # stable: equal ranks keep table order
    by_name: dict[str, list[Symbol]] = {}
    functions: dict[tuple[str, int], Symbol] = {}
    for _rank, symbol in ranked:
        same_name = by_name.get(symbol.name)
        if same_name is None:
            by_name[symbol.name] = [symbol]
        elif all(other.value != symbol.value for other in same_name):  # .symtab repeats .dynsym
            same_name.append(symbol)
        if _rank[0] == 0 and symbol.value != 0:  # a function
            functions.setdefault((symbol.name, symbol.value), symbol)
    # Step 1: one symbol per start address, the one a reader would want to see.
    best_at: dict[int, Symbol] = {}
    for symbol in functions.values():
        current = best_at.get(symbol.value)
        if current is None or display_rank(symbol) < display_rank(current):
            best_at[symbol.value] = symbol
    # Step 2: sort by start for bisection.
    starts = tuple(sorted(best_at))
    return Tables(
        by_name={name: tuple(symbols) for name, symbols in by_name.items()},
        functions=tuple(sorted(functions.values(), key=lambda s: (s.value, s.name))),
        starts=starts,
        at_start=tuple(best_at[start] for start in starts),
    )


def entries(raw: RawTable) -> Iterator[_Entry]:
    """Every entry of the table, in order (a truncated last entry left out)."""
    usable = len(raw.symbols) - len(raw.symbols) % _SYM_SIZE
    return struct.iter_unpack(_SYM_FORMAT, raw.symbols[:usable])


def _columns(raw: RawTable) -> Iterable[tuple[int, int, int, int]]:
    """(st_value, st_info, st_shndx, st_name) of every entry: read in place through
    memoryviews, no tuple of six unpacked per entry, on a little-endian host (the file's)."""
    usable = len(raw.symbols) - len(raw.symbols) % _SYM_SIZE
    if sys.byteorder != "little":
        return ((e[4], e[1], e[3], e[0]) for e in entries(raw))
    view = memoryview(raw.symbols)[:usable]
    return zip(
        view.cast("Q")[1::3], view[4::24], view.cast("H")[3::12], view.cast("I")[::6], strict=True
    )


def _entries_named(raw: RawTable, offset: int) -> Iterator[int]:
    """The index of each entry whose st_name is ``offset``."""
    return _entries_with(raw, _SYM_NAME.pack(offset), 0)


def _entries_valued(raw: RawTable, value: int) -> Iterator[int]:
    """The index of each entry whose st_value is ``value``."""
    return _entries_with(raw, _SYM_VALUE.pack(value), 8)


def _entries_with(raw: RawTable, key: bytes, field: int) -> Iterator[int]:
    """The index of each entry whose bytes at ``field`` are ``key``: found by a search in C
    of the table's bytes, kept where the field of an entry is, not by a loop over entries."""
    symbols = raw.symbols
    usable = len(symbols) - len(symbols) % _SYM_SIZE
    at = symbols.find(key, field, usable)
    while at >= 0:
        if at % _SYM_SIZE == field:
            yield at // _SYM_SIZE
        at = symbols.find(key, at + 1, usable)


# How many earlier functions function_at() examines when the nearest one ends before the
# address: enough to step over zero-sized labels placed inside a function.
_LOOKBEHIND: Final = 8


def holder(
    starts: Sequence[int], at_start: Callable[[int], Symbol], vaddr: int
) -> tuple[Symbol, int] | None:
    """The function whose [value, value + max(size, 1)) holds ``vaddr``, and the offset:
    ``starts`` sorted, ``at_start(i)`` the preferred function at ``starts[i]``."""
    index = bisect.bisect_right(starts, vaddr) - 1
    for candidate in range(index, max(index - _LOOKBEHIND, -1), -1):
        symbol = at_start(candidate)
        if vaddr < symbol.value + max(symbol.size, 1):
            return symbol, vaddr - symbol.value
    return None


class NameIndex:
    """One name's symbols and the function at an address, from the raw tables.

    Each answer is what ``build_tables`` would give: the same entries are decoded by the same
    ``decode``, ranked and chosen the same way; only the entries that answer are decoded.
    Its caches are filled idempotently: two threads asking at once compute one answer twice.
    """

    def __init__(self, raw_tables: tuple[RawTable, ...]) -> None:
        self._raw = raw_tables
        self._named: dict[str, tuple[Symbol, ...]] = {}
        self._starts: tuple[int, ...] | None = None  # every function's start, sorted
        self._best: dict[int, Symbol] = {}  # start → the preferred function there

    def lookup_all(self, name: str) -> tuple[Symbol, ...]:
        """Every symbol called ``name`` (no version suffix) at a distinct address, best first."""
        found = self._named.get(name)
        if found is None:
            ranked = [
                item
                for table, raw in enumerate(self._raw)
                for item in decode(raw, self._named_entries(table, name))
                if item[1].name == name
            ]
            ranked.sort(key=itemgetter(0))  # stable: equal ranks keep table and index order
            chosen: list[Symbol] = []
            for _rank, symbol in ranked:  # .symtab repeats .dynsym: one per address
                if all(other.value != symbol.value for other in chosen):
                    chosen.append(symbol)
            found = self._named[name] = tuple(chosen)
        return found

    def function_at(self, vaddr: int) -> tuple[Symbol, int] | None:
        """The function that holds ``vaddr`` (link-time), and the offset in it."""
        starts = self._starts
        if starts is None:
            starts = self._starts = self._function_starts()
        return holder(starts, lambda i: self._best_at(starts[i]), vaddr)

    def _named_entries(self, table: int, name: str) -> Iterator[tuple[int, _Entry]]:
        """The entries of ``table`` whose name may be ``name``: those whose st_name points
        at its bytes followed by the string's end or a version's ``@``."""
        raw = self._raw[table]
        try:
            want = name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no decoded name holds one
            return iter(())
        if not want or "\ufffd" in name:  # an empty name, or bytes decoding replaced
            return enumerate(entries(raw))
        strings, size = raw.strings, len(want)
        at = strings.find(want)
        offsets: list[int] = []
        while at >= 0:
            after = at + size
            if after == len(strings) or strings[after] in b"\0@":
                offsets.append(at)
            at = strings.find(want, at + 1)
        indices = sorted(index for at in offsets for index in _entries_named(raw, at))
        return ((i, _SYM.unpack_from(raw.symbols, i * _SYM_SIZE)) for i in indices)

    def _function_starts(self) -> tuple[int, ...]:
        """Where the functions of ``build_tables`` start: the values of the entries
        ``decode`` keeps whose type is FUNC or IFUNC and value is not 0."""
        starts: set[int] = set()
        for raw in self._raw:
            strings = raw.strings
            n_strings = len(strings)
            starts.update(
                st_value
                for index, (st_value, st_info, st_shndx, st_name) in enumerate(_columns(raw))
                if st_value
                and st_info & 0xF in _FUNCTION_TYPES
                and st_shndx != _SHN_UNDEF
                and index
                and st_name < n_strings
                and strings[st_name]
            )
        return tuple(sorted(starts))

    def _best_at(self, start: int) -> Symbol:
        """The function ``build_tables`` shows at ``start``: of the functions there, the
        best ranked of each name, then the first by ``display_rank``."""
        best = self._best.get(start)
        if best is None:
            ranked: list[_Ranked] = []
            for raw in self._raw:
                records = (
                    (i, _SYM.unpack_from(raw.symbols, i * _SYM_SIZE))
                    for i in _entries_valued(raw, start)
                )
                ranked += (item for item in decode(raw, records) if item[0][0] == 0)
            ranked.sort(key=itemgetter(0))
            functions: dict[str, Symbol] = {}
            for _rank, symbol in ranked:
                functions.setdefault(symbol.name, symbol)
            best = self._best[start] = min(functions.values(), key=display_rank)
        return best
