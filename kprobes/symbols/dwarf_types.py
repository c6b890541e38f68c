"""C types from DWARF, reduced to what a call needs: the kind, size and stack alignment of a
value, and for a small struct its scalar leaves (the SysV classifier's input).

The other half of ``dwarf.py``: that module finds a function's DIE; this one walks the type
DIEs its parameters point to (typedefs, qualifiers, pointers, arrays, structs, bit-fields,
``_Complex``) and spells each type as gdb prints it. Kept apart because the walk is long and
self-contained, and pure: DIEs in, frozen values out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import Final

from elftools.dwarf.die import DIE

from kprobes.symbols.leb128 import uleb128
from kprobes.values import dataclass


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
DW_LANG_MIPS_ASSEMBLER: Final = 0x8001  # what GNU as writes for every assembler source

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


def int_attr(die: DIE, name: str) -> int | None:
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


def origins(die: DIE) -> Iterator[DIE]:
    """The DIE, then the DIEs it completes: abstract instances and declarations."""
    current: DIE | None = die
    for _ in range(_MAX_DEPTH):
        if current is None:
            return
        yield current
        nxt = _ref(current, "DW_AT_abstract_origin")
        current = nxt if nxt is not None else _ref(current, "DW_AT_specification")


def inherited_name(die: DIE) -> str | None:
    for origin in origins(die):
        name = _name(origin)
        if name is not None:
            return name
    return None


def inherited_type(die: DIE) -> DIE | None:
    for origin in origins(die):
        if "DW_AT_type" in origin.attributes:
            return _type_of(origin)
    return None


def _member_offset(member: DIE) -> int:
    """DW_AT_data_member_location as a constant or, before DWARF 4, DW_OP_plus_uconst N."""
    attr = member.attributes.get("DW_AT_data_member_location")
    if attr is None:
        return 0  # union members
    value = attr.value
    if isinstance(value, int):
        return value
    if isinstance(value, list | bytes) and value and value[0] == _DW_OP_PLUS_UCONST:
        with contextlib.suppress(IndexError):  # cut short: as if absent
            return uleb128(value, 1)[0]
    return 0


def children(die: DIE, tag: str) -> list[DIE]:
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
        if pointee.tag != "DW_TAG_base_type" or int_attr(pointee, "DW_AT_byte_size") != 1:
            return False
        encoding = int_attr(pointee, "DW_AT_encoding")
        return encoding in (_ATE_SIGNED_CHAR, _ATE_UNSIGNED_CHAR, _ATE_UTF)
    return False


def _base_shape(die: DIE) -> _Shape:
    size = int_attr(die, "DW_AT_byte_size") or 0
    encoding = int_attr(die, "DW_AT_encoding")
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
    count = int_attr(subrange, "DW_AT_count")
    if count is None:
        upper = int_attr(subrange, "DW_AT_upper_bound")
        if upper is None:
            return None  # flexible array member, or a VLA bound
        count = upper - (int_attr(subrange, "DW_AT_lower_bound") or 0) + 1
    return max(count, 0)


def _array_count(die: DIE) -> int:
    """Elements in all dimensions; 0 when a bound is unknown."""
    total = 1
    for subrange in children(die, "DW_TAG_subrange_type"):
        total *= _subrange_count(subrange) or 0
    return total


class Types:
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
            size = int_attr(die, "DW_AT_byte_size") or die.cu.header.address_size
            return _Shape(ParamKind.POINTER, size, size)
        if tag == "DW_TAG_enumeration_type":
            return self._enum_shape(die, depth)
        if tag in _AGGREGATES:
            return self._aggregate_shape(die, depth)
        if tag == "DW_TAG_array_type":
            return self._array_shape(die, depth)
        size = int_attr(die, "DW_AT_byte_size") or 0
        return _Shape(ParamKind.UNKNOWN, size, max(size, 1))

    def _enum_shape(self, die: DIE, depth: int) -> _Shape:
        size = int_attr(die, "DW_AT_byte_size") or 4
        underlying = self.shape(_type_of(die), depth + 1)
        if underlying.kind in (ParamKind.SIGNED, ParamKind.UNSIGNED):
            kind = underlying.kind
        else:
            values = children(die, "DW_TAG_enumerator")
            is_negative = any((int_attr(value, "DW_AT_const_value") or 0) < 0 for value in values)
            kind = ParamKind.SIGNED if is_negative else ParamKind.UNSIGNED
        return _Shape(kind, size, size)

    def _array_shape(self, die: DIE, depth: int) -> _Shape:
        if "DW_AT_GNU_vector" in die.attributes:
            size = int_attr(die, "DW_AT_byte_size") or 0
            return _Shape(ParamKind.UNKNOWN, size, size)
        element = self.shape(_type_of(die), depth + 1)
        count = _array_count(die)  # 0 for a flexible array member: no leaves at all
        byte_size = int_attr(die, "DW_AT_byte_size")
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
        size = int_attr(die, "DW_AT_byte_size")
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
            bit_size = int_attr(member, "DW_AT_bit_size")
            if bit_size is not None:
                fields.extend(_bitfield_leaves(member, shape, bit_size))
                continue
            offset = _member_offset(member)
            align = max(align, shape.align)
            is_packed |= offset % shape.align != 0
            if size <= _MAX_LEAVES and shape.size:  # zero-sized: flexible array, empty struct
                inner = shape.fields or (Field(0, shape.size, shape.kind),)
                fields.extend(Field(offset + f.offset, f.size, f.kind) for f in inner)
        explicit = int_attr(die, "DW_AT_alignment")
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
            counts = [_subrange_count(sub) for sub in children(die, "DW_TAG_subrange_type")]
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
        convention = int_attr(die, "DW_AT_calling_convention")
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
        if int_attr(child, "DW_AT_defaulted") == _DW_DEFAULTED_IN_CLASS:
            return False
        name = _name(child) or ""
        if name.startswith("~"):
            return True
        if name != _name(owner):
            return False
        # A constructor whose only parameter (besides this) is a reference to the class.
        params = [
            p
            for p in children(child, "DW_TAG_formal_parameter")
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
    data_bit = int_attr(member, "DW_AT_data_bit_offset")
    if data_bit is None:
        base = _member_offset(member) * 8
        legacy = int_attr(member, "DW_AT_bit_offset")  # DWARF 2/3: counted from the MSB
        storage = int_attr(member, "DW_AT_byte_size") or shape.size
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
