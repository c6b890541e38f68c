"""A spec's fetch-args as captures for an optimized probe, and the event read back from them.

The trap tier evaluates a fetch-arg against the live thread (evaluate.py). An optimized probe
has no live thread to ask: its detour copies, at the hit, every register and every piece of
memory the evaluation will read (arch/x86_64/capture.py), and the tool later runs the same
``ArgFetcher`` against that copy. So this module only has to say *what* the evaluation
reads, and it says it by lowering the very walk of the fetch tree that the evaluator's
closures are made by (tree.py): a register is a ``Value`` capture, a word of memory a
``Bytes`` capture, in the order the walk asks for them, which is the order the closures
read. ``+8(+16(%si)):u32`` reads ``rsi``, then 8 bytes at ``rsi+16``, then 4 bytes at that
word plus 8. Whatever cannot be copied at the hit (``$retval`` at an entry; a return
probe's ``$argN``, which the trap tier takes at the entry; registers the detour does not
save; ``$comm`` and immediates need nothing) is refused with the reason, and the probe keeps
its trap. A return probe's fetch-args are captured by its return trampoline
(``plan_return_captures``), where ``$retval`` is rax.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64.capture import (
    ENTRY_DATA,
    ENTRY_TSC,
    REGISTERS,
    Bytes,
    CapturePlan,
    Const,
    Reg,
    Src,
    String,
    Value,
    Word,
    entry_word,
)
from kprobes.arch.x86_64.shadow import ENTRY_REGS_MAX
from kprobes.errors import ProbeRejected, SymbolNotFound
from kprobes.process.fetch.tree import (
    ARG_REGS,
    Kind,
    address,
    kind_of,
    reads_function_args,
    value,
)
from kprobes.spec import FetchArg, FunctionArg, ProbeSpec, TypeSpec
from kprobes.symbols.elf import did_you_mean

if TYPE_CHECKING:
    from kprobes.symbols.resolve import SymbolResolver

STRING_LIMIT: Final = 256  # bytes of a string an optimized probe copies (the trap tier: 4096)


class NotCapturable(Exception):
    """This fetch-arg cannot be evaluated at the hit in the program (the reason)."""


class _Planner:
    """The tree lowered to captures (a ``tree.Lowering[Src]``): each part is copied once,
    and stands for where the record holds it."""

    def __init__(self) -> None:
        self.plan = CapturePlan()

    def register(self, name: str, spelled: str) -> Reg:
        if name not in REGISTERS:
            raise NotCapturable(f"{spelled} is not copied by an optimized probe")
        reg = Reg(name)
        self.plan.add(Value(reg))  # the evaluation reads it again from the record
        return reg

    def immediate(self, value: int) -> Const:
        return Const(value)

    def constant(self, address: int) -> Const:
        return Const(address)

    def word(self, base: Src, offset: int) -> Word:
        return Word(self.plan.add(Bytes(base, offset, 8, 8)))

    def retval(self) -> Src:
        raise NotCapturable("$retval is read at the return, which is a trap")

    def no_value(self, fetch: FetchArg) -> Exception:
        return NotCapturable(f"{type(fetch).__name__} has no value to copy")

    def memory(self, base: Src, off: int, type_: TypeSpec) -> None:
        """Capture what a memory fetch of this type reads at ``base + off``."""
        count = type_.count
        if type_.is_string:
            if count is None:
                self.plan.add(String(base, off, STRING_LIMIT))
                return
            pointers = self.plan.add(Bytes(base, off, 8 * count, 8))
            for i in range(count):
                self.plan.add(String(Word(pointers, i), 0, STRING_LIMIT))
            return
        elem = 8 if type_.name == "symbol" else type_.element_size
        self.plan.add(Bytes(base, off, elem * (count or 1), elem))


Resolver = tuple[Callable[[str], int], Callable[[int], int]]  # (resolve_data, file_addr)


def data_resolver(symbols: Callable[[], SymbolResolver]) -> Callable[[str], int]:
    """``@symbol`` / ``@module:symbol`` → its address in the program now."""

    def resolve(name: str) -> int:
        resolver = symbols()
        module_name, sep, sym = name.rpartition(":")
        module = resolver.find_module(module_name) if sep else resolver.main_module()
        found = module.image.lookup(sym)
        if found is None:
            raise SymbolNotFound(
                f"no symbol {sym!r} in {module.path}"
                f"{did_you_mean(module.image, sym, functions_only=False)}"
            )
        return module.bias + found.value

    return resolve


def file_resolver(symbols: Callable[[], SymbolResolver], path: str) -> Callable[[int], int]:
    """An offset in file ``path`` → the address where the program maps it."""

    def address(offset: int) -> int:
        module = symbols().find_module(path)
        for m in module.mappings:
            if m.offset <= offset < m.offset + (m.end - m.start):
                return m.start + offset - m.offset
        raise ProbeRejected(
            f"file offset {offset:#x} of {module.path} is not mapped", errno=errno.EINVAL
        )

    return address


class _ReturnPlanner(_Planner):
    """At the return (a return trampoline's record): ``$retval`` is rax there."""

    def retval(self) -> Src:
        return self.register("rax", "$retval")


def plan_captures(specs: Sequence[tuple[ProbeSpec, Resolver]]) -> CapturePlan:
    """One plan that captures what every spec's fetch-args read (each spec with the
    resolvers of its ``@symbol`` and file offsets); NotCapturable if one cannot be read at
    the hit."""
    planner = _Planner()
    for spec, resolvers in specs:
        if spec.is_return:
            raise NotCapturable("a return probe's event is made at the return, on traps")
        _plan_args(planner, spec, resolvers)
    return planner.plan


def plan_return_captures(
    spec: ProbeSpec, resolvers: Resolver, *, entry_data: bool = False
) -> CapturePlan:
    """What a return spec's fetch-args read at the return, captured by its trampoline, then
    the real return address ("rip") and the call's entry time (``ENTRY_TSC``), which make
    the event's ``(caller <- func)`` and its ``entry_timestamp``, and the registers its
    ``$argN`` name, which the entry kept (``entry_word``, see ``entry_registers``); with
    ``entry_data``, the ticket of the record its entry action wrote (``ENTRY_DATA``)."""
    keeps = entry_registers(spec)
    planner = _ReturnPlanner()
    _plan_args(planner, spec, resolvers, at_return=True)
    planner.plan.add(Value(Reg("rip")))
    planner.plan.add(Value(Reg(ENTRY_TSC)))
    if entry_data:
        planner.plan.add(Value(Reg(ENTRY_DATA)))
    for reg in keeps:
        planner.plan.add(Value(Reg(entry_word(reg))))
    return planner.plan


def entry_registers(spec: ProbeSpec) -> tuple[str, ...]:
    """The argument registers a return spec's ``$argN`` read at the entry, in the order of
    the arguments, which its entry keeps in the shadow stack for the return's record (none:
    ``()``); NotCapturable for what registers alone cannot give: memory read at the entry
    (``+0($arg1)``), an argument on the stack, more registers than a shadow entry holds
    (``retstack.ENTRY_REGS_MAX``)."""
    kept: dict[str, None] = {}
    for arg in spec.args:
        fetch = arg.fetch
        if not reads_function_args(fetch):
            continue
        reads_memory = arg.effective_type.is_string or arg.effective_type.count is not None
        if not isinstance(fetch, FunctionArg) or fetch.index > len(ARG_REGS) or reads_memory:
            raise NotCapturable(
                "a fetch-arg reads $argN's memory or stack at the entry, which is a trap"
            )
        kept[ARG_REGS[fetch.index - 1]] = None
    if len(kept) > ENTRY_REGS_MAX:
        raise NotCapturable(
            f"its $argN name {len(kept)} registers; the entry keeps {ENTRY_REGS_MAX}, more trap"
        )
    return tuple(kept)


def _plan_args(
    planner: _Planner, spec: ProbeSpec, resolvers: Resolver, *, at_return: bool = False
) -> None:
    resolve_data, file_addr = resolvers
    for arg in spec.args:
        fetch = arg.fetch
        if at_return and reads_function_args(fetch):
            continue  # taken at the entry (entry_registers)
        match kind_of(fetch):
            case Kind.MEMORY:
                base, off = address(fetch, planner, resolve_data, file_addr)
                planner.memory(base, off, arg.effective_type)
            case Kind.VALUE:
                value(fetch, planner, resolve_data, file_addr)
            case Kind.COMM | Kind.TEXT:
                pass  # nothing of the program's to copy
