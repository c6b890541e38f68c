"""Hypothesis strategies for valid ``ProbeSpec`` and ``Filter`` values.

They model every rule of the grammar except the two global limits (63 characters and 16 fetch
instructions per argument): a test that renders a generated spec discards the rare value that
breaks one of those (``LIMIT_MESSAGES``) instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kprobes.spec import (
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
from kprobes.spec.fetchargs import REGISTERS, RESERVED_FIELD_NAMES
from kprobes.spec.types import STRING_OPS

LIMIT_MESSAGES = frozenset(
    {"Argument expression is too long", "Dereference is too much nested", "Invalid bitfield"}
)

U64 = st.integers(0, (1 << 64) - 1)
S64 = st.integers(-(1 << 63), (1 << 63) - 1)

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,31}", fullmatch=True)
events = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,62}", fullmatch=True)
groups = st.from_regex(r"[A-Za-z_-][A-Za-z0-9_-]{0,62}", fullmatch=True)
symbols = st.from_regex(r"[A-Za-z_.][A-Za-z0-9_.$@]{0,40}", fullmatch=True)
modules = st.from_regex(r"[A-Za-z0-9_.+-]{1,20}", fullmatch=True)
paths = st.from_regex(r"[A-Za-z0-9_.+:%()@-]{0,10}/[A-Za-z0-9_./+:%()@-]{0,30}", fullmatch=True)
immediate_strings = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters=" \t\n\v\f\r:="),
    max_size=20,
)


@dataclass(frozen=True)
class Ctx:
    is_return: bool
    is_uprobe: bool
    allows_function_args: bool


def _leaves(ctx: Ctx) -> st.SearchStrategy[FetchArg]:
    options: list[st.SearchStrategy[FetchArg]] = [
        st.builds(Register, st.sampled_from(sorted(REGISTERS))),
        st.builds(StackEntry, U64 if ctx.is_uprobe else st.integers(0, 2048)),
        st.just(StackAddress()),
        st.builds(Immediate, st.integers(-(1 << 63), (1 << 64) - 1)),
        st.builds(MemoryAddress, U64),
    ]
    if ctx.is_uprobe:
        options.append(st.builds(FileOffset, U64))
    else:
        options.append(st.builds(MemorySymbol, symbols, S64))
    if ctx.allows_function_args:
        options.append(st.builds(FunctionArg, st.integers(1, 2048)))
    if ctx.is_return:
        options.append(st.just(ReturnValue()))
    return st.one_of(options)


def fetches(ctx: Ctx) -> st.SearchStrategy[FetchArg]:
    """Any fetch but ``$comm`` and ``\\"...``, which cannot be dereferenced."""
    return st.recursive(
        _leaves(ctx),
        lambda inner: st.builds(Dereference, S64, inner, st.booleans()),
        max_leaves=4,
    )


def _ends_in_memory(fetch: FetchArg, *, user_ok: bool) -> bool:
    if isinstance(fetch, Dereference):
        return user_ok or not fetch.is_user
    return isinstance(fetch, MemoryAddress | MemorySymbol | FileOffset)


@st.composite
def typed_fetches(draw: st.DrawFn, ctx: Ctx) -> tuple[FetchArg, TypeSpec | None]:
    """A fetch with a type that suits it."""
    fetch: FetchArg
    if draw(st.integers(0, 9)) == 0:
        unreferenceable: list[FetchArg] = [Comm(), ImmediateString(draw(immediate_strings))]
        fetch = draw(st.sampled_from(unreferenceable))
        return fetch, draw(st.sampled_from([None, TypeSpec("string")]))
    fetch = draw(fetches(ctx))
    array_ok = _ends_in_memory(fetch, user_ok=False)
    count = st.one_of(st.none(), st.integers(1, 63)) if array_ok else st.none()
    choices: list[st.SearchStrategy[TypeSpec | None]] = [
        st.none(),
        st.builds(
            TypeSpec, st.sampled_from(["u8", "s16", "x32", "u64", "s64", "x8", "char"]), count
        ),
    ]
    bitfield = st.integers(0, 3).flatmap(
        lambda n: st.integers(1, 8 << n).flatmap(
            lambda w: st.builds(
                TypeSpec,
                st.just(f"u{8 << n}"),
                count,
                st.builds(Bitfield, st.just(w), st.integers(0, (8 << n) - w)),
            )
        )
    )
    choices.append(bitfield)
    if _ends_in_memory(fetch, user_ok=True) or isinstance(fetch, Immediate):
        choices.append(
            st.builds(
                TypeSpec,
                st.sampled_from(["string", "ustring"]),
                st.one_of(st.none(), st.integers(1, 63)),
            )
        )
    if not ctx.is_uprobe:
        choices.append(st.builds(TypeSpec, st.just("symbol"), count))
        choices.append(st.builds(TypeSpec, st.sampled_from(["%pd", "%pD"])))
        symstr_ok = isinstance(
            fetch, Register | StackEntry | ReturnValue | FunctionArg
        ) or _ends_in_memory(fetch, user_ok=False)
        if symstr_ok:
            choices.append(st.just(TypeSpec("symstr")))
    return fetch, draw(st.one_of(choices))


def kernel_locations() -> st.SearchStrategy[Location]:
    return st.one_of(
        st.builds(SymbolLocation, symbols, st.integers(0, (1 << 32) - 1), st.none() | modules),
        st.builds(AddressLocation, U64),
    )


def user_locations() -> st.SearchStrategy[Location]:
    return st.one_of(
        st.builds(FileOffsetLocation, paths, U64, st.none() | U64),
        st.builds(SymbolLocation, symbols, st.integers(0, (1 << 32) - 1), paths, st.none() | U64),
    )


@st.composite
def probe_specs(draw: st.DrawFn) -> ProbeSpec:
    """A valid probe definition (or, one time in ten, a delete)."""
    if draw(st.integers(0, 9)) == 0:
        return ProbeSpec(Command.DELETE, group=draw(st.none() | groups), event=draw(events))
    command = draw(st.sampled_from([Command.PROBE, Command.RETPROBE]))
    location = draw(st.one_of(kernel_locations(), user_locations()))
    suffix = not isinstance(location, AddressLocation) and draw(st.booleans())
    is_return = command is Command.RETPROBE or suffix
    if is_return and isinstance(location, SymbolLocation):
        location = SymbolLocation(location.symbol, 0, location.module, location.ref_ctr_offset)
    maxactive = 0
    if command is Command.RETPROBE and not isinstance(location, FileOffsetLocation):
        maxactive = draw(st.integers(0, 4096))
    spec = ProbeSpec(
        command=command,
        location=location,
        group=draw(st.none() | groups),
        event=draw(st.none() | events) if draw(st.booleans()) else None,
        maxactive=maxactive,
        has_return_suffix=suffix,
    )
    ctx = Ctx(
        is_return=is_return,
        is_uprobe=spec.is_uprobe,
        allows_function_args=isinstance(location, SymbolLocation) and location.offset == 0,
    )
    args: list[ProbeArg] = []
    used: set[str] = set(RESERVED_FIELD_NAMES)
    for i in range(draw(st.integers(0, 5))):
        fetch, typ = draw(typed_fetches(ctx))
        name = draw(st.none() | names)
        if name is None and isinstance(fetch, ImmediateString) and "=" in fetch.value:
            name = f"s{i}"
        effective = name if name is not None else f"arg{i + 1}"
        if effective in used:
            continue  # would be a duplicate: leave this one out
        used.add(effective)
        args.append(ProbeArg(fetch, name, typ))
    return ProbeSpec(
        command=spec.command,
        location=spec.location,
        args=tuple(args),
        group=spec.group,
        event=spec.event,
        maxactive=spec.maxactive,
        has_return_suffix=spec.has_return_suffix,
    )


# --- filters --------------------------------------------------------------------------------

FILTER_FIELDS = {
    "n": FieldKind.NUMBER,
    "size": FieldKind.NUMBER,
    "name": FieldKind.STRING,
    "path": FieldKind.STRING,
}
NUMBER_FIELDS = ["n", "size", "common_pid", "cpu"]
STRING_FIELDS = ["name", "path", "comm"]

_string_values = st.sampled_from(['"', "'"]).flatmap(
    lambda quote: st.text(
        st.characters(blacklist_categories=["Cs"], blacklist_characters=quote), max_size=12
    )
)

predicates = st.one_of(
    st.builds(
        Predicate,
        st.sampled_from(NUMBER_FIELDS),
        st.sampled_from(
            [
                FilterOp.EQ,
                FilterOp.NE,
                FilterOp.LT,
                FilterOp.LE,
                FilterOp.GT,
                FilterOp.GE,
                FilterOp.BAND,
            ]
        ),
        st.integers(-(1 << 63), (1 << 64) - 1),
    ),
    st.builds(
        Predicate,
        st.sampled_from(STRING_FIELDS),
        st.sampled_from(sorted(STRING_OPS, key=lambda op: op.value)),
        _string_values,
    ),
)


def filters() -> st.SearchStrategy[Filter]:
    return st.recursive(
        predicates,
        lambda inner: st.one_of(
            st.builds(Not, inner),
            st.builds(And, st.lists(inner, min_size=2, max_size=3).map(tuple)),
            st.builds(Or, st.lists(inner, min_size=2, max_size=3).map(tuple)),
        ),
        max_leaves=8,
    )
