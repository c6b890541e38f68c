"""Frozen values for probe definitions and event filters, as the user wrote them.

A ``ProbeSpec`` keeps what the text said and nothing the parser made up: a name the user left
out is ``None`` here and is supplied by a property (``effective_event``, ``fields``) that applies
the kernel's default. That is what lets ``render`` give back a line that means the same thing
and parses to an equal value, and lets the tracefs layer tell "the user chose this name" from
"the kernel will choose it".

Numbers are kept as values, not as the digits typed: ``vfs_read+0x10`` and ``vfs_read+16`` are
the same probe and compare equal. Rejected alternative: keeping the spelling of every number,
which made equal probes compare unequal and every consumer parse numbers again.

The values are plain data: they do not validate themselves. ``parse`` is the validator, and a
value is *valid* when ``parse`` could have produced it.
"""

from __future__ import annotations

import enum

from kprobes.spec.lexical import sanitize_event_name
from kprobes.values import dataclass


class Command(enum.Enum):
    """The first letter of a probe line."""

    PROBE = "p"
    RETPROBE = "r"
    DELETE = "-"


class FieldKind(enum.Enum):
    """How an event field compares in a filter: as a number or as a string."""

    NUMBER = "number"
    STRING = "string"


# --- Locations -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SymbolLocation:
    """``[MOD:]SYM[+OFF]``: a kernel symbol, ``LIB:SYM`` (``libc:malloc``), or ``PATH:SYM``.

    ``module`` is whatever came before the ``:``: a kernel module, a library name, or a path
    (it contains ``/``; then ``ref_ctr_offset`` may be set, as for uprobes).
    """

    symbol: str
    offset: int = 0
    module: str | None = None
    ref_ctr_offset: int | None = None

    @property
    def is_path(self) -> bool:
        """True for ``PATH:SYM``: the module names a file, uprobe style."""
        return self.module is not None and "/" in self.module


@dataclass(frozen=True, slots=True)
class AddressLocation:
    """``MEMADDR``: an absolute address."""

    address: int


@dataclass(frozen=True, slots=True)
class FileOffsetLocation:
    """``PATH:OFFSET[(REF_CTR_OFFSET)]``: a file offset, the uprobe_events form."""

    path: str
    offset: int
    ref_ctr_offset: int | None = None


Location = SymbolLocation | AddressLocation | FileOffsetLocation


# --- Fetch arguments -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    """``%REG``; ``name`` is the kernel's x86-64 name (``ax``, ``r8``, ``orig_ax``...)."""

    name: str


@dataclass(frozen=True, slots=True)
class MemoryAddress:
    """``@ADDR``: the memory at an absolute address."""

    address: int


@dataclass(frozen=True, slots=True)
class MemorySymbol:
    """``@SYM[+|-OFF]``: the memory at a data symbol plus an offset (kernel-style probes)."""

    symbol: str
    offset: int = 0


@dataclass(frozen=True, slots=True)
class FileOffset:
    """``@+OFFSET``: the memory at an offset of the probed file, once mapped (uprobes)."""

    offset: int


@dataclass(frozen=True, slots=True)
class StackEntry:
    """``$stackN``: the N-th word on the stack."""

    index: int


@dataclass(frozen=True, slots=True)
class StackAddress:
    """``$stack``: the stack pointer itself."""


@dataclass(frozen=True, slots=True)
class FunctionArg:
    """``$argN`` (N >= 1): the N-th function argument, at entry or (recorded) at return."""

    index: int


@dataclass(frozen=True, slots=True)
class ReturnValue:
    """``$retval``: the return value (return probes only)."""


@dataclass(frozen=True, slots=True)
class Comm:
    """``$comm``: the current task's name; always a string."""


@dataclass(frozen=True, slots=True)
class Dereference:
    """``+|-[u]OFF(BASE)``: the memory at BASE + OFF; ``is_user`` for the ``u`` form."""

    offset: int
    base: FetchArg
    is_user: bool = False


@dataclass(frozen=True, slots=True)
class Immediate:
    """``\\IMM``: a constant."""

    value: int


@dataclass(frozen=True, slots=True)
class ImmediateString:
    """``\\"STRING"``: a constant string (no white space: the kernel splits words first)."""

    value: str


FetchArg = (
    Register
    | MemoryAddress
    | MemorySymbol
    | FileOffset
    | StackEntry
    | StackAddress
    | FunctionArg
    | ReturnValue
    | Comm
    | Dereference
    | Immediate
    | ImmediateString
)


# --- Types ---------------------------------------------------------------------------------

INTEGER_TYPES = frozenset(f"{p}{w}" for p in "usx" for w in (8, 16, 32, 64))
STRING_TYPES = frozenset({"string", "ustring", "symstr", "%pd", "%pD"})
TYPE_NAMES = INTEGER_TYPES | STRING_TYPES | {"char", "symbol"}

_DATA_LOC_SIZE = 4  # a string field is a u32 __data_loc word: length << 16 | offset


@dataclass(frozen=True, slots=True)
class Bitfield:
    """``b<width>@<offset>/<container>``; the container is the ``TypeSpec``'s ``u`` type."""

    width: int
    offset: int


@dataclass(frozen=True, slots=True)
class TypeSpec:
    """A fetch type: ``name`` from ``TYPE_NAMES``, ``[count]`` for arrays, or a bitfield.

    A bitfield is ``TypeSpec("u32", bitfield=Bitfield(4, 3))`` for ``b4@3/32``, since the
    kernel stores it as its container type. ``count=1`` is not ``None``: ``string[1]`` is an
    array of one ``char *``, not a string.
    """

    name: str
    count: int | None = None
    bitfield: Bitfield | None = None

    @property
    def is_string(self) -> bool:
        """True for the types recorded as a string (``string``, ``ustring``, ``symstr``...)."""
        return self.name in STRING_TYPES

    @property
    def is_signed(self) -> bool:
        return self.name.startswith("s") and self.name in INTEGER_TYPES

    @property
    def is_array(self) -> bool:
        return self.count is not None

    @property
    def element_size(self) -> int:
        """Bytes of one element in the event record (a string: its 4-byte ``__data_loc``)."""
        if self.is_string:
            return _DATA_LOC_SIZE
        if self.name in ("char", "u8", "s8", "x8"):
            return 1
        if self.name == "symbol":
            return 8
        return int(self.name[1:]) // 8

    @property
    def size(self) -> int:
        """Bytes the field takes in the event record: ``element_size`` times ``count``."""
        return self.element_size * (self.count or 1)

    @property
    def field_kind(self) -> FieldKind:
        return FieldKind.STRING if self.is_string else FieldKind.NUMBER


DEFAULT_TYPE = TypeSpec("x64")
"""The kernel's default on x86-64: ``x`` of ``BITS_PER_LONG``."""

STRING_TYPE = TypeSpec("string")


# --- Probe definitions ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeArg:
    """``[NAME=]FETCHARG[:TYPE]``; ``name`` and ``type`` are None when not written."""

    fetch: FetchArg
    name: str | None = None
    type: TypeSpec | None = None

    @property
    def effective_type(self) -> TypeSpec:
        """The written type, else ``string`` for ``$comm`` and ``\\"...``, else ``x64``."""
        if self.type is not None:
            return self.type
        if isinstance(self.fetch, Comm | ImmediateString):
            return STRING_TYPE
        return DEFAULT_TYPE


KPROBE_GROUP = "kprobes"
UPROBE_GROUP = "uprobes"


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """One line of ``kprobe_events`` / ``uprobe_events``, as written.

    ``location`` is None only for ``Command.DELETE``. ``maxactive`` 0 means "not written"
    (the kernel's default). ``has_return_suffix`` records ``%return``.
    """

    command: Command
    location: Location | None = None
    args: tuple[ProbeArg, ...] = ()
    group: str | None = None
    event: str | None = None
    maxactive: int = 0
    has_return_suffix: bool = False

    @property
    def is_return(self) -> bool:
        """True for ``r...`` and ``...%return``."""
        return self.command is Command.RETPROBE or self.has_return_suffix

    @property
    def is_delete(self) -> bool:
        return self.command is Command.DELETE

    @property
    def is_uprobe(self) -> bool:
        """True when the location names a file (``PATH:...``): the uprobe_events syntax."""
        loc = self.location
        return isinstance(loc, FileOffsetLocation) or (
            isinstance(loc, SymbolLocation) and loc.is_path
        )

    @property
    def effective_group(self) -> str:
        """The group written, else ``uprobes`` for ``PATH:`` locations, else ``kprobes``.

        A delete without a group (``-:EVENT``) returns "": the kernel matches any group.
        """
        if self.group is not None:
            return self.group
        if self.is_delete:
            return ""
        return UPROBE_GROUP if self.is_uprobe else KPROBE_GROUP

    @property
    def effective_event(self) -> str:
        """The event written, else the name the kernel would generate."""
        if self.event is not None:
            return self.event
        return default_event_name(self)

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Each argument's name: the one written, else ``argN`` by position (from 1)."""
        return tuple(
            arg.name if arg.name is not None else f"arg{i}"
            for i, arg in enumerate(self.args, start=1)
        )

    @property
    def fields(self) -> tuple[tuple[str, TypeSpec], ...]:
        """The event's fields in order: (name, type), with the kernel's defaults applied."""
        return tuple(zip(self.arg_names, (a.effective_type for a in self.args), strict=True))

    @property
    def filter_fields(self) -> dict[str, FieldKind]:
        """The fields an event filter may name (arrays cannot be compared), by kind."""
        return {name: t.field_kind for name, t in self.fields if not t.is_array}


def _file_tail(path: str) -> str:
    """``kbasename(path)`` cut at the first of ``.-_``, as trace_uprobe.c names events."""
    base = path.rsplit("/", 1)[-1]
    for i, c in enumerate(base):
        if c in ".-_":
            return base[:i]
    return base


def default_event_name(spec: ProbeSpec) -> str:
    """The event name the kernel generates when the line gives none.

    * kprobe ``[MOD:]SYM+OFF``: ``p_SYM_OFF`` / ``r_MOD_SYM_0`` (offset in decimal,
      ``:`` and ``.`` made ``_``), from trace_kprobe.c.
    * ``MEMADDR``: ``p_0x%016x``. The kernel prints ``%p``, which is *hashed* on current
      kernels; we print the real address, padded as ``%px`` would.
    * uprobe ``PATH:OFFSET``: ``p_TAIL_0x%x`` where TAIL is the file name up to its first
      ``.-_``; always ``p_``, even for a return probe, as trace_uprobe.c does.
    * ``PATH:SYM+OFF`` (our extension): ``p_TAIL_SYM_OFF``, the kprobe scheme.
    """
    rp = "r" if spec.is_return else "p"
    loc = spec.location
    if isinstance(loc, AddressLocation):
        name = f"{rp}_0x{loc.address:016x}"
    elif isinstance(loc, FileOffsetLocation):
        name = f"p_{_file_tail(loc.path)}_0x{loc.offset:x}"
    elif isinstance(loc, SymbolLocation):
        if loc.module is None:
            where = loc.symbol
        elif loc.is_path:
            where = f"{_file_tail(loc.module)}_{loc.symbol}"
        else:
            where = f"{loc.module}_{loc.symbol}"
        name = f"{rp}_{where}_{loc.offset}"
    else:
        return ""
    return sanitize_event_name(name)


# --- Event filters -------------------------------------------------------------------------


class FilterOp(enum.Enum):
    """A filter comparison, by its spelling."""

    EQ = "=="
    NE = "!="
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    BAND = "&"
    GLOB = "~"


NUMBER_OPS = frozenset(
    {FilterOp.EQ, FilterOp.NE, FilterOp.LT, FilterOp.LE, FilterOp.GT, FilterOp.GE, FilterOp.BAND}
)
STRING_OPS = frozenset({FilterOp.EQ, FilterOp.NE, FilterOp.GLOB})


@dataclass(frozen=True, slots=True)
class Predicate:
    """``field op value``; ``value`` is an int for number fields, a str for string fields."""

    field: str
    op: FilterOp
    value: int | str


@dataclass(frozen=True, slots=True)
class And:
    """``a && b && ...``: two or more operands, flattened only where no parentheses were."""

    operands: tuple[Filter, ...]


@dataclass(frozen=True, slots=True)
class Or:
    """``a || b || ...``: two or more operands."""

    operands: tuple[Filter, ...]


@dataclass(frozen=True, slots=True)
class Not:
    """``!operand``."""

    operand: Filter


Filter = Predicate | And | Or | Not
