"""One ELF file as the resolver needs it: its loadable segments and its function symbols.

The file header, the program headers, the section headers and the symbol tables are all
fixed-size little-endian records, decoded here with ``struct`` (pyelftools, which reads
DWARF elsewhere, is not imported for this: it costs the command ~50 ms to import and builds
one parsed container per entry, ~60 ms for libc's ``.dynsym``, where unpacking the same
3000 ``Elf64_Sym`` records as tuples takes a few milliseconds). Everything is decoded once
per file and kept in plain dicts and sorted tuples.

Images are cached by file identity (real path, device, inode, modification time), so every
process that maps libc shares one ``ElfImage``, and a file rewritten in place is read again.
Opening reads only the headers and the raw bytes of the symbol sections; the tables are
decoded on the first query, because a process maps dozens of libraries and most of them are
never asked about.
"""

from __future__ import annotations

import array
import bisect
import difflib
import errno as _errno
import os
import stat
import struct
import sys
import threading
from collections.abc import Iterator
from enum import Enum
from operator import itemgetter
from typing import Any, BinaryIO, Final

from kprobes.errors import TargetError
from kprobes.values import dataclass

# Elf64_Ehdr after e_ident: e_type e_machine e_version e_entry e_phoff e_shoff e_flags
# e_ehsize e_phentsize e_phnum e_shentsize e_shnum e_shstrndx.
_EHDR: Final = struct.Struct("<HHIQQQIHHHHHH")
_PHDR: Final = struct.Struct("<IIQQQQQQ")  # p_type p_flags p_offset p_vaddr p_paddr ...
_SHDR: Final = struct.Struct("<IIQQQQIIQQ")  # sh_name sh_type sh_flags sh_addr sh_offset ...
_ELFCLASS64: Final = 2
_ELFDATA2LSB: Final = 1
_EM_X86_64: Final = 62
_ET_DYN: Final = 3
_PT_LOAD: Final = 1
_SHT_NOBITS: Final = 8
_PN_XNUM: Final = 0xFFFF  # e_phnum overflowed: the count is section 0's sh_info
_SHN_XINDEX: Final = 0xFFFF  # e_shstrndx overflowed: the index is section 0's sh_link

_SYM_FORMAT: Final = "<IBBHQQ"  # Elf64_Sym: st_name st_info st_other st_shndx st_value st_size
_SYM_SIZE: Final = struct.calcsize(_SYM_FORMAT)

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
_VERSYM_HIDDEN: Final = 0x8000  # .gnu.version: this entry is not the default version

_TABLE_NAMES: Final = (".symtab", ".dynsym")

# A "did you mean" compares the missing name with at most this many names of a similar
# length (difflib is about 2 us a name): an error path, but one that must stay quick on a
# file with a million symbols.
_HINT_CANDIDATES: Final = 50_000
_HINT_COUNT: Final = 3


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


@dataclass(frozen=True, slots=True)
class Segment:
    """One PT_LOAD program header: how a range of the file is laid out in memory."""

    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int  # PF_X = 1, PF_W = 2, PF_R = 4


# A decoded entry with the facts used to choose among same-named symbols, best first:
# functions before data, default versions before hidden ones, global before weak before
# local, .symtab before .dynsym. Plain tuples sort and compare without any Python code.
_Ranked = tuple[tuple[int, int, int, int], Symbol]

_BINDING_RANK: Final = {_STB_GLOBAL: 0, _STB_WEAK: 1, _STB_LOCAL: 2}


@dataclass(frozen=True, slots=True)
class _RawTable:
    """The undecoded bytes of one symbol table, its string table and its version table."""

    name: str
    symbols: bytes
    strings: bytes
    versions: bytes  # .gnu.version for .dynsym, b"" otherwise


@dataclass(frozen=True, slots=True)
class _Tables:
    """Everything derived from the symbol tables, built once per image."""

    by_name: dict[str, tuple[Symbol, ...]]  # best first
    functions: tuple[Symbol, ...]  # FUNC/IFUNC, value != 0, unique by (name, value), by address
    starts: tuple[int, ...]  # sorted start addresses, one per entry of ``at_start``
    at_start: tuple[Symbol, ...]  # the preferred function at each start address


def _decode(raw: _RawTable) -> list[_Ranked]:
    """Every defined symbol of one table with its rank, skipping the null entry 0.

    The loop runs once per symbol of the file (libc's .dynsym: 3,000; a program's .symtab
    can hold a million): what does not depend on the entry is looked up before it."""
    strings = raw.strings
    n_strings = len(strings)
    versions = array.array("H", raw.versions[: len(raw.versions) // 2 * 2])
    if sys.byteorder != "little":
        versions.byteswap()
    n_versions = len(versions)
    table_rank = _TABLE_NAMES.index(raw.name)
    kind_of, binding_rank, table = _KIND_OF_TYPE.get, _BINDING_RANK.get, raw.name
    other, func, ifunc = SymbolKind.OTHER, SymbolKind.FUNC, SymbolKind.IFUNC
    skipped_types = (_STT_SECTION, _STT_FILE)
    find = strings.find
    usable = len(raw.symbols) - len(raw.symbols) % _SYM_SIZE
    out: list[_Ranked] = []
    index = -1
    for st_name, st_info, _other, st_shndx, st_value, st_size in struct.iter_unpack(
        _SYM_FORMAT, raw.symbols[:usable]
    ):
        index += 1
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


def _display_rank(symbol: Symbol) -> tuple[int, int, int, str]:
    """Order aliases at one address for display: sized, fewest leading underscores, shortest."""
    stripped = symbol.name.lstrip("_")
    return (
        0 if symbol.size else 1,
        len(symbol.name) - len(stripped),
        len(symbol.name),
        symbol.name,
    )


def _build(raw_tables: tuple[_RawTable, ...]) -> _Tables:
    ranked: list[_Ranked] = [item for raw in raw_tables for item in _decode(raw)]
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
        if current is None or _display_rank(symbol) < _display_rank(current):
            best_at[symbol.value] = symbol
    # Step 2: sort by start for bisection.
    starts = tuple(sorted(best_at))
    return _Tables(
        by_name={name: tuple(symbols) for name, symbols in by_name.items()},
        functions=tuple(sorted(functions.values(), key=lambda s: (s.value, s.name))),
        starts=starts,
        at_start=tuple(best_at[start] for start in starts),
    )


_Section = tuple[int, int, int, int, int, int, int, int, int, int]  # an Elf64_Shdr


class _FileReader:
    """Exact reads of an open ELF file: every short read is a truncated file (ValueError)."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream

    def read(self, offset: int, size: int) -> bytes:
        self._stream.seek(offset)
        data = self._stream.read(size)
        if len(data) != size:
            raise ValueError(f"truncated: {size} bytes at {offset:#x}, {len(data)} read")
        return data

    def records(self, fmt: struct.Struct, offset: int, entsize: int, count: int) -> list[Any]:
        """``count`` records of ``fmt``, ``entsize`` bytes apart, from ``offset``."""
        if count == 0 or offset == 0:
            return []
        if entsize < fmt.size:
            raise ValueError(f"header entries of {entsize} bytes, {fmt.size} expected")
        table = self.read(offset, entsize * count)
        return [fmt.unpack_from(table, i * entsize) for i in range(count)]

    def sections(self, shoff: int, entsize: int, count: int) -> list[_Section]:
        if shoff and count == 0:  # more than 0xff00 sections: the count is in section 0
            count = _SHDR.unpack(self.read(shoff, _SHDR.size))[5]
        return self.records(_SHDR, shoff, entsize, count)

    def headers(self) -> tuple[tuple[int, ...], list[_Section], dict[str, int]]:
        """The file header after e_ident (``_EHDR``), the section headers, and each
        section's index by name; the overflow escapes of e_phnum/e_shstrndx resolved."""
        header = list(_EHDR.unpack(self.read(16, _EHDR.size)))
        sections = self.sections(header[5], header[10], header[11])
        if header[9] == _PN_XNUM and sections:
            header[9] = sections[0][7]
        if header[12] == _SHN_XINDEX and sections:
            header[12] = sections[0][6]
        return tuple(header), sections, self.section_names(sections, header[12])

    def section_data(self, section: _Section) -> bytes:
        if section[1] == _SHT_NOBITS:
            return b""
        return self.read(section[4], section[5])

    def section_names(self, sections: list[_Section], shstrndx: int) -> dict[str, int]:
        """Each section's name and its index (the first of a repeated name)."""
        if not 0 < shstrndx < len(sections):
            return {}
        strings = self.section_data(sections[shstrndx])
        names: dict[str, int] = {}
        for index, section in enumerate(sections):
            end = strings.find(b"\0", section[0])
            if section[0] < len(strings):
                name = strings[section[0] : end if end >= 0 else len(strings)]
                names.setdefault(name.decode("utf-8", "replace"), index)
        return names


def read_sections(path: str, names: tuple[str, ...]) -> dict[str, tuple[int, bytes]]:
    """``{name: (sh_addr, bytes)}`` of the sections of the file at ``path`` called one of
    ``names`` (NOBITS sections, which have no bytes in the file, are left out). Raises
    OSError when the file cannot be read, ValueError when it is not a well-formed ELF64."""
    with open(path, "rb") as stream:
        file = _FileReader(stream)
        if file.read(0, 4) != b"\x7fELF":
            raise ValueError("not an ELF file")
        _header, sections, found = file.headers()
        return {
            name: (sections[found[name]][3], file.section_data(sections[found[name]]))
            for name in names
            if name in found and sections[found[name]][1] != _SHT_NOBITS
        }


def build_id(path: str) -> str | None:
    """The GNU build-id of the file at ``path`` in hex (its ``.note.gnu.build-id``), None
    if it has none or cannot be read: what tells a file from another of the same path."""
    try:
        note = read_sections(path, (".note.gnu.build-id",)).get(".note.gnu.build-id")
    except (OSError, ValueError):
        return None
    if note is None or len(note[1]) < 16:
        return None
    data = note[1]
    namesz, descsz, kind = struct.unpack_from("<III", data, 0)
    start = 12 + (namesz + 3) // 4 * 4
    if kind != 3 or start + descsz > len(data):  # NT_GNU_BUILD_ID
        return None
    return data[start : start + descsz].hex()


# How many earlier functions function_at() examines when the nearest one ends before the
# address: enough to step over zero-sized labels placed inside a function.
_LOOKBEHIND: Final = 8

_CacheKey = tuple[str, int, int, int, int]
_cache: dict[_CacheKey, ElfImage] = {}
# Files known not to be x86-64 ELF (locale archives, fonts, caches): a maps refresh skips
# them without reading them again.
_refused: dict[_CacheKey, str] = {}
_cache_lock = threading.Lock()


class ElfImage:
    """A parsed x86-64 ELF file; one instance per file identity, shared through a cache."""

    __slots__ = ("_lock", "_raw", "_tables", "is_dyn", "path", "segments", "tables")

    def __init__(
        self,
        path: str,
        *,
        is_dyn: bool,
        segments: tuple[Segment, ...],
        raw_tables: tuple[_RawTable, ...],
    ) -> None:
        self.path = path
        self.is_dyn = is_dyn
        self.segments = segments
        self.tables: tuple[str, ...] = tuple(raw.name for raw in raw_tables)
        self._raw: tuple[_RawTable, ...] | None = raw_tables
        self._tables: _Tables | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ElfImage({self.path!r}, is_dyn={self.is_dyn}, tables={self.tables})"

    @classmethod
    def open(cls, path: str) -> ElfImage:
        """Return the image of the file at ``path``, reading it only if this file is new.

        Raises TargetError naming the path when the file is unreadable, not ELF, or not an
        x86-64 ELF64 object.
        """
        try:
            st = os.stat(path)
        except OSError as exc:
            raise TargetError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc
        if not stat.S_ISREG(st.st_mode):
            # Never open devices: a process may map /dev/dri/* or /dev/mem.
            raise TargetError(f"{path} is not a regular file", errno=_errno.ENOEXEC)
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        with _cache_lock:
            cached = _cache.get(key)
            refusal = _refused.get(key)
        if cached is not None:
            return cached
        if refusal is not None:
            raise TargetError(refusal)
        try:
            image = cls._read(path)
        except TargetError as exc:
            if exc.errno == _errno.ENOEXEC:  # a property of the file, not of this attempt
                with _cache_lock:
                    _refused[key] = exc.message
            raise
        with _cache_lock:
            return _cache.setdefault(key, image)

    @classmethod
    def _read(cls, path: str) -> ElfImage:
        try:
            with open(path, "rb") as stream:
                if stream.read(4) != b"\x7fELF":
                    raise TargetError(f"{path} is not an ELF file", errno=_errno.ENOEXEC)
                return cls._parse(path, _FileReader(stream))
        except OSError as exc:
            raise TargetError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc
        except (struct.error, ValueError) as exc:
            raise TargetError(
                f"{path} is not a valid ELF file: {exc}", errno=_errno.ENOEXEC
            ) from exc

    @classmethod
    def _parse(cls, path: str, file: _FileReader) -> ElfImage:
        ident = file.read(0, 20)  # e_ident, e_type, e_machine
        e_machine = int.from_bytes(ident[18:20], "little")
        if ident[4] != _ELFCLASS64 or ident[5] != _ELFDATA2LSB or e_machine != _EM_X86_64:
            bits = {1: "32", 2: "64"}.get(ident[4], "?")
            raise TargetError(
                f"{path} is not an x86-64 ELF file (ELF{bits}, e_machine {e_machine})",
                errno=_errno.ENOEXEC,
            )
        header, sections, names = file.headers()
        e_type, phoff, phentsize, phnum = header[0], header[4], header[8], header[9]
        segments = tuple(
            Segment(vaddr=ph[3], offset=ph[2], filesz=ph[5], memsz=ph[6], flags=ph[1])
            for ph in file.records(_PHDR, phoff, phentsize, phnum)
            if ph[0] == _PT_LOAD
        )
        raw_tables: list[_RawTable] = []
        for name in _TABLE_NAMES:
            index = names.get(name)
            if index is None or sections[index][1] == _SHT_NOBITS:
                continue
            link = sections[index][6]
            if link >= len(sections):
                raise ValueError(f"{name} links to section {link} of {len(sections)}")
            versions = b""
            if name == ".dynsym" and ".gnu.version" in names:
                versions = file.section_data(sections[names[".gnu.version"]])
            raw_tables.append(
                _RawTable(
                    name,
                    file.section_data(sections[index]),
                    file.section_data(sections[link]),
                    versions,
                )
            )
        return cls(path, is_dyn=e_type == _ET_DYN, segments=segments, raw_tables=tuple(raw_tables))

    def _symbols(self) -> _Tables:
        tables = self._tables
        if tables is None:
            with self._lock:
                if self._tables is None:
                    raw = self._raw
                    assert raw is not None, "raw tables are dropped only after decoding"
                    self._tables = _build(raw)
                    self._raw = None
                tables = self._tables
        return tables

    def lookup(self, name: str) -> Symbol | None:
        """The best symbol called ``name``: a function, the default version, global, .symtab.

        ``name`` may carry a version suffix ("memcpy@@GLIBC_2.14"); it is ignored.
        """
        candidates = self._symbols().by_name.get(name.partition("@")[0])
        return candidates[0] if candidates else None

    def lookup_all(self, name: str) -> tuple[Symbol, ...]:
        """Every symbol called ``name`` at a distinct address, best first.

        More than one means the name is ambiguous (static functions of the same name in
        several source files, or several versions of one libc function).
        """
        return self._symbols().by_name.get(name.partition("@")[0], ())

    def closest_names(self, name: str, *, functions_only: bool = True) -> list[str]:
        """The names nearest ``name`` (at most three, nearest first), for a "did you mean".

        Only names within a third of its length (at least 3 characters) are compared, and
        at most ``_HINT_CANDIDATES`` of them, so a large ``.symtab`` still answers at once.
        """
        tables = self._symbols()
        pool = {s.name for s in tables.functions} if functions_only else set(tables.by_name)
        want = name.partition("@")[0]
        slack = max(3, len(want) // 3)
        near = sorted(
            (n for n in pool if abs(len(n) - len(want)) <= slack),
            key=lambda n: (abs(len(n) - len(want)), n),
        )
        return difflib.get_close_matches(want, near[:_HINT_CANDIDATES], n=_HINT_COUNT)

    def iter_functions(self) -> Iterator[Symbol]:
        """FUNC and IFUNC symbols with a non-zero value, one per (name, value), by address."""
        return iter(self._symbols().functions)

    def function_at(self, vaddr: int) -> tuple[Symbol, int] | None:
        """The function whose [value, value + max(size, 1)) holds ``vaddr``, and the offset."""
        tables = self._symbols()
        index = bisect.bisect_right(tables.starts, vaddr) - 1
        for candidate in range(index, max(index - _LOOKBEHIND, -1), -1):
            symbol = tables.at_start[candidate]
            if vaddr < symbol.value + max(symbol.size, 1):
                return symbol, vaddr - symbol.value
        return None

    def offset_to_vaddr(self, off: int) -> int | None:
        """The link-time address at which file offset ``off`` is loaded, if it is loaded."""
        for seg in self.segments:
            if seg.offset <= off < seg.offset + seg.filesz:
                return seg.vaddr + (off - seg.offset)
        return None

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        """The file offset backing link-time address ``vaddr``; None for .bss or unmapped."""
        for seg in self.segments:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return seg.offset + (vaddr - seg.vaddr)
        return None

    def segment_for_offset(self, off: int) -> Segment | None:
        """The PT_LOAD whose page-aligned file range holds ``off`` (how mmap placed it)."""
        for seg in self.segments:
            if seg.offset & ~0xFFF <= off < seg.offset + seg.filesz:
                return seg
        return None


def did_you_mean(image: ElfImage, name: str, *, functions_only: bool = True) -> str:
    """``"; did you mean 'malloc' or 'mallopt'?"`` for a name ``image`` lacks, or ``""``."""
    names = [repr(n) for n in image.closest_names(name, functions_only=functions_only)]
    if not names:
        return ""
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"; did you mean {listed}?"
