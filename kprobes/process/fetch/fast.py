"""A spec's fetch-args as captures for an optimized probe, and the event read back from them.

The trap tier evaluates a fetch-arg against the live thread (evaluate.py). An optimized probe
has no live thread to ask: its detour copies, at the hit, every register and every piece of
memory the evaluation will read (arch/x86_64/capture.py), and the tool later runs the same
``ArgFetcher`` against that copy. So this module only has to say *what* the evaluation
reads, walking the fetch tree in the order evaluate.py walks it: ``+8(+16(%si)):u32`` reads
``rsi``, then 8 bytes at ``rsi+16``, then 4 bytes at that word plus 8. Whatever cannot be
copied at the hit (``$retval``: return probes stay on traps; ``$comm`` and immediates need
nothing) is refused with the reason, and the probe keeps its trap.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64.capture import (
    REGISTERS,
    Bytes,
    CapturePlan,
    Const,
    Reg,
    Src,
    String,
    Value,
    Word,
)
from kprobes.arch.x86_64.regs import canonical_name
from kprobes.errors import ProbeRejected, SymbolNotFound
from kprobes.process.fetch.evaluate import ARG_REGS
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
    ProbeSpec,
    Register,
    ReturnValue,
    StackAddress,
    StackEntry,
    TypeSpec,
)
from kprobes.symbols.elf import did_you_mean

if TYPE_CHECKING:
    from kprobes.symbols.resolve import SymbolResolver

STRING_LIMIT: Final = 256  # bytes of a string an optimized probe copies (the trap tier: 4096)


class NotCapturable(Exception):
    """This fetch-arg cannot be evaluated at the hit in the program (the reason)."""


class _Planner:
    def __init__(self, resolve_data: Callable[[str], int], file_addr: Callable[[int], int]) -> None:
        self.plan = CapturePlan()
        self.resolve_data = resolve_data
        self.file_addr = file_addr

    def reg(self, name: str) -> Reg:
        reg = Reg(name)
        self.plan.add(Value(reg))  # the evaluation reads it again from the record
        return reg

    def word(self, base: Src, offset: int) -> Word:
        return Word(self.plan.add(Bytes(base, offset, 8, 8)))

    def value(self, fetch: FetchArg) -> Src:
        """Capture what gives the fetch's 64-bit value, and where that value is."""
        match fetch:
            case Register(name=name):
                canonical = canonical_name(name)
                if canonical not in REGISTERS:
                    raise NotCapturable(f"%{name} is not copied by an optimized probe")
                return self.reg(canonical)
            case StackAddress():
                return self.reg("rsp")
            case StackEntry(index=n):
                return self.word(self.reg("rsp"), 8 * n)
            case FunctionArg(index=n):
                if n <= len(ARG_REGS):
                    return self.reg(ARG_REGS[n - 1])
                return self.word(self.reg("rsp"), 8 * (n - len(ARG_REGS)))
            case ReturnValue():
                raise NotCapturable("$retval is read at the return, which is a trap")
            case Immediate(value=v):
                return Const(v)
            case MemoryAddress() | MemorySymbol() | FileOffset() | Dereference():
                return self.word(*self.address(fetch))
        raise NotCapturable(f"{type(fetch).__name__} has no value to copy")

    def address(self, fetch: FetchArg) -> tuple[Src, int]:
        match fetch:
            case MemoryAddress(address=a):
                return Const(a), 0
            case MemorySymbol(symbol=sym, offset=off):
                return Const(self.resolve_data(sym) + off), 0
            case FileOffset(offset=off):
                return Const(self.file_addr(off)), 0
            case Dereference(offset=off, base=base):
                return self.value(base), off
        raise NotCapturable(f"{type(fetch).__name__} does not read memory")

    def memory(self, fetch: FetchArg, type_: TypeSpec) -> None:
        base, off = self.address(fetch)
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


def plan_captures(specs: Sequence[tuple[ProbeSpec, Resolver]]) -> CapturePlan:
    """One plan that captures what every spec's fetch-args read (each spec with the
    resolvers of its ``@symbol`` and file offsets); NotCapturable if one cannot be read at
    the hit."""
    planner = _Planner(*specs[0][1]) if specs else _Planner(lambda s: 0, lambda o: 0)
    for spec, (resolve_data, file_addr) in specs:
        planner.resolve_data, planner.file_addr = resolve_data, file_addr
        if spec.is_return:
            raise NotCapturable("a return probe's event is made at the return, on traps")
        for arg in spec.args:
            fetch = arg.fetch
            if isinstance(fetch, Comm | ImmediateString):
                continue
            if isinstance(fetch, MemoryAddress | MemorySymbol | FileOffset | Dereference):
                planner.memory(fetch, arg.effective_type)
            else:
                planner.value(fetch)
    return planner.plan
