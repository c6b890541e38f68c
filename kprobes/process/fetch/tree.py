"""The fetch-arg tree of the probe language, walked once, for whoever lowers it.

A fetch-arg (``%di``, ``$stack3``, ``$arg7``, ``+8(+16(%si))``, ``@sym+4``, ``@+0x1000``) is a
tree of ``kprobes.spec`` nodes, and two parts need it. The trap tier evaluates it against a
stopped thread (evaluate.py makes closures); an optimized probe's detour copies, at the hit,
everything that evaluation will read (fast.py makes captures), and the same closures later
run against the copy. The copy is right only if it is the reads, in their order. Each part
used to walk the tree itself, in the same order by convention; now ``value()`` and
``address()`` walk it, and each part is a ``Lowering``: what a register, a number and a word
of memory are to it. Every rule of the language is written here and nowhere else: which
register ``$argN`` is, the stack slots of ``$arg7`` and ``$stackN``, symbols and file offsets
resolved to addresses, a dereference as the value of its base plus its offset.

The walk runs when a probe is compiled, never at a hit: what a lowering returns is what the
hit runs (a closure, a capture), so the closures are as flat as if each were written by hand.
Rejected: a visitor with a ``visit_*`` method per node that each part fills in, which leaves
the order of the reads, the very thing that must agree, to each part again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, Protocol, TypeVar

from kprobes.arch.x86_64.abi import INT_REGS
from kprobes.arch.x86_64.regs import canonical_name
from kprobes.errors import InternalError
from kprobes.spec import (
    Comm,
    Dereference,
    FetchArg,
    FileOffset,
    FunctionArg,
    Immediate,
    ImmediateString,
    MemoryAddress,
    MemorySymbol,
    Register,
    ReturnValue,
    StackAddress,
    StackEntry,
)

ARG_REGS: Final = INT_REGS  # $argN by the SysV ABI: rdi, rsi, rdx, rcx, r8, r9, then the stack

T = TypeVar("T")


class Lowering(Protocol[T]):
    """What the parts of a fetch are to one consumer. The walk asks in the order the
    evaluation reads: the register before the word at its offset, the inner dereference
    before the outer one; a lowering may refuse a part by raising."""

    def register(self, name: str, spelled: str) -> T:
        """The register ``name``, by its pt_regs name (``rdi``, ``eflags``, ``orig_rax``);
        ``spelled`` is how the spec names it (``%orig_ax``, ``$arg1``), for messages."""
        ...

    def immediate(self, value: int) -> T:
        """A number written in the spec (``\\7``, ``\\-1``), as written."""
        ...

    def constant(self, address: int) -> T:
        """An address known when the probe is compiled: ``@0x601040``, and ``@sym+4`` or
        ``@+0x1000`` once resolved. Not an ``immediate``: the evaluator cuts an immediate
        to 64 bits and reads an address as it was resolved."""
        ...

    def word(self, base: T, offset: int) -> T:
        """The 8-byte word at ``base + offset``."""
        ...

    def retval(self) -> T:
        """``$retval``: the function's return value, there only at the return."""
        ...

    def no_value(self, fetch: FetchArg) -> Exception:
        """The error for a node that has no number to give (``$comm`` or a ``\\"text"``
        under a dereference: the parser refuses them, a tree built by hand may not)."""
        ...


Resolve = Callable[[str], int]  # @symbol / @module:symbol → its address now
FileAddress = Callable[[int], int]  # an offset in the probed file → where it is mapped


def value(
    fetch: FetchArg, lowering: Lowering[T], resolve_data: Resolve, file_addr: FileAddress
) -> T:
    """The fetch's 64-bit value, lowered."""
    match fetch:
        case Register(name=name):
            return lowering.register(canonical_name(name), f"%{name}")  # %ax is rax
        case StackAddress():
            return lowering.register("rsp", "$stack")
        case StackEntry(index=n):
            return lowering.word(lowering.register("rsp", f"$stack{n}"), 8 * n)
        case FunctionArg(index=n):
            if n <= len(ARG_REGS):
                return lowering.register(ARG_REGS[n - 1], f"$arg{n}")
            slot = 8 * (n - len(ARG_REGS))  # above the return address at [rsp]
            return lowering.word(lowering.register("rsp", f"$arg{n}"), slot)
        case ReturnValue():
            return lowering.retval()
        case Immediate(value=v):
            return lowering.immediate(v)
        case MemoryAddress() | MemorySymbol() | FileOffset() | Dereference():
            return lowering.word(*address(fetch, lowering, resolve_data, file_addr))
    raise lowering.no_value(fetch)


def address(
    fetch: FetchArg, lowering: Lowering[T], resolve_data: Resolve, file_addr: FileAddress
) -> tuple[T, int]:
    """Where a memory fetch (``kind_of`` says ``MEMORY``) reads: its base, lowered, and the
    offset from it."""
    match fetch:
        case MemoryAddress(address=a):
            return lowering.constant(a), 0
        case MemorySymbol(symbol=sym, offset=off):
            return lowering.constant(resolve_data(sym) + off), 0
        case FileOffset(offset=off):
            return lowering.constant(file_addr(off)), 0
        case Dereference(offset=off, base=base):
            return value(base, lowering, resolve_data, file_addr), off
    raise InternalError(f"{type(fetch).__name__} does not read memory")


class Kind(enum.Enum):
    """What the top of a fetch-arg is, which decides how it is fetched."""

    COMM = "comm"  # $comm: the thread's name, nothing to walk
    TEXT = "text"  # \"text\": the text itself, nothing to walk
    MEMORY = "memory"  # ends by reading memory at address(): the type says what is read
    VALUE = "value"  # a 64-bit value(), cut to the type


def kind_of(fetch: FetchArg) -> Kind:
    match fetch:
        case Comm():
            return Kind.COMM
        case ImmediateString():
            return Kind.TEXT
        case MemoryAddress() | MemorySymbol() | FileOffset() | Dereference():
            return Kind.MEMORY
    return Kind.VALUE


def reads_function_args(fetch: FetchArg) -> bool:
    """Whether the fetch, or a base under it, is an ``$argN`` (a return probe takes those
    at the entry: the registers are gone by the return)."""
    while isinstance(fetch, Dereference):
        fetch = fetch.base
    return isinstance(fetch, FunctionArg)
