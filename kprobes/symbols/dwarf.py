"""A function's formal parameters from DWARF, as a jprobe needs them to call its handler.

A jprobe hands its handler the probed function's arguments, so it must know how many there
are, how wide each one is and which register file it travels in. The DWARF of the file says
all of that; this module reduces it to a tuple of ``Param`` values (name, C spelling, kind,
size, and for small structs the scalar leaves the SysV classifier needs). Where each argument
lives is decided elsewhere, by the pure ``kprobes.arch.x86_64.abi``.

Parsing DWARF with pyelftools is slow (hundreds of DIEs per millisecond), so nothing is parsed
that the question does not need: a function given by name is first turned into its entry
address with the ELF symbol table, the address into its compilation unit with
``.debug_aranges``, and only that unit's top-level DIEs are read. A full scan of every unit by
name is the fallback for static functions that have no symbol. Each unit's index and every
answer are kept per file identity (path, inode, mtime), like ``ElfImage``.

Going by the symbol's address rather than by DWARF name is also what keeps clones out: at -O2
gcc emits ``foo.constprop.0`` or ``foo.isra.0`` as concrete instances of ``foo``'s abstract
DIE, so they carry ``foo``'s name and parameter list while taking different arguments in
different registers. A DIE whose entry holds a symbol ``foo.<suffix>`` and no ``foo`` is such
a clone, and we answer None rather than a wrong signature.

A stripped file is looked up in its separate debug file the way gdb does: by build-id under
``/usr/lib/debug/.build-id``, then by ``.gnu_debuglink`` (with its CRC checked).

The types the parameters point to are walked by ``dwarf_types``.
"""

from __future__ import annotations

import errno as _errno
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Final

from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct import ConstructError
from elftools.dwarf.compileunit import CompileUnit
from elftools.dwarf.die import DIE
from elftools.dwarf.dwarfinfo import DWARFInfo
from elftools.dwarf.ranges import BaseAddressEntry, RangeEntry
from elftools.dwarf.typeunit import TypeUnit
from elftools.elf.elffile import ELFFile

from kprobes.errors import TargetError
from kprobes.symbols.dwarf_types import (
    DW_LANG_MIPS_ASSEMBLER,
    Field,
    Param,
    ParamKind,
    Types,
    children,
    inherited_name,
    inherited_type,
    int_attr,
    origins,
)
from kprobes.symbols.elf import ElfImage, SymbolKind
from kprobes.values import dataclass, field

# Where distributions install separate debug files (gdb's "debug-file-directory").
DEBUG_ROOTS: tuple[str, ...] = ("/usr/lib/debug",)

__all__ = [
    "DEBUG_ROOTS",
    "Field",
    "Param",
    "ParamKind",
    "Signature",
    "function_params",
    "get_signature",
]


@dataclass(frozen=True, slots=True)
class Signature:
    """What DWARF says about one out-of-line function."""

    name: str
    entry: int  # unrelocated address of the first instruction (DW_AT_low_pc)
    params: tuple[Param, ...]
    is_variadic: bool  # the prototype ends in "..."
    returns: Param | None  # None for void


def function_params(
    path: str, func: str | None = None, *, addr: int | None = None
) -> tuple[Param, ...] | None:
    """The formal parameters of ``func`` (or of the function entered at ``addr``) in the ELF
    file at ``path``, or None when there is no DWARF for that function.

    ``addr`` is an unrelocated ELF virtual address, as in the symbol table and DW_AT_low_pc.
    Whether the function is variadic is in ``get_signature(...).is_variadic``.
    """
    signature = get_signature(path, func, addr=addr)
    return None if signature is None else signature.params


def get_signature(
    path: str, func: str | None = None, *, addr: int | None = None
) -> Signature | None:
    """The DWARF signature of ``func`` or of the function entered at ``addr``; see
    function_params(). Raises TargetError when the file cannot be read or its DWARF is
    malformed.
    """
    if (func is None) == (addr is None):
        raise TypeError("give exactly one of func and addr")
    return _DwarfFile.open(path).signature(func, addr)


# ---------------------------------------------------------------------------------------------
# Finding the DWARF: the file itself, or its separate debug file


def _has_debug_info(elf: ELFFile) -> bool:
    return any(
        elf.get_section_by_name(name) is not None for name in (".debug_info", ".zdebug_info")
    )


def _build_id(elf: ELFFile) -> str | None:
    section = elf.get_section_by_name(".note.gnu.build-id")
    if section is None:
        return None
    data = section.data()
    if len(data) < 12:
        return None
    namesz, descsz, _type = struct.unpack_from("<III", data)
    start = 12 + (namesz + 3) // 4 * 4
    desc = data[start : start + descsz]
    return desc.hex() if desc else None


def _debuglink(elf: ELFFile) -> tuple[str, int] | None:
    section = elf.get_section_by_name(".gnu_debuglink")
    if section is None:
        return None
    data = section.data()
    end = data.find(b"\0")
    if end <= 0:
        return None
    crc_at = (end + 4) // 4 * 4
    if crc_at + 4 > len(data):
        return None
    (crc,) = struct.unpack_from("<I", data, crc_at)
    return os.fsdecode(data[:end]), crc


def _file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _separate_debug_file(path: str, elf: ELFFile) -> str | None:
    """gdb's search: /usr/lib/debug/.build-id/xx/yyyy.debug, then the debuglink next to the
    file, in its .debug/ directory, and under /usr/lib/debug/<dir>/."""
    build_id = _build_id(elf)
    if build_id is not None and len(build_id) > 2:
        for root in DEBUG_ROOTS:
            candidate = os.path.join(root, ".build-id", build_id[:2], build_id[2:] + ".debug")
            if os.path.isfile(candidate):
                return candidate
    link = _debuglink(elf)
    if link is None:
        return None
    name, crc = link
    directory = os.path.dirname(os.path.realpath(path))
    candidates = [os.path.join(directory, name), os.path.join(directory, ".debug", name)]
    candidates += [os.path.join(root + directory, name) for root in DEBUG_ROOTS]
    for candidate in candidates:
        if os.path.realpath(candidate) == os.path.realpath(path):
            continue
        try:
            if os.path.isfile(candidate) and _file_crc32(candidate) == crc:
                return candidate
        except OSError:
            continue
    return None


def _load_dwarf(path: str) -> tuple[str, DWARFInfo] | None:
    """Step 1 of every query on a new file: find the DWARF and read its sections into memory.

    pyelftools copies each debug section into a BytesIO, so the file is closed on return.
    """
    with open(path, "rb") as stream:
        elf = ELFFile(stream)
        if not _has_debug_info(elf):
            debug_path = _separate_debug_file(path, elf)
            if debug_path is None:
                return None
            with open(debug_path, "rb") as debug_stream:
                debug_elf = ELFFile(debug_stream, ELFFile.make_relative_loader(debug_path))
                if not _has_debug_info(debug_elf):
                    return None
                return debug_path, _dwarf_info(debug_elf)
        elf.stream_loader = ELFFile.make_relative_loader(path)
        return path, _dwarf_info(elf)


def _dwarf_info(elf: ELFFile) -> DWARFInfo:
    try:
        return elf.get_dwarf_info()
    except OSError:  # a dwz supplementary file (.gnu_debugaltlink) that is not installed
        return elf.get_dwarf_info(follow_links=False)


# ---------------------------------------------------------------------------------------------
# Functions: where they are, and their parameter lists


@dataclass(slots=True)
class _UnitIndex:
    """The out-of-line functions of one compilation unit."""

    by_entry: dict[int, DIE] = field(default_factory=dict)
    by_name: dict[str, list[DIE]] = field(default_factory=dict)


def _high_pc(die: DIE, low: int) -> int | None:
    attr = die.attributes.get("DW_AT_high_pc")
    if attr is None or not isinstance(attr.value, int):
        return None
    return attr.value if attr.form == "DW_FORM_addr" else low + attr.value


# What pyelftools raises on bad input: its own errors, construct's, and the lookups of
# abbreviation codes, forms and offsets that a corrupt section sends out of bounds.
_PARSE_ERRORS: Final = (
    ELFError,
    DWARFError,
    ConstructError,
    struct.error,
    KeyError,
    IndexError,
    ValueError,
    NotImplementedError,
    AssertionError,
    RecursionError,
)

_cache: dict[tuple[str, int, int, int, int], _DwarfFile] = {}
_cache_lock = threading.Lock()


def _is_clone(images: tuple[ElfImage, ...], name: str, entry: int) -> bool:
    """Is the code at ``entry`` a gcc clone of ``name`` (``name.isra.0``, ``.part.0``, ...)?"""
    if any(s.value == entry for image in images for s in image.lookup_all(name)):
        return False
    for image in images:
        found = image.function_at(entry)
        if found is not None and found[1] == 0 and found[0].name.startswith(name + "."):
            return True
    return False


def _is_assembly(unit: CompileUnit | TypeUnit) -> bool:
    """GNU as (2.35+) describes each function of a .S file as a subprogram with no parameters
    and an unspecified return type: that says nothing of its arguments."""
    return int_attr(unit.get_top_DIE(), "DW_AT_language") == DW_LANG_MIPS_ASSEMBLER


class _DwarfFile:
    """The DWARF of one file identity, read on the first query and indexed unit by unit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._is_loaded = False
        self._debug_path = path
        self._dwarf: DWARFInfo | None = None
        self._units: dict[int, _UnitIndex] = {}
        self._answers: dict[tuple[str | None, int | None], Signature | None] = {}
        self._types = Types()

    @classmethod
    def open(cls, path: str) -> _DwarfFile:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise TargetError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        with _cache_lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = cls(path)
        return found

    def signature(self, func: str | None, addr: int | None) -> Signature | None:
        with self._lock:
            key = (func, addr)
            if key in self._answers:
                return self._answers[key]
            ElfImage.open(self.path)  # TargetError when the file is not x86-64 ELF
            try:
                answer = self._signature(func, addr)
            except _PARSE_ERRORS as exc:
                detail = f"{type(exc).__name__}: {exc}"
                raise TargetError(
                    f"malformed DWARF in {self._debug_path} ({detail[:120]})",
                    errno=_errno.ENOEXEC,
                ) from exc
            except OSError as exc:
                raise TargetError(
                    f"cannot read {self._debug_path}: {exc.strerror}", errno=exc.errno
                ) from exc
            self._answers[key] = answer
            return answer

    def _signature(self, func: str | None, addr: int | None) -> Signature | None:
        dwarf = self._load()
        if dwarf is None:
            return None
        # A separate debug file keeps the .symtab that strip removed from the file itself.
        images = tuple(ElfImage.open(p) for p in dict.fromkeys((self.path, self._debug_path)))
        if addr is not None:
            return self._signature_at(dwarf, images, addr)
        assert func is not None
        # Step 1: the symbol table says where the function named ``func`` starts. The value
        # of an IFUNC symbol is its resolver, whose DWARF says nothing of the implementation.
        symbols = [
            s for image in images for s in image.lookup_all(func) if s.kind.is_function and s.value
        ]
        for start in dict.fromkeys(s.value for s in symbols if s.kind is SymbolKind.FUNC):
            found = self._signature_at(dwarf, images, start)
            if found is not None:
                return found
        if symbols:
            return None  # code without DWARF (assembly), a clone, or an IFUNC
        # Step 2: no symbol (a static function in a stripped file): every unit, by name.
        for die in self._iter_named(dwarf, func):
            entry = self._entry(die)
            if entry is None or _is_clone(images, func, entry) or _is_assembly(die.cu):
                continue
            return self._describe(die, func, entry)
        return None

    def _load(self) -> DWARFInfo | None:
        if not self._is_loaded:
            loaded = _load_dwarf(self.path)
            if loaded is not None:
                self._debug_path, self._dwarf = loaded
            self._is_loaded = True
        return self._dwarf

    def _signature_at(
        self, dwarf: DWARFInfo, images: tuple[ElfImage, ...], addr: int
    ) -> Signature | None:
        for unit in self._units_for(dwarf, addr):
            die = self._index(unit).by_entry.get(addr)
            if die is None:
                continue
            name = inherited_name(die) or ""
            if _is_clone(images, name, addr) or _is_assembly(unit):
                return None
            return self._describe(die, name, addr)
        return None

    def _units_for(self, dwarf: DWARFInfo, addr: int) -> Iterator[CompileUnit]:
        """Step 1 for an address: its unit from .debug_aranges, else every unit covering it."""
        tried: set[int] = set()
        aranges = dwarf.get_aranges()
        if aranges is not None and aranges.entries:
            offset = aranges.cu_offset_at_addr(addr)
            if offset is not None:
                tried.add(offset)
                yield dwarf.get_CU_at(offset)
        for unit in dwarf.iter_CUs():
            if unit.cu_offset not in tried and self._may_cover(dwarf, unit, addr):
                yield unit

    @staticmethod
    def _may_cover(dwarf: DWARFInfo, unit: CompileUnit, addr: int) -> bool:
        top = unit.get_top_DIE()
        low = int_attr(top, "DW_AT_low_pc")
        if "DW_AT_ranges" in top.attributes:
            return any(lo <= addr < hi for lo, hi in _ranges(dwarf, top, low or 0))
        if low is None:
            return True  # no coverage information: look inside
        high = _high_pc(top, low)
        return high is None or low <= addr < high

    def _iter_named(self, dwarf: DWARFInfo, name: str) -> Iterator[DIE]:
        for unit in dwarf.iter_CUs():
            yield from self._index(unit).by_name.get(name, ())

    def _index(self, unit: CompileUnit) -> _UnitIndex:
        index = self._units.get(unit.cu_offset)
        if index is None:
            index = _UnitIndex()
            for die in self._iter_functions(unit.get_top_DIE()):
                for entry in self._entries(die):
                    index.by_entry.setdefault(entry, die)
                name = inherited_name(die)
                if name is not None:
                    index.by_name.setdefault(name, []).append(die)
            self._units[unit.cu_offset] = index
        return index

    def _iter_functions(self, parent: DIE) -> Iterator[DIE]:
        """Subprogram DIEs that own code, at the top of a unit or inside C++ namespaces."""
        for die in parent.iter_children():
            if die.tag == "DW_TAG_subprogram":
                if "DW_AT_low_pc" in die.attributes or "DW_AT_ranges" in die.attributes:
                    yield die
            elif die.tag == "DW_TAG_namespace":
                yield from self._iter_functions(die)

    def _entries(self, die: DIE) -> list[int]:
        """Addresses at which this function may be entered: low_pc, entry_pc, range starts."""
        found = []
        low = int_attr(die, "DW_AT_low_pc")
        if low is not None:
            found.append(low)
        entry = die.attributes.get("DW_AT_entry_pc")
        if entry is not None and isinstance(entry.value, int):
            is_address = entry.form == "DW_FORM_addr" or entry.form.startswith("DW_FORM_addrx")
            found.append(entry.value if is_address or low is None else low + entry.value)
        if "DW_AT_ranges" in die.attributes:
            assert self._dwarf is not None
            base = int_attr(die.cu.get_top_DIE(), "DW_AT_low_pc") or 0
            found.extend(lo for lo, _hi in _ranges(self._dwarf, die, base))
        return found

    def _entry(self, die: DIE) -> int | None:
        entries = self._entries(die)
        return entries[0] if entries else None

    def _describe(self, die: DIE, name: str, entry: int) -> Signature:
        """Step 3: the parameter list, taken from the DIE or from the instance it completes."""
        chain = list(origins(die))
        lists = [children(origin, "DW_TAG_formal_parameter") for origin in chain]
        # A concrete instance may omit parameters its abstract origin lists; a definition's
        # list has names its in-class declaration lacks. The first longest list wins.
        longest = max(len(params) for params in lists)
        formal = next(params for params in lists if len(params) == longest)
        is_variadic = any(children(origin, "DW_TAG_unspecified_parameters") for origin in chain)
        params = tuple(
            self._types.param(inherited_name(p) or "", inherited_type(p)) for p in formal
        )
        return_type = inherited_type(die)
        returns = None if return_type is None else self._types.param("", return_type)
        return Signature(name, entry, params, is_variadic, returns)


def _ranges(dwarf: DWARFInfo, die: DIE, base: int) -> list[tuple[int, int]]:
    """DW_AT_ranges as absolute [low, high) pairs (DWARF 4 .debug_ranges or 5 .debug_rnglists)."""
    attr = die.attributes["DW_AT_ranges"]
    lists = dwarf.range_lists()
    if lists is None:
        return []
    found = []
    # pyelftools has already turned a DW_FORM_rnglistx index into a section offset.
    unit = die.cu
    assert isinstance(unit, CompileUnit), "functions live in compilation units"
    for entry in lists.get_range_list_at_offset(attr.value, cu=unit):
        if isinstance(entry, BaseAddressEntry):
            base = entry.base_address
        elif isinstance(entry, RangeEntry):
            if entry.is_absolute:
                found.append((entry.begin_offset, entry.end_offset))
            else:
                found.append((base + entry.begin_offset, base + entry.end_offset))
    return found
