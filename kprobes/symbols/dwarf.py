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
"""

from __future__ import annotations

import errno as _errno
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
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
from kprobes.symbols.elf import ElfImage, SymbolKind

# Where distributions install separate debug files (gdb's "debug-file-directory").
DEBUG_ROOTS: tuple[str, ...] = ("/usr/lib/debug",)


class ParamKind(Enum):
    """How a value is read: which register file, and how its bits are interpreted."""

    SIGNED = "signed"
    UNSIGNED = "unsigned"  # also enums without negative enumerators
    BOOL = "bool"
    FLOAT = "float"
    DOUBLE = "double"
    LONG_DOUBLE = "long double"  # x87 80-bit in 16 bytes: always passed in memory
    POINTER = "pointer"
    CHAR_POINTER = "char pointer"  # read as a NUL-terminated string
    STRUCT = "struct"  # struct, union or class by value; also _Complex (two scalar leaves)
    UNKNOWN = "unknown"  # vectors, _Float128, decimal floats, incomplete types

    @property
    def is_sse(self) -> bool:
        """True for the kinds the SysV ABI passes in xmm registers."""
        return self is ParamKind.FLOAT or self is ParamKind.DOUBLE


@dataclass(frozen=True, slots=True)
class Field:
    """One scalar leaf of a by-value struct or union, for SysV eightbyte classification.

    Nested structs and arrays are flattened into their leaves; a bit-field contributes one
    1-byte UNSIGNED/SIGNED leaf per byte it touches. ``offset % size != 0`` means the leaf is
    unaligned (a packed struct), which sends the whole struct to memory.
    """

    offset: int
    size: int
    kind: ParamKind


@dataclass(frozen=True, slots=True)
class Param:
    """One formal parameter (or a return value, with ``name == ""``)."""

    name: str  # "" when the DWARF has none (an unnamed parameter)
    type_name: str  # C spelling as gdb prints it: "const char *", "unsigned long", "struct p"
    kind: ParamKind
    size: int  # bytes
    # Alignment of the value's slot in the stack argument area: 8, or 16 for long double,
    # __int128 and aggregates that contain one (or are declared _Alignas(16)).
    stack_align: int = 8
    # For kind STRUCT of at most 16 bytes: the scalar leaves, by offset. Empty otherwise.
    fields: tuple[Field, ...] = ()


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
# Attributes

_ATE_BOOLEAN: Final = 0x02
_ATE_COMPLEX_FLOAT: Final = 0x03
_ATE_FLOAT: Final = 0x04
_ATE_SIGNED: Final = 0x05
_ATE_SIGNED_CHAR: Final = 0x06
_ATE_UNSIGNED: Final = 0x07
_ATE_UNSIGNED_CHAR: Final = 0x08
_ATE_UTF: Final = 0x10

_DW_OP_PLUS_UCONST: Final = 0x23
_DW_CC_PASS_BY_REFERENCE: Final = 0x04
_DW_DEFAULTED_IN_CLASS: Final = 0x01
_DW_LANG_MIPS_ASSEMBLER: Final = 0x8001  # what GNU as writes for every assembler source

_QUALIFIERS: Final = {
    "DW_TAG_const_type": "const",
    "DW_TAG_volatile_type": "volatile",
    "DW_TAG_restrict_type": "restrict",
    "DW_TAG_atomic_type": "_Atomic",
}
_QUALIFIER_ORDER: Final = ("const", "volatile", "restrict", "_Atomic")
# Modifiers that change nothing about how a value is passed.
_TRANSPARENT: Final = frozenset({*_QUALIFIERS, "DW_TAG_typedef", "DW_TAG_immutable_type"})
_POINTERS: Final = {
    "DW_TAG_pointer_type": "*",
    "DW_TAG_reference_type": "&",
    "DW_TAG_rvalue_reference_type": "&&",
}
_AGGREGATES: Final = {
    "DW_TAG_structure_type": "struct",
    "DW_TAG_union_type": "union",
    "DW_TAG_class_type": "class",
}
# Typedefs of char that name byte buffers, not strings: a uint8_t * is not read as text.
_BYTE_TYPEDEFS: Final = frozenset(
    {"int8_t", "uint8_t", "__int8_t", "__uint8_t", "u8", "s8", "__u8", "__s8", "u_int8_t"}
)
# DWARF's spelling of the C integer types → the one gdb (and a C programmer) prints.
_BASE_NAMES: Final = {
    "short int": "short",
    "short unsigned int": "unsigned short",
    "long int": "long",
    "long unsigned int": "unsigned long",
    "long long int": "long long",
    "long long unsigned int": "unsigned long long",
    "__int128 unsigned": "unsigned __int128",
}
_MAX_DEPTH: Final = 64  # typedef/qualifier/nesting chains longer than this are malformed
_MAX_LEAVES: Final = 16  # a struct of at most 16 bytes has at most 16 scalar leaves


def _name(die: DIE) -> str | None:
    attr = die.attributes.get("DW_AT_name")
    if attr is None or not isinstance(attr.value, bytes):
        return None
    return attr.value.decode("utf-8", "replace")


def _int_attr(die: DIE, name: str) -> int | None:
    attr = die.attributes.get(name)
    if attr is None or not isinstance(attr.value, int) or isinstance(attr.value, bool):
        return None
    return attr.value


def _ref(die: DIE, name: str) -> DIE | None:
    if name not in die.attributes:
        return None
    return die.get_DIE_from_attribute(name)


def _type_of(die: DIE) -> DIE | None:
    return _ref(die, "DW_AT_type")


def _origins(die: DIE) -> Iterator[DIE]:
    """The DIE, then the DIEs it completes: abstract instances and declarations."""
    current: DIE | None = die
    for _ in range(_MAX_DEPTH):
        if current is None:
            return
        yield current
        nxt = _ref(current, "DW_AT_abstract_origin")
        current = nxt if nxt is not None else _ref(current, "DW_AT_specification")


def _inherited_name(die: DIE) -> str | None:
    for origin in _origins(die):
        name = _name(origin)
        if name is not None:
            return name
    return None


def _inherited_type(die: DIE) -> DIE | None:
    for origin in _origins(die):
        if "DW_AT_type" in origin.attributes:
            return _type_of(origin)
    return None


def _uleb128(data: list[int] | bytes, start: int) -> int:
    value = shift = 0
    for byte in data[start:]:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return value


def _member_offset(member: DIE) -> int:
    """DW_AT_data_member_location as a constant or, before DWARF 4, DW_OP_plus_uconst N."""
    attr = member.attributes.get("DW_AT_data_member_location")
    if attr is None:
        return 0  # union members
    value = attr.value
    if isinstance(value, int):
        return value
    if isinstance(value, list | bytes) and value and value[0] == _DW_OP_PLUS_UCONST:
        return _uleb128(value, 1)
    return 0


def _children(die: DIE, tag: str) -> list[DIE]:
    return [child for child in die.iter_children() if child.tag == tag]


# ---------------------------------------------------------------------------------------------
# Types: how a value is passed (kind, size, alignment, leaves) and how it is spelled


@dataclass(frozen=True, slots=True)
class _Shape:
    kind: ParamKind
    size: int
    align: int  # natural alignment in bytes
    fields: tuple[Field, ...] = ()  # leaves, only for aggregates of at most 16 bytes


_UNKNOWN: Final = _Shape(ParamKind.UNKNOWN, 0, 1)


def _strip(die: DIE | None) -> DIE | None:
    """Follow typedefs and qualifiers to the type that decides how a value is passed."""
    for _ in range(_MAX_DEPTH):
        if die is None or die.tag not in _TRANSPARENT:
            return die
        die = _type_of(die)
    return None


def _is_char(pointee: DIE | None) -> bool:
    """Is this (behind qualifiers and typedefs) plain, signed or unsigned char?"""
    for _ in range(_MAX_DEPTH):
        if pointee is None:
            return False
        if pointee.tag == "DW_TAG_typedef" and _name(pointee) in _BYTE_TYPEDEFS:
            return False
        if pointee.tag in _TRANSPARENT:
            pointee = _type_of(pointee)
            continue
        if pointee.tag != "DW_TAG_base_type" or _int_attr(pointee, "DW_AT_byte_size") != 1:
            return False
        encoding = _int_attr(pointee, "DW_AT_encoding")
        return encoding in (_ATE_SIGNED_CHAR, _ATE_UNSIGNED_CHAR, _ATE_UTF)
    return False


def _base_shape(die: DIE) -> _Shape:
    size = _int_attr(die, "DW_AT_byte_size") or 0
    encoding = _int_attr(die, "DW_AT_encoding")
    kind = ParamKind.UNKNOWN
    if encoding in (_ATE_SIGNED, _ATE_SIGNED_CHAR):
        kind = ParamKind.SIGNED
    elif encoding in (_ATE_UNSIGNED, _ATE_UNSIGNED_CHAR, _ATE_UTF):
        kind = ParamKind.UNSIGNED
    elif encoding == _ATE_BOOLEAN:
        kind = ParamKind.BOOL
    elif encoding == _ATE_FLOAT:
        kind = _float_kind(size, _name(die) or "")
    elif encoding == _ATE_COMPLEX_FLOAT and size in (8, 16, 32):
        half = size // 2
        part = _float_kind(half, "long double" if half == 16 else "")
        return _Shape(ParamKind.STRUCT, size, half, (Field(0, half, part), Field(half, half, part)))
    return _Shape(kind, size, max(size, 1))


def _float_kind(size: int, name: str) -> ParamKind:
    if size == 4:
        return ParamKind.FLOAT
    if size == 8:
        return ParamKind.DOUBLE
    if size in (10, 12, 16) and "long double" in name:
        return ParamKind.LONG_DOUBLE
    return ParamKind.UNKNOWN  # _Float128, _Float16: not modelled


def _subrange_count(subrange: DIE) -> int | None:
    count = _int_attr(subrange, "DW_AT_count")
    if count is None:
        upper = _int_attr(subrange, "DW_AT_upper_bound")
        if upper is None:
            return None  # flexible array member, or a VLA bound
        count = upper - (_int_attr(subrange, "DW_AT_lower_bound") or 0) + 1
    return max(count, 0)


def _array_count(die: DIE) -> int:
    """Elements in all dimensions; 0 when a bound is unknown."""
    total = 1
    for subrange in _children(die, "DW_TAG_subrange_type"):
        total *= _subrange_count(subrange) or 0
    return total


class _Types:
    """Shapes and spellings of the types of one DWARF, memoized by DIE offset."""

    def __init__(self) -> None:
        self._shapes: dict[int, _Shape] = {}
        self._by_reference: dict[int, bool] = {}

    def shape(self, die: DIE | None, depth: int = 0) -> _Shape:
        die = _strip(die)
        if die is None or depth > _MAX_DEPTH:
            return _UNKNOWN
        cached = self._shapes.get(die.offset)
        if cached is None:
            cached = self._shape(die, depth)
            self._shapes[die.offset] = cached
        return cached

    def _shape(self, die: DIE, depth: int) -> _Shape:
        tag = die.tag
        if tag == "DW_TAG_base_type":
            return _base_shape(die)
        if tag in _POINTERS or tag == "DW_TAG_unspecified_type":
            size = _int_attr(die, "DW_AT_byte_size") or die.cu.header.address_size
            return _Shape(ParamKind.POINTER, size, size)
        if tag == "DW_TAG_enumeration_type":
            return self._enum_shape(die, depth)
        if tag in _AGGREGATES:
            return self._aggregate_shape(die, depth)
        if tag == "DW_TAG_array_type":
            return self._array_shape(die, depth)
        size = _int_attr(die, "DW_AT_byte_size") or 0
        return _Shape(ParamKind.UNKNOWN, size, max(size, 1))

    def _enum_shape(self, die: DIE, depth: int) -> _Shape:
        size = _int_attr(die, "DW_AT_byte_size") or 4
        underlying = self.shape(_type_of(die), depth + 1)
        if underlying.kind in (ParamKind.SIGNED, ParamKind.UNSIGNED):
            kind = underlying.kind
        else:
            values = _children(die, "DW_TAG_enumerator")
            is_negative = any((_int_attr(value, "DW_AT_const_value") or 0) < 0 for value in values)
            kind = ParamKind.SIGNED if is_negative else ParamKind.UNSIGNED
        return _Shape(kind, size, size)

    def _array_shape(self, die: DIE, depth: int) -> _Shape:
        if "DW_AT_GNU_vector" in die.attributes:
            size = _int_attr(die, "DW_AT_byte_size") or 0
            return _Shape(ParamKind.UNKNOWN, size, size)
        element = self.shape(_type_of(die), depth + 1)
        count = _array_count(die)  # 0 for a flexible array member: no leaves at all
        byte_size = _int_attr(die, "DW_AT_byte_size")
        size = element.size * count if byte_size is None else byte_size
        fields: tuple[Field, ...] = ()
        if size <= _MAX_LEAVES and element.size:
            leaves = element.fields or (Field(0, element.size, element.kind),)
            fields = tuple(
                Field(i * element.size + leaf.offset, leaf.size, leaf.kind)
                for i in range(count)
                for leaf in leaves
            )
        return _Shape(ParamKind.STRUCT, size, element.align, fields)

    def _aggregate_shape(self, die: DIE, depth: int) -> _Shape:
        size = _int_attr(die, "DW_AT_byte_size")
        if size is None or "DW_AT_declaration" in die.attributes:
            return _Shape(ParamKind.UNKNOWN, size or 0, 1)
        align = 1
        fields: list[Field] = []
        is_packed = False
        for member in die.iter_children():
            if member.tag not in ("DW_TAG_member", "DW_TAG_inheritance"):
                continue
            if "DW_AT_external" in member.attributes or "DW_AT_declaration" in member.attributes:
                continue  # C++ static data member: not stored in the object
            shape = self.shape(_type_of(member), depth + 1)
            bit_size = _int_attr(member, "DW_AT_bit_size")
            if bit_size is not None:
                fields.extend(_bitfield_leaves(member, shape, bit_size))
                continue
            offset = _member_offset(member)
            align = max(align, shape.align)
            is_packed |= offset % shape.align != 0
            if size <= _MAX_LEAVES and shape.size:  # zero-sized: flexible array, empty struct
                inner = shape.fields or (Field(0, shape.size, shape.kind),)
                fields.extend(Field(offset + f.offset, f.size, f.kind) for f in inner)
        explicit = _int_attr(die, "DW_AT_alignment")
        if explicit is not None:
            align = explicit
        elif is_packed or size % align:
            align = 1
        if size > _MAX_LEAVES:
            fields = []
        # Bit-fields sharing a byte give equal leaves; one of each is enough.
        leaves = sorted(dict.fromkeys(fields), key=lambda f: f.offset)
        return _Shape(ParamKind.STRUCT, size, align, tuple(leaves))

    def spell(self, die: DIE | None, declarator: str = "", depth: int = 0) -> str:
        """The C spelling of a type with ``declarator`` in place of a name (gdb's style)."""
        qualifiers: set[str] = set()
        while die is not None and die.tag in _QUALIFIERS and depth < _MAX_DEPTH:
            qualifiers.add(_QUALIFIERS[str(die.tag)])
            die = _type_of(die)
            depth += 1
        words = [q for q in _QUALIFIER_ORDER if q in qualifiers]
        if depth >= _MAX_DEPTH:
            return "?"
        if die is None:
            return _join(" ".join([*words, "void"]), declarator)
        tag = die.tag
        if tag in _POINTERS:
            inner = _POINTERS[str(tag)]
            if words:
                inner += " " + " ".join(words)
            if declarator:
                inner += (" " if words else "") + declarator
            target = _type_of(die)
            stripped = _strip_qualifiers(target)
            if stripped is not None and stripped.tag in (
                "DW_TAG_array_type",
                "DW_TAG_subroutine_type",
            ):
                inner = f"({inner})"
            return self.spell(target, inner, depth + 1)
        if tag == "DW_TAG_array_type":
            counts = [_subrange_count(sub) for sub in _children(die, "DW_TAG_subrange_type")]
            dims = "".join("[]" if count is None else f"[{count}]" for count in counts)
            return self.spell(_type_of(die), declarator + (dims or "[]"), depth + 1)
        if tag == "DW_TAG_subroutine_type":
            params = self._spell_params(die, depth)
            return self.spell(_type_of(die), f"{declarator}({params})", depth + 1)
        return _join(" ".join([*words, _type_name(die)]), declarator)

    def _spell_params(self, die: DIE, depth: int) -> str:
        spelled = []
        for child in die.iter_children():
            if child.tag == "DW_TAG_formal_parameter":
                spelled.append(self.spell(_type_of(child), "", depth + 1))
            elif child.tag == "DW_TAG_unspecified_parameters":
                spelled.append("...")
        if not spelled and die.attributes.get("DW_AT_prototyped") is not None:
            return "void"
        return ", ".join(spelled)

    def is_by_reference(self, die: DIE, depth: int = 0) -> bool:
        """Is this C++ class passed by invisible reference (a pointer to a temporary copy)?

        The psABI does so for classes that are non-trivial for the purpose of calls: a
        user-provided destructor or copy/move constructor, of the class, a base or a member.
        clang says so in DW_AT_calling_convention; gcc 12 does not, so its member functions
        are read.
        """
        cached = self._by_reference.get(die.offset)
        if cached is not None:
            return cached
        self._by_reference[die.offset] = False  # a cycle through members is not by reference
        convention = _int_attr(die, "DW_AT_calling_convention")
        if convention is not None:
            found = convention == _DW_CC_PASS_BY_REFERENCE
        else:
            found = any(self._makes_nontrivial(die, child, depth) for child in die.iter_children())
        self._by_reference[die.offset] = found
        return found

    def _makes_nontrivial(self, owner: DIE, child: DIE, depth: int) -> bool:
        if child.tag in ("DW_TAG_inheritance", "DW_TAG_member"):
            if "DW_AT_external" in child.attributes or depth >= _MAX_DEPTH:
                return False  # a static member is not part of the object
            member = _strip(_type_of(child))
            return (
                member is not None
                and member.tag in _AGGREGATES
                and self.is_by_reference(member, depth + 1)
            )
        if child.tag != "DW_TAG_subprogram" or "DW_AT_artificial" in child.attributes:
            return False
        if _int_attr(child, "DW_AT_defaulted") == _DW_DEFAULTED_IN_CLASS:
            return False
        name = _name(child) or ""
        if name.startswith("~"):
            return True
        if name != _name(owner):
            return False
        # A constructor whose only parameter (besides this) is a reference to the class.
        params = [
            p
            for p in _children(child, "DW_TAG_formal_parameter")
            if "DW_AT_artificial" not in p.attributes
        ]
        if len(params) != 1:
            return False
        ref = _strip(_type_of(params[0]))
        if ref is None or ref.tag not in ("DW_TAG_reference_type", "DW_TAG_rvalue_reference_type"):
            return False
        target = _strip(_type_of(ref))
        return target is not None and (
            target.offset == owner.offset or _name(target) == _name(owner)
        )

    def param(self, name: str, type_die: DIE | None) -> Param:
        """A parameter of the given type; arrays and functions decay to pointers, as in C."""
        type_name = self.spell(type_die)
        stripped = _strip(type_die)
        if stripped is not None and stripped.tag in ("DW_TAG_array_type", "DW_TAG_subroutine_type"):
            size = stripped.cu.header.address_size
            return Param(name, type_name, ParamKind.POINTER, size)
        if stripped is not None and stripped.tag in _AGGREGATES and self.is_by_reference(stripped):
            size = stripped.cu.header.address_size
            return Param(name, type_name, ParamKind.POINTER, size)
        shape = self.shape(type_die)
        kind = shape.kind
        if (
            kind is ParamKind.POINTER
            and stripped is not None
            and stripped.tag in _POINTERS
            and _is_char(_type_of(stripped))
        ):
            kind = ParamKind.CHAR_POINTER
        fields = shape.fields if kind is ParamKind.STRUCT else ()
        stack_align = 16 if shape.align >= 16 else 8
        return Param(name, type_name, kind, shape.size, stack_align, fields)


def _bitfield_leaves(member: DIE, shape: _Shape, bit_size: int) -> Iterator[Field]:
    data_bit = _int_attr(member, "DW_AT_data_bit_offset")
    if data_bit is None:
        base = _member_offset(member) * 8
        legacy = _int_attr(member, "DW_AT_bit_offset")  # DWARF 2/3: counted from the MSB
        storage = _int_attr(member, "DW_AT_byte_size") or shape.size
        data_bit = base + (storage * 8 - legacy - bit_size if legacy is not None else 0)
    kind = ParamKind.SIGNED if shape.kind is ParamKind.SIGNED else ParamKind.UNSIGNED
    first, last = data_bit // 8, (data_bit + max(bit_size, 1) - 1) // 8
    for byte in range(first, last + 1):
        yield Field(byte, 1, kind)


def _strip_qualifiers(die: DIE | None) -> DIE | None:
    for _ in range(_MAX_DEPTH):
        if die is None or die.tag not in _QUALIFIERS:
            return die
        die = _type_of(die)
    return None


def _type_name(die: DIE) -> str:
    name = _name(die)
    tag = die.tag
    if tag in _AGGREGATES:
        return f"{_AGGREGATES[str(tag)]} {name or '{...}'}"
    if tag == "DW_TAG_enumeration_type":
        return f"enum {name or '{...}'}"
    if name is None:
        return "?"
    return _BASE_NAMES.get(name, name) if tag == "DW_TAG_base_type" else name


def _join(specifier: str, declarator: str) -> str:
    return f"{specifier} {declarator}" if declarator else specifier


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
    return _int_attr(unit.get_top_DIE(), "DW_AT_language") == _DW_LANG_MIPS_ASSEMBLER


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
        self._types = _Types()

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
            name = _inherited_name(die) or ""
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
        low = _int_attr(top, "DW_AT_low_pc")
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
                name = _inherited_name(die)
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
        low = _int_attr(die, "DW_AT_low_pc")
        if low is not None:
            found.append(low)
        entry = die.attributes.get("DW_AT_entry_pc")
        if entry is not None and isinstance(entry.value, int):
            is_address = entry.form == "DW_FORM_addr" or entry.form.startswith("DW_FORM_addrx")
            found.append(entry.value if is_address or low is None else low + entry.value)
        if "DW_AT_ranges" in die.attributes:
            assert self._dwarf is not None
            base = _int_attr(die.cu.get_top_DIE(), "DW_AT_low_pc") or 0
            found.extend(lo for lo, _hi in _ranges(self._dwarf, die, base))
        return found

    def _entry(self, die: DIE) -> int | None:
        entries = self._entries(die)
        return entries[0] if entries else None

    def _describe(self, die: DIE, name: str, entry: int) -> Signature:
        """Step 3: the parameter list, taken from the DIE or from the instance it completes."""
        chain = list(_origins(die))
        lists = [_children(origin, "DW_TAG_formal_parameter") for origin in chain]
        # A concrete instance may omit parameters its abstract origin lists; a definition's
        # list has names its in-class declaration lacks. The first longest list wins.
        longest = max(len(params) for params in lists)
        formal = next(params for params in lists if len(params) == longest)
        is_variadic = any(_children(origin, "DW_TAG_unspecified_parameters") for origin in chain)
        params = tuple(
            self._types.param(_inherited_name(p) or "", _inherited_type(p)) for p in formal
        )
        return_type = _inherited_type(die)
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
