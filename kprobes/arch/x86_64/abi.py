"""Where a function's arguments are at its first instruction: the SysV AMD64 calling convention.

A jprobe calls its handler with the probed function's arguments, which at the probe point are
still where the caller put them: integers and pointers in rdi, rsi, rdx, rcx, r8, r9, floating
point in xmm0-xmm7, everything else in the caller's outgoing argument area, which starts at
``rsp + 8`` because the call pushed the return address at ``rsp``.

This module is the classification algorithm of the psABI (section 3.2.3) as pure functions over
small values: the caller describes each parameter as an ``ArgSpec`` (its size, stack alignment
and one ``ArgClass`` per eightbyte) and gets back one ``ArgLocation`` per parameter. Structs are
classified from their scalar leaves with ``classify_aggregate``, which the caller fills from
DWARF; the alternative of guessing from the struct's size alone was rejected because it puts
``struct { float x, y; }`` in rdi when gcc puts it in xmm0.

Rules implemented, and what is left out:

* an aggregate larger than 16 bytes, or with an unaligned field, is MEMORY: copied by value
  into the argument area (never passed by reference);
* an eightbyte holding an INTEGER leaf is INTEGER, else SSE if it holds a float or double;
  long double (X87) anywhere in an aggregate makes it MEMORY;
* all or nothing: when the registers left cannot hold every eightbyte of an argument, the whole
  argument goes to the stack, and later, smaller arguments may still take registers;
* a function returning MEMORY gets the address of the result in rdi, shifting the rest;
* stack slots are multiples of 8 bytes; 16-byte-aligned values (long double, __int128) start
  on a 16-byte boundary of the argument area, which is 16-aligned at ``rsp + 8``;
* not modelled: __m128/__m256 vectors (SSEUP), _Complex long double (COMPLEX_X87), and the
  argument area of variadic calls past the named parameters (their types are unknown).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Final

from kprobes.values import dataclass

INT_REGS: Final = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
SSE_REGS: Final = tuple(f"xmm{i}" for i in range(8))
RETURN_ADDRESS_SIZE: Final = 8  # [rsp] at entry; the first stack argument is at rsp + 8
RED_ZONE: Final = 128  # below rsp: the function's own, which signal frames and detours skip
# The fetch fixup convention of detour code (capture.py): a load that may fault runs with
# r11 = FETCH_FAULT_MAGIC and r10 = where to continue if it faults. A SIGSEGV or SIGBUS whose
# rip is in one of our detour pages and whose r11 holds the magic is ours: rip = r10, and the
# signal is discarded (the kernel's exception tables for copy_from_user_nofault, in our words).
FETCH_FAULT_MAGIC: Final = int.from_bytes(b"KPFETCH!", "little")
EIGHTBYTE: Final = 8
_MAX_REGISTER_AGGREGATE: Final = 16


class ArgClass(Enum):
    """The psABI class of one eightbyte."""

    INTEGER = "INTEGER"  # general purpose register
    SSE = "SSE"  # low 8 bytes of an xmm register
    X87 = "X87"  # long double: in memory when passed, in st0 when returned
    MEMORY = "MEMORY"  # on the stack
    NO_CLASS = "NO_CLASS"  # padding only; used while merging, never in an ArgSpec

    def merge(self, other: ArgClass) -> ArgClass:
        """The class of an eightbyte that holds leaves of both classes (psABI 3.2.3, 4.c)."""
        if self is other:
            return self
        if self is ArgClass.NO_CLASS:
            return other
        if other is ArgClass.NO_CLASS:
            return self
        if ArgClass.MEMORY in (self, other) or ArgClass.X87 in (self, other):
            return ArgClass.MEMORY
        return ArgClass.INTEGER  # INTEGER with SSE


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """A scalar leaf of an aggregate: bytes [offset, offset + size) of class ``cls``.

    ``cls`` is INTEGER (integers, pointers, bool, enums, bit-field bytes), SSE (float, double)
    or X87 (long double). A leaf whose offset is not a multiple of its size is unaligned.
    """

    offset: int
    size: int
    cls: ArgClass


def classify_aggregate(size: int, fields: Sequence[FieldSpec]) -> tuple[ArgClass, ...]:
    """The classes of a struct or union of ``size`` bytes with these leaves, one per eightbyte,
    or ``(MEMORY,)``. Trailing padding-only eightbytes are dropped: they take no register.
    """
    # Step 1: too big, or unaligned fields (a packed struct): memory.
    if size > _MAX_REGISTER_AGGREGATE:
        return (ArgClass.MEMORY,)
    if any(f.size and f.offset % f.size for f in fields):
        return (ArgClass.MEMORY,)
    # Step 2: merge the leaves into their eightbytes.
    classes = [ArgClass.NO_CLASS] * ((size + EIGHTBYTE - 1) // EIGHTBYTE)
    for f in fields:
        first = f.offset // EIGHTBYTE
        last = (f.offset + max(f.size, 1) - 1) // EIGHTBYTE
        for index in range(first, min(last, len(classes) - 1) + 1):
            classes[index] = classes[index].merge(f.cls)
    # Step 3: post-merger cleanup: memory anywhere makes it all memory.
    if ArgClass.MEMORY in classes or ArgClass.X87 in classes:
        return (ArgClass.MEMORY,)
    while classes and classes[-1] is ArgClass.NO_CLASS:
        classes.pop()
    if ArgClass.NO_CLASS in classes:  # a hole before data: only with over-aligned members
        classes = [ArgClass.SSE if c is ArgClass.NO_CLASS else c for c in classes]
    return tuple(classes)


@dataclass(frozen=True, slots=True)
class ArgSpec:
    """How one parameter is passed, as far as the calling convention cares."""

    size: int
    classes: tuple[ArgClass, ...]  # one per eightbyte; (MEMORY,) or (X87,) for the stack
    align: int = 8  # alignment of its slot in the stack argument area (8, or 16)

    def __post_init__(self) -> None:
        if ArgClass.NO_CLASS in self.classes:
            raise ValueError("NO_CLASS is a merge state, not the class of an argument")
        if self.align & (self.align - 1) or self.align <= 0:
            raise ValueError(f"alignment {self.align} is not a power of two")

    @classmethod
    def integer(cls, size: int = 8) -> ArgSpec:
        """An integer, pointer, bool or enum; 16 bytes (__int128) takes two registers."""
        if size > EIGHTBYTE:
            return cls(size, (ArgClass.INTEGER, ArgClass.INTEGER), align=16)
        return cls(size, (ArgClass.INTEGER,))

    @classmethod
    def sse(cls, size: int = 8) -> ArgSpec:
        """A float (4 bytes) or a double (8 bytes)."""
        return cls(size, (ArgClass.SSE,))

    @classmethod
    def x87(cls) -> ArgSpec:
        """A long double: 10 bytes of x87 extended precision in a 16-byte slot."""
        return cls(16, (ArgClass.X87,), align=16)

    @classmethod
    def aggregate(cls, size: int, fields: Sequence[FieldSpec], align: int = 8) -> ArgSpec:
        """A struct or union passed by value, classified from its scalar leaves."""
        return cls(size, classify_aggregate(size, fields), max(align, 8))

    @property
    def is_in_memory(self) -> bool:
        """True when the value is passed on the stack whatever registers are free."""
        return ArgClass.MEMORY in self.classes or ArgClass.X87 in self.classes


def returns_in_memory(spec: ArgSpec | None) -> bool:
    """Does a function returning this pass a hidden result pointer in rdi? (Not for void, not
    for long double, which comes back in st0.)"""
    return spec is not None and ArgClass.MEMORY in spec.classes


# A part of a location: a register name, or a byte offset from rsp at the function's entry.
Part = str | int


@dataclass(frozen=True, slots=True)
class ArgLocation:
    """Where one argument is at the first instruction of the called function.

    In registers, ``parts[i]`` holds eightbyte ``i`` of the value (an xmm register its low 8
    bytes); bytes of ``size`` past ``8 * len(parts)`` are padding. On the stack, ``parts`` is
    one int: the value is the ``size`` bytes at ``rsp + parts[0]``.
    """

    size: int
    parts: tuple[Part, ...]

    @property
    def is_on_stack(self) -> bool:
        return len(self.parts) == 1 and isinstance(self.parts[0], int)

    @property
    def stack_offset(self) -> int | None:
        """Offset from rsp at entry, or None when the value is in registers."""
        part = self.parts[0] if self.parts else None
        return part if isinstance(part, int) else None

    @property
    def registers(self) -> tuple[str, ...]:
        return tuple(part for part in self.parts if isinstance(part, str))


class _Allocator:
    """The registers and stack bytes handed out so far for one call, in argument order."""

    def __init__(self, first_int: int) -> None:
        self.next_int = first_int
        self.next_sse = 0
        self.stack = RETURN_ADDRESS_SIZE  # next free byte of the argument area, from rsp

    def take_registers(self, classes: tuple[ArgClass, ...]) -> tuple[str, ...] | None:
        needed_int = classes.count(ArgClass.INTEGER)
        needed_sse = classes.count(ArgClass.SSE)
        if self.next_int + needed_int > len(INT_REGS):
            return None
        if self.next_sse + needed_sse > len(SSE_REGS):
            return None
        taken = []
        for cls in classes:
            if cls is ArgClass.INTEGER:
                taken.append(INT_REGS[self.next_int])
                self.next_int += 1
            else:
                taken.append(SSE_REGS[self.next_sse])
                self.next_sse += 1
        return tuple(taken)

    def take_stack(self, size: int, align: int) -> int:
        # The argument area is aligned to (at least) 16 at rsp + 8, so align relative to it.
        base = self.stack - RETURN_ADDRESS_SIZE
        base = (base + align - 1) // align * align
        offset = RETURN_ADDRESS_SIZE + base
        self.stack = offset + max((size + EIGHTBYTE - 1) // EIGHTBYTE * EIGHTBYTE, EIGHTBYTE)
        return offset


def assign_locations(
    specs: Sequence[ArgSpec], *, returns: ArgSpec | None = None
) -> tuple[ArgLocation, ...]:
    """The location of each parameter of a call, at the called function's first instruction.

    ``returns`` describes the return value; when it is MEMORY the hidden result pointer takes
    rdi first. Arguments are placed left to right, as the psABI prescribes.
    """
    allocator = _Allocator(first_int=1 if returns_in_memory(returns) else 0)
    locations = []
    for spec in specs:
        registers = None
        if not spec.is_in_memory:
            registers = allocator.take_registers(spec.classes)
        if registers is not None:
            locations.append(ArgLocation(spec.size, registers))
        else:
            offset = allocator.take_stack(spec.size, max(spec.align, EIGHTBYTE))
            locations.append(ArgLocation(spec.size, (offset,)))
    return tuple(locations)


def gather(
    location: ArgLocation,
    read_register: Callable[[str], bytes],
    stack: bytes,
) -> bytes:
    """The ``location.size`` bytes of an argument, little-endian, from a register reader
    (``"rdi"`` → 8 bytes, ``"xmm0"`` → at least its low 8 bytes) and a copy of the stack that
    starts at rsp at entry. Padding past the registers reads as zeros.
    """
    offset = location.stack_offset
    if offset is not None:
        if offset + location.size > len(stack):
            raise ValueError(
                f"argument at rsp+{offset:#x} ({location.size} bytes) is past the stack copy"
            )
        return stack[offset : offset + location.size]
    raw = b"".join(
        read_register(name)[:EIGHTBYTE].ljust(EIGHTBYTE, b"\0") for name in location.registers
    )
    return raw[: location.size].ljust(location.size, b"\0")
