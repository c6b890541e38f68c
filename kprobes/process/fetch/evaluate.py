"""Fetch-args of the probe language evaluated at a hit on a process (``kprobe_events`` rules).

Each ``ProbeArg`` of a spec is compiled once into a closure over the registers and the
program's memory; a hit calls the closures and gets ``EventArg`` values. A fetch either
yields a value (``%di``, ``$stack2``, ``\\7``) or, when it ends by reading memory
(``+8(%si)``, ``@0x601040``, ``@counter``), an address whose bytes the type decides: ``u32``
reads four, ``string`` reads up to a NUL, ``x8[4]`` reads four bytes. A read that faults gives
``None`` (printed ``(fault)``), never an exception: a bad pointer in the program must not
stop the trace.

The rules of the tree (which register ``$argN`` is, where ``$stackN`` lies, what a
dereference adds) are tree.py's, walked once when the probe is compiled; this module is the
lowering that makes closures, and the optimized probe's captures (fast.py) are the other, so
that the two read the same things in the same order. A register stays a name and a number
stays a number until a closure needs them: ``$stack3`` and ``+8(%di)`` are one closure that
reads the register and then memory, not a closure calling a closure (the hit runs them).

On a return probe the arguments are fetched at the entry and kept with the call's
instance (the kernel's "entry arguments" of return probes), since the registers are gone
by the return.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from kprobes.errors import SpecError, SymbolNotFound, TargetError
from kprobes.model import ArgValue, EventArg
from kprobes.process.fetch.tree import Kind, address, kind_of, reads_function_args, value
from kprobes.spec import FetchArg, ImmediateString, ProbeArg, ProbeSpec, TypeSpec
from kprobes.values import dataclass

STRING_MAX = 4096  # the kernel's MAX_STRING_SIZE is PATH_MAX
MASK64 = (1 << 64) - 1


class Memory:
    """What fetches need from the target: memory, symbols, thread names."""

    def __init__(
        self,
        read: Callable[[int, int], bytes],
        read_string: Callable[[int, int], bytes],
        symbolize: Callable[[int], str],
        comm: Callable[[int], str],
    ) -> None:
        self.read = read
        self.read_string = read_string
        self.symbolize = symbolize
        self.comm = comm


Value = Callable[[Any, Memory], int | None]  # (regs, memory) → value, None on a fault
Fetch = Callable[[Any, Memory], ArgValue]


@dataclass(frozen=True, slots=True)
class CompiledArg:
    name: str
    type: TypeSpec
    fetch: Fetch
    at_entry: bool  # a return probe fetches it at the entry ($argN)


def _read_int(memory: Memory, addr: int, size: int) -> int | None:
    try:
        data = memory.read(addr & MASK64, size)
    except TargetError:
        return None
    return int.from_bytes(data, "little")


Operand = str | int | Value
"""A part of a fetch while the tree is lowered: a register's pt_regs name, a number, or the
closure of the rest. A register is read through its property on ``Regs`` (one Python call;
``regs.get()`` is two)."""


class _Closures:
    """The tree lowered to closures over (regs, memory): a ``tree.Lowering[Operand]``."""

    def register(self, name: str, spelled: str) -> Operand:
        return name

    def immediate(self, value: int) -> Operand:
        return value & MASK64  # a 64-bit word: \-1 is 0xffffffffffffffff

    def constant(self, address: int) -> Operand:
        return address  # as resolved; a read masks it

    def word(self, base: Operand, offset: int) -> Operand:
        if isinstance(base, str):
            read = attrgetter(base)
            return lambda regs, m: _read_int(m, read(regs) + offset, 8)
        if isinstance(base, int):
            at = base + offset
            return lambda _r, m: _read_int(m, at, 8)
        inner = base

        def load(regs: Any, m: Memory) -> int | None:
            v = inner(regs, m)
            return None if v is None else _read_int(m, v + offset, 8)

        return load

    def retval(self) -> Operand:
        return "rax"  # at the return

    def no_value(self, fetch: FetchArg) -> Exception:
        return SpecError(f"{type(fetch).__name__} has no numeric value here", column=0)


_CLOSURES = _Closures()


def _value_of(part: Operand) -> Value:
    """The closure giving a lowered fetch's 64-bit value."""
    if isinstance(part, str):
        read = attrgetter(part)

        def register(regs: Any, _m: Memory) -> int:
            return int(read(regs))

        return register
    if isinstance(part, int):
        return lambda _r, _m: part
    return part


def _address_of(base: Operand, offset: int) -> Value:
    """The closure giving the address a memory fetch reads: its base plus its offset."""
    if isinstance(base, str):
        read = attrgetter(base)
        return lambda regs, _m: (int(read(regs)) + offset) & MASK64
    if isinstance(base, int):
        addr = (base + offset) & MASK64 if offset else base  # @sym: as resolved
        return lambda _r, _m: addr
    inner = base

    def deref(regs: Any, m: Memory) -> int | None:
        v = inner(regs, m)
        return None if v is None else (v + offset) & MASK64

    return deref


def cut_to_type(type_: TypeSpec, raw: int) -> int:
    """Cut a value to its type: width, sign, bitfield (the batch reader's decoders write
    the same rules as expressions: fast/batch.py)."""
    name = type_.name
    if name == "char":
        return raw & 0xFF
    bits = 64 if name == "symbol" else int(name[1:])
    value = raw & ((1 << bits) - 1)
    if type_.bitfield is not None:
        b = type_.bitfield
        value = (value >> b.offset) & ((1 << b.width) - 1)
    elif name[0] == "s" and value >> (bits - 1):
        value -= 1 << bits
    return value


def compile_arg(
    arg: ProbeArg,
    name: str,
    *,
    is_return: bool,
    resolve_data: Callable[[str], int],
    file_addr: Callable[[int], int],
) -> CompiledArg:
    type_ = arg.effective_type
    fetch = arg.fetch
    at_entry = is_return and reads_function_args(fetch)
    result: Fetch
    match kind_of(fetch):
        case Kind.COMM:

            def comm(regs: Any, m: Memory) -> ArgValue:
                return m.comm(regs.tid)

            result = comm
        case Kind.TEXT:
            assert isinstance(fetch, ImmediateString)  # kind_of says so
            text = fetch.value
            result = lambda _r, _m: text  # noqa: E731
        case Kind.MEMORY:
            where = _address_of(*address(fetch, _CLOSURES, resolve_data, file_addr))
            result = _memory_fetch(where, type_)
        case Kind.VALUE:
            part = value(fetch, _CLOSURES, resolve_data, file_addr)
            result = _value_fetch(_value_of(part), type_)
    return CompiledArg(name, type_, result, at_entry)


def _value_fetch(value: Value, type_: TypeSpec) -> Fetch:
    if type_.name == "symbol":

        def symbol(regs: Any, m: Memory) -> ArgValue:
            v = value(regs, m)
            return None if v is None else m.symbolize(v)

        return symbol

    def number(regs: Any, m: Memory) -> ArgValue:
        v = value(regs, m)
        return None if v is None else cut_to_type(type_, v)

    return number


def _memory_fetch(address: Value, type_: TypeSpec) -> Fetch:
    count = type_.count
    one: Callable[[Memory, int], ArgValue]
    if type_.is_string:
        one = _string_at
    elif type_.name == "symbol":
        one = _symbol_at
    else:
        size = type_.element_size

        def one_number(m: Memory, addr: int) -> ArgValue:
            raw = _read_int(m, addr, size)
            return None if raw is None else cut_to_type(type_, raw)

        one = one_number

    if count is None:

        def single(regs: Any, m: Memory) -> ArgValue:
            addr = address(regs, m)
            return None if addr is None else one(m, addr)

        return single
    # Arrays: consecutive elements; a string array is an array of char pointers.
    step = 8 if type_.is_string or type_.name == "symbol" else type_.element_size

    def array(regs: Any, m: Memory) -> ArgValue:
        addr = address(regs, m)
        if addr is None:
            return None
        out: list[ArgValue] = []
        for i in range(count):
            at = addr + i * step
            if type_.is_string:
                ptr = _read_int(m, at, 8)
                out.append(None if ptr is None else _string_at(m, ptr))
            else:
                out.append(one(m, at))
        return tuple(out)

    return array


def _string_at(m: Memory, addr: int) -> ArgValue:
    try:
        return m.read_string(addr, STRING_MAX).decode(errors="replace")
    except TargetError:
        return None


def _symbol_at(m: Memory, addr: int) -> ArgValue:
    raw = _read_int(m, addr, 8)
    return None if raw is None else m.symbolize(raw)


class ArgFetcher:
    """Every fetch-arg of one spec, compiled: ``entry()`` and ``fetch()`` give EventArgs."""

    def __init__(
        self,
        spec: ProbeSpec,
        resolve_data: Callable[[str], int],
        file_addr: Callable[[int], int],
    ) -> None:
        names = spec.arg_names
        self.args = tuple(
            compile_arg(
                arg,
                name,
                is_return=spec.is_return,
                resolve_data=resolve_data,
                file_addr=file_addr,
            )
            for arg, name in zip(spec.args, names, strict=True)
        )
        self.has_entry_args = any(a.at_entry for a in self.args)

    def entry(self, regs: Any, m: Memory) -> tuple[ArgValue, ...]:
        """The values a return probe must take at the entry ($argN), in order."""
        return tuple(a.fetch(regs, m) for a in self.args if a.at_entry)

    def fetch(
        self, regs: Any, m: Memory, at_entry: tuple[ArgValue, ...] = ()
    ) -> tuple[EventArg, ...]:
        out = []
        saved = iter(at_entry)
        for a in self.args:
            value = next(saved, None) if a.at_entry else a.fetch(regs, m)
            out.append(EventArg(a.name, type_text(a.type), value))
        return tuple(out)


def type_text(t: TypeSpec) -> str:
    """A fetch type as ``EventArg.type`` spells it (``u32``, ``x8[4]``, ``b4@2/32``)."""
    if t.bitfield is not None:
        return f"b{t.bitfield.width}@{t.bitfield.offset}/{t.name[1:]}"
    return t.name if t.count is None else f"{t.name}[{t.count}]"


class Symbolizer:
    """``func+0xoff/0xsize`` as the kernel's %pS prints it, else the hex address; cached."""

    def __init__(self, locate: Callable[[int], Any]) -> None:
        self._locate = locate  # SymbolResolver.locate_address
        self._cache: dict[int, str] = {}

    def __call__(self, addr: int) -> str:
        text = self._cache.get(addr)
        if text is None:
            try:
                loc = self._locate(addr)
            except SymbolNotFound:
                loc = None
            if loc is None or loc.symbol is None:
                return f"0x{addr:x}"  # not cached: symbols read later may know it
            text = f"{loc.symbol.name}+{loc.offset:#x}/{max(loc.symbol.size, 1):#x}"
            self._cache[addr] = text
        return text

    def forget(self) -> None:
        self._cache.clear()


class CommCache:
    """Thread names from /proc, read once per thread (``prctl`` renames are rare)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._names: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        name = self._names.get(tid)
        if name is None:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/comm") as f:
                    name = f.read().rstrip("\n")
            except OSError:
                name = ""
            self._names[tid] = name
        return name


class CpuReader:
    """The CPU a thread last ran on (field 39 of /proc/PID/task/TID/stat); -1 if unknown."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fds: dict[int, int] = {}

    def __call__(self, tid: int) -> int:
        fd = self._fds.get(tid)
        try:
            if fd is None:
                fd = os.open(f"/proc/{self.pid}/task/{tid}/stat", os.O_RDONLY | os.O_CLOEXEC)
                self._fds[tid] = fd
            data = os.pread(fd, 1024, 0)
        except OSError:
            return -1
        fields = data[data.rfind(b")") + 2 :].split()
        try:
            return int(fields[36])
        except (IndexError, ValueError):
            return -1

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
