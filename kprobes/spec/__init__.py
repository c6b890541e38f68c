"""The ``kprobe_events`` / ``uprobe_events`` grammar as frozen values, and back; no I/O.

    from kprobes.spec import parse, render
    spec = parse("p:myprobe do_sys_open dfd=%ax filename=+0(%si):string")
    spec.effective_group, spec.fields      # "kprobes", (("dfd", x64), ("filename", string))
    render(spec)                           # the same line, canonically spelled

Event filters in the kernel's filter grammar come with the same three verbs
(``parse_filter``, ``render_filter``) plus ``compile_filter`` for targets that filter in
Python. Every malformed input raises ``kprobes.errors.SpecError`` with the 0-based column.
"""

from kprobes.spec.filter import COMMON_FIELDS, compile_filter, glob_match, parse_filter
from kprobes.spec.parser import parse
from kprobes.spec.render import (
    render,
    render_arg,
    render_fetch,
    render_filter,
    render_location,
    render_type,
)
from kprobes.spec.types import (
    DEFAULT_TYPE,
    AddressLocation,
    And,
    Bitfield,
    Comm,
    Command,
    Dereference,
    FetchArg,
    FieldKind,
    FileOffset,
    FileOffsetLocation,
    Filter,
    FilterOp,
    FunctionArg,
    Immediate,
    ImmediateString,
    Location,
    MemoryAddress,
    MemorySymbol,
    Not,
    Or,
    Predicate,
    ProbeArg,
    ProbeSpec,
    Register,
    ReturnValue,
    StackAddress,
    StackEntry,
    SymbolLocation,
    TypeSpec,
)

__all__ = [
    "COMMON_FIELDS",
    "DEFAULT_TYPE",
    "AddressLocation",
    "And",
    "Bitfield",
    "Comm",
    "Command",
    "Dereference",
    "FetchArg",
    "FieldKind",
    "FileOffset",
    "FileOffsetLocation",
    "Filter",
    "FilterOp",
    "FunctionArg",
    "Immediate",
    "ImmediateString",
    "Location",
    "MemoryAddress",
    "MemorySymbol",
    "Not",
    "Or",
    "Predicate",
    "ProbeArg",
    "ProbeSpec",
    "Register",
    "ReturnValue",
    "StackAddress",
    "StackEntry",
    "SymbolLocation",
    "TypeSpec",
    "compile_filter",
    "glob_match",
    "parse",
    "parse_filter",
    "render",
    "render_arg",
    "render_fetch",
    "render_filter",
    "render_location",
    "render_type",
]
