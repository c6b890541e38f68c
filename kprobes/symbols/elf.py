"""One ELF file as the resolver needs it: its loadable segments and its function symbols.

The file header, the program headers, the section headers and the symbol tables are all
fixed-size little-endian records, decoded here with ``struct`` (pyelftools, which reads
DWARF elsewhere, is not imported for this: it costs the command ~50 ms to import and builds
one parsed container per entry, ~60 ms for libc's ``.dynsym``, where unpacking the same
3000 ``Elf64_Sym`` records as tuples takes a few milliseconds). The symbol tables
themselves are symtab.py's.

Images are cached by file identity (real path, device, inode, modification time), so every
process that maps libc shares one ``ElfImage``, and a file rewritten in place is read again.
Opening reads only the headers and the raw bytes of the symbol sections, because a process
maps dozens of libraries and most of them are never asked about. A name or an address is
answered from those bytes, decoding only the entries that answer (``NameIndex``); what needs
every symbol (a glob, a listing, a "did you mean") decodes the tables once.
"""

from __future__ import annotations

import errno as _errno
import os
import stat
import struct
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO, Final

from kprobes.errors import TargetError
from kprobes.symbols.symtab import TABLE_NAMES, NameIndex, RawTable, Tables, build_tables, holder
from kprobes.symbols.symtab import Symbol as Symbol
from kprobes.symbols.symtab import SymbolKind as SymbolKind
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

# A "did you mean" compares the missing name with at most this many names of a similar
# length (difflib is about 2 us a name): an error path, but one that must stay quick on a
# file with a million symbols.
_HINT_CANDIDATES: Final = 50_000
_HINT_COUNT: Final = 3


@dataclass(frozen=True, slots=True)
class Segment:
    """One PT_LOAD program header: how a range of the file is laid out in memory."""

    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int  # PF_X = 1, PF_W = 2, PF_R = 4


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


_CacheKey = tuple[str, int, int, int, int]
_cache: dict[_CacheKey, ElfImage] = {}
# Files known not to be x86-64 ELF (locale archives, fonts, caches): a maps refresh skips
# them without reading them again.
_refused: dict[_CacheKey, str] = {}
_cache_lock = threading.Lock()


class ElfImage:
    """A parsed x86-64 ELF file; one instance per file identity, shared through a cache."""

    __slots__ = ("_index", "_lock", "_raw", "_tables", "is_dyn", "path", "segments", "tables")

    def __init__(
        self,
        path: str,
        *,
        is_dyn: bool,
        segments: tuple[Segment, ...],
        raw_tables: tuple[RawTable, ...],
    ) -> None:
        self.path = path
        self.is_dyn = is_dyn
        self.segments = segments
        self.tables: tuple[str, ...] = tuple(raw.name for raw in raw_tables)
        self._raw: tuple[RawTable, ...] | None = raw_tables
        self._tables: Tables | None = None
        self._index: NameIndex | None = None  # answers for one name or address until then
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
        raw_tables: list[RawTable] = []
        for name in TABLE_NAMES:
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
                RawTable(
                    name,
                    file.section_data(sections[index]),
                    file.section_data(sections[link]),
                    versions,
                )
            )
        return cls(path, is_dyn=e_type == _ET_DYN, segments=segments, raw_tables=tuple(raw_tables))

    def _symbols(self) -> Tables:
        """The full tables, decoded on first use (a glob, a listing, a "did you mean")."""
        tables = self._tables
        if tables is None:
            with self._lock:
                if self._tables is None:
                    raw = self._raw
                    assert raw is not None, "raw tables are dropped only after decoding"
                    self._tables = build_tables(raw)
                    self._raw = self._index = None
                tables = self._tables
        return tables

    def _answers(self) -> Tables | NameIndex:
        """The full tables if they are decoded, else the index that decodes only what is
        asked (symtab.py): a name or an address asked first does not decode the file."""
        tables = self._tables
        if tables is not None:
            return tables
        with self._lock:
            if self._tables is not None:
                return self._tables
            if self._index is None:
                assert self._raw is not None, "raw tables are dropped only after decoding"
                self._index = NameIndex(self._raw)
            return self._index

    def lookup(self, name: str) -> Symbol | None:
        """The best symbol called ``name``: a function, the default version, global, .symtab.

        ``name`` may carry a version suffix ("memcpy@@GLIBC_2.14"); it is ignored.
        """
        candidates = self.lookup_all(name)
        return candidates[0] if candidates else None

    def lookup_all(self, name: str) -> tuple[Symbol, ...]:
        """Every symbol called ``name`` at a distinct address, best first.

        More than one means the name is ambiguous (static functions of the same name in
        several source files, or several versions of one libc function).
        """
        answers = self._answers()
        want = name.partition("@")[0]
        if isinstance(answers, NameIndex):
            return answers.lookup_all(want)
        return answers.by_name.get(want, ())

    def closest_names(self, name: str, *, functions_only: bool = True) -> list[str]:
        """The names nearest ``name`` (at most three, nearest first), for a "did you mean".

        Only names within a third of its length (at least 3 characters) are compared, and
        at most ``_HINT_CANDIDATES`` of them, so a large ``.symtab`` still answers at once.
        """
        import difflib  # an error's hint alone needs it

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
        answers = self._answers()
        if isinstance(answers, NameIndex):
            return answers.function_at(vaddr)
        return holder(answers.starts, answers.at_start.__getitem__, vaddr)

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
