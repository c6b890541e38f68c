"""Records turned into their events' text a batch at a time: the fast reader's decoder.

The reader (reader.py) hands each record to its probe's handler as an ``Event``: the record's
registers, a ``Captured``, a ``Memory``, the fetch-args evaluated by the trap tier's own
closures, then the ``Event``, about 30 µs a record in all. A command that only prints the
events (``trace``: nothing asked of each event in Python but its line, and maybe a filter)
gives its probe a ``BatchOutput`` instead. For each run of that probe's records in a block
read from the ring (arch/x86_64/ring_block.py) the reader then calls one function generated
for the probe's record layout and its output: one ``struct.iter_unpack`` of exactly the
fields it needs, each fetch-arg's value computed inline as ``v0``, ``v1``..., and the
output's line (``LineFormat``, an expression the output gives as source: output/rows.py)
appended for each event; the batch's text is written at once. Where every value is a
register's word or a constant and the output gives its line as a template too
(``LineFormat.columns``), the decoder is columns.py's, which reads a run as columns and
hands what it cannot read plainly to this one.

**Exact or not at all.** The values are the very values the evaluator would give for the
same record: the same cut to the type (``evaluate.cut_to_type``'s rules, written as
expressions), the same fault rule (a memory capture's status counts the bytes copied), the
same string rule (``Captured.read_string``), the same clock (``TscClock``'s segment, else its
own call). ``plan_decoder`` returns None wherever that is not plain to see, and those records
keep the handlers' path: fetch-args through a dereference chain (``+8(+16(%si))``),
``symbol`` types, a plan with two captures of memory of one kind (the evaluator may then
find an address in another probe's copy), string arrays; the reader keeps there too the
records that carry the registers and the sites with more than one probe.

The records of returns (a return probe's trampoline writes them: fetch/fast.py
``plan_return_captures``) take the same path: ``$retval`` is the rax the plan captured,
``$argN`` the words the entry kept (``entry_word``), and each event's ``ip`` its own caller
(the captured "rip"), which the output's line names (``RowLayout.is_return``).

Decoders are generated Python source, as tracefs/records.py generates the kernel records'
builders; only names chosen here, integer constants and the output's line are written into
it, everything else enters through the function's namespace. Rejected: one closure per
fetch-arg called per record (a call costs as much as the rest of the event), and rows handed
to a formatter (making and unpacking them cost a fifth of the time).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final, Protocol

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import (
    COUNT_MASK,
    FAULTED,
    Bytes,
    Capture,
    CapturePlan,
    Const,
    Reg,
    String,
    Value,
    capture_size,
    entry_word,
)
from kprobes.errors import InternalError
from kprobes.process.fast.columns import Code, Column, ColumnDecoder, ColumnFormat
from kprobes.process.fast.columns import Decoder as Decoder  # reader.py's
from kprobes.process.fetch.evaluate import MASK64, cut_to_type, type_text
from kprobes.process.fetch.fast import STRING_LIMIT, Resolver
from kprobes.process.fetch.tree import (
    ARG_REGS,
    Kind,
    address,
    kind_of,
    reads_function_args,
    value,
)
from kprobes.spec import FetchArg, FunctionArg, ImmediateString, ProbeSpec, TypeSpec
from kprobes.values import dataclass

_ELEMENT: Final = {1: "B", 2: "H", 4: "I", 8: "Q"}
# A register's word cut to an integer type, as a ``memoryview`` reads it (little-endian:
# the type's bytes are the word's first): columns.py's ``Column.code``.
_CODES: Final[dict[str, Code]] = {
    **dict.fromkeys(("u8", "x8", "char"), "B"),
    **dict.fromkeys(("u16", "x16"), "H"),
    **dict.fromkeys(("u32", "x32"), "I"),
    **dict.fromkeys(("u64", "x64"), "Q"),
    **{"s8": "b", "s16": "h", "s32": "i", "s64": "q"},
}
_INTEGERS: Final = frozenset(f"{p}{w}" for p in "usx" for w in (8, 16, 32, 64))


@dataclass(frozen=True, slots=True)
class RowLayout:
    """What a probe's events hold, for the output that prints them: the event's names, its
    process, each fetch-arg's name and type (as ``EventArg.type``), and ``plain[i]``: value
    ``i`` is always an int already cut to its type (never a fault, a text or an array)."""

    group: str
    event: str
    pid: int
    names: tuple[str, ...]
    types: tuple[str, ...]
    plain: tuple[bool, ...]
    comm: Callable[[int], str]  # a thread's name, as the reader's events give it
    # The events of a return probe's records: ``(caller <- func)``. Each event's ``ip`` is
    # then its caller (the line's ``ip``, set for each event), named by ``locate``; the
    # function is ``func`` at ``func_ip`` (``Event.func``, ``Event.func_ip``).
    is_return: bool = False
    func: str = ""
    func_ip: int = 0
    locate: Callable[[int], str] | None = None


@dataclass(frozen=True, slots=True)
class LineFormat:
    """How an output prints one probe's events, for the decoder to inline: ``expr`` is the
    source of an expression over ``tid``, ``cpu``, ``ts`` (seconds) and the values ``v0``,
    ``v1``... that gives an event's text; ``setup`` a statement run once a batch, over
    ``ip`` and ``location`` (the site's); ``context`` a statement run when the thread or
    the CPU changes from one event to the next (over ``tid`` and ``cpu``); ``names`` what
    they read besides (each name, and each variable they set, starting with ``o_``).
    ``keep``, if not empty, is a condition over the same values: an event for which it is
    false is left out (a filter). ``write(text, printed, left_out)`` takes a batch's text
    and its counts. ``columns``, if given, is the same line for columns.py, which the
    decoder takes where every value is a register's word or a constant (and no ``keep``).
    ``lines``: each event is one line of text that ends in a newline, and decoding does
    nothing but make the text (no filter, no count of its own): the reader may then decode
    a probe's runs together and hand their lines back run by run (interleave.py)."""

    expr: str
    setup: str
    context: str
    names: dict[str, Any]
    write: Callable[[str, int, int], None]
    keep: str = ""
    columns: ColumnFormat | None = None
    lines: bool = False


class BatchOutput(Protocol):
    """A command's output for one probe that takes its events a batch at a time."""

    def writer(self, layout: RowLayout) -> LineFormat | None:
        """How this probe's events are printed (asked once, when its first records come);
        None: the events go to the handler after all."""
        ...


class _NotPlain(Exception):
    pass


class _Parts:
    """The fetch tree lowered to what a decoder can read straight from the record: a
    register's name, or a number (a ``tree.Lowering``); anything else is refused."""

    def register(self, name: str, spelled: str) -> Src:
        return Reg(name)

    def immediate(self, value: int) -> Src:
        return Const(value & MASK64)

    def constant(self, address: int) -> Src:
        return Const(address)

    def word(self, base: Src, offset: int) -> Src:
        raise _NotPlain("a dereference chain")

    def retval(self) -> Src:
        raise _NotPlain("$retval")

    def no_value(self, fetch: FetchArg) -> Exception:
        return _NotPlain(type(fetch).__name__)


class _ReturnParts(_Parts):
    """At the return (a trampoline's record): ``$retval`` is rax, as the plan captured it
    (``fetch/fast.plan_return_captures``)."""

    def retval(self) -> Src:
        return Reg("rax")


Src = Reg | Const
_PARTS = _Parts()
_RETURN_PARTS = _ReturnParts()


def _cut(type_: TypeSpec, v: str) -> str:
    """The expression that cuts the 64-bit word ``v`` to ``type_`` (``evaluate.cut_to_type``)."""
    name = type_.name
    if name == "char":
        return f"({v} & 255)"
    bits = int(name[1:])
    mask = (1 << bits) - 1
    word = v if bits == 64 else f"({v} & {mask})"
    if type_.bitfield is not None:
        b = type_.bitfield
        return f"({word} >> {b.offset} & {(1 << b.width) - 1})"
    if name[0] == "s":
        sign = 1 << (bits - 1)
        return f"(({word} ^ {sign}) - {sign})"
    return word


def _is_number(type_: TypeSpec) -> bool:
    return type_.name in _INTEGERS or type_.name == "char"


def _string(status: int, body: bytes) -> str | None:
    """A string capture as ``Captured.read_string`` and ``evaluate._string_at`` read it."""
    if not status:
        return None
    data = body[: status & COUNT_MASK]
    nul = data.find(b"\0")
    if nul >= 0:
        return data[:nul].decode(errors="replace")
    if status & FAULTED:
        return None
    return data.decode(errors="replace")


class _Source:
    """The decoder being written: the fields it unpacks, its statements, its namespace."""

    def __init__(self, plan: CapturePlan) -> None:
        self.plan = plan
        self.fields: dict[int, list[str]] = {}  # capture index → its field names
        self.columns: dict[int, Column] = {}  # value index → its column, where it has one
        self.lines: list[str] = []
        self.names: dict[str, Any] = {}

    def capture(self, c: Capture) -> list[str]:
        """The field names of capture ``c``, which must be in the plan, and for memory the
        only one of its kind (else the evaluator might read another copy: not plain)."""
        captures = self.plan.captures
        if c not in captures:
            raise _NotPlain(f"{c} is not captured as expected")
        if not isinstance(c, Value) and sum(type(o) is type(c) for o in captures) > 1:
            raise _NotPlain("two captures of memory of one kind")
        index = captures.index(c)
        if index not in self.fields:
            if isinstance(c, Value):
                self.fields[index] = [f"c{index}"]
            elif isinstance(c, String):
                self.fields[index] = [f"c{index}a", f"c{index}s", f"c{index}b"]
            else:
                n = c.size // c.elem
                elements = [f"c{index}e{j}" for j in range(n)]
                self.fields[index] = [f"c{index}a", f"c{index}s", *elements]
        return self.fields[index]

    def offset(self, c: Capture) -> int:
        """The byte offset of capture ``c`` in a record without the registers."""
        index = self.plan.captures.index(c)
        return sa.REC_HEADER + sum(map(capture_size, self.plan.captures[:index]))

    def word_column(self, i: int, c: Value, type_: TypeSpec) -> None:
        """Value ``i`` is the word of ``c`` cut to ``type_``: a column, unless a bitfield."""
        if type_.bitfield is None:
            self.columns[i] = Column(_CODES[type_.name], self.offset(c))

    def constant(self, v: object) -> str:
        name = f"k{len(self.names)}"
        self.names[name] = v
        return name

    def struct_format(self, slots: int) -> tuple[str, list[str]]:
        """The ``struct`` format of a record of this plan, and the names it unpacks."""
        fmt, names = ["<8xQQQ"], ["meta", "tp", "tsc"]
        for index, (c, size) in enumerate(
            zip(self.plan.captures, map(capture_size, self.plan.captures), strict=True)
        ):
            fields = self.fields.get(index)
            if fields is None:
                fmt.append(f"{size}x")
            elif isinstance(c, Value):
                fmt.append("Q")
            elif isinstance(c, String):
                fmt.append(f"QQ{size - 16}s")
            else:
                n = c.size // c.elem
                fmt.append(f"QQ{n}{_ELEMENT[c.elem]}{size - 16 - c.size}x")
            names += fields or []
        used = sa.REC_HEADER + self.plan.size
        fmt.append(f"{slots * sa.SLOT - used}x")
        return "".join(fmt), names


def _arg(
    src: _Source, i: int, arg: Any, resolvers: Resolver, site_addr: int, is_return: bool
) -> bool:
    """Append the statement that sets ``v<i>``; whether the value is plain (an int cut to
    its type); _NotPlain if the decoder cannot give exactly the evaluator's value."""
    fetch, type_ = arg.fetch, arg.effective_type
    resolve_data, file_addr = resolvers
    out = f"v{i}"
    parts = _RETURN_PARTS if is_return else _PARTS
    if is_return and reads_function_args(fetch):
        # ``$argN`` of a return: the register its entry kept (``ArgFetcher.entry`` on it).
        if not isinstance(fetch, FunctionArg) or not _is_number(type_) or type_.count:
            raise _NotPlain("a return's $argN read other than as a number")
        kept = Value(Reg(entry_word(ARG_REGS[fetch.index - 1])))
        (field,) = src.capture(kept)
        src.lines.append(f"{out} = {_cut(type_, field)}")
        src.word_column(i, kept, type_)
        return True
    match kind_of(fetch):
        case Kind.COMM:
            src.lines.append(f"{out} = comm(tid)")
            return False
        case Kind.TEXT:
            assert isinstance(fetch, ImmediateString)
            src.lines.append(f"{out} = {src.constant(fetch.value)}")
            return False
        case Kind.VALUE:
            if not _is_number(type_) or type_.count is not None:
                raise _NotPlain(f"a value of type {type_.name}")
            part = value(fetch, parts, resolve_data, file_addr)
            # The reader sets an entry's rip to the site; a return's is captured (its caller).
            if isinstance(part, Const) or (part.name == "rip" and not is_return):
                word = part.value if isinstance(part, Const) else site_addr
                cut = cut_to_type(type_, word)
                src.lines.append(f"{out} = {src.constant(cut)}")
                src.columns[i] = Column(constant=cut)
            else:
                (field,) = src.capture(Value(part))
                src.lines.append(f"{out} = {_cut(type_, field)}")
                src.word_column(i, Value(part), type_)
            return True
        case Kind.MEMORY:
            base, off = address(fetch, parts, resolve_data, file_addr)
            if type_.is_string and type_.count is None:
                _, status, body = src.capture(String(base, off, STRING_LIMIT))
                src.lines.append(f"{out} = string({status}, {body})")
                return False
            if not _is_number(type_):
                raise _NotPlain(f"memory of type {type_.name}")
            elem = type_.element_size
            _, status, *elements = src.capture(Bytes(base, off, elem * (type_.count or 1), elem))
            src.lines.append(f"n{i} = {status} & {COUNT_MASK}")
            each = [
                f"{_cut(type_, e)} if n{i} >= {elem * (j + 1)} else None"
                for j, e in enumerate(elements)
            ]
            if type_.count is None:
                src.lines.append(f"{out} = {each[0]}")
            else:
                src.lines.append(f"{out} = ({''.join(f'({e}), ' for e in each)})")
            return False
    raise _NotPlain(type(fetch).__name__)


@dataclass(frozen=True, slots=True)
class DecoderPlan:
    """What a probe's decoder reads and computes, before the output's line is known:
    ``plain[i]`` says value ``i`` is always an int cut to its type (``RowLayout.plain``)."""

    spec: ProbeSpec
    source: _Source
    plain: tuple[bool, ...]
    is_return: bool = False  # records of returns: each event's ``ip`` is its own (captured)

    def compile(
        self,
        line: LineFormat,
        slots: int,
        threads: dict[int, int],
        thread_miss: Callable[[int], int],
        seconds: Callable[[int], float],
        comm: Callable[[int], str],
    ) -> Decoder:
        """The decoder of a run of records of ``slots`` slots each (no registers) into the
        text ``line`` makes of them. ``threads`` names the thread pointers the reader knows,
        ``thread_miss`` the others; ``seconds`` is the clock's conversion, for a tick
        outside the segment the decoder is given."""
        if any(not name.startswith("o_") for name in line.names):
            raise InternalError("an output's names must start with o_")
        src = self.source
        lines = src.lines
        if self.is_return:  # the caller, where the trampoline returned to (the event's ip)
            (rip,) = src.capture(Value(Reg("rip")))
            lines = [f"ip = {rip}", *lines]
        fmt, fields = src.struct_format(slots)
        body = "\n".join(f"        {statement}" for statement in lines)
        keep = f"        if not ({line.keep}):\n            continue\n" if line.keep else ""
        source = f"""\
def decode(view, start, ns, per, end, ip, location):
    {line.setup}
    out = []
    append = out.append
    last = last_meta = -1  # the record before's: a thread's records come in runs
    for {", ".join(fields)}, in iter_unpack(view):
        if tp != last or meta != last_meta:  # another thread, or another CPU
            if tp != last:
                tid = threads_get(tp)
                if tid is None:
                    tid = thread_miss(tp)
                last = tp
            cpu = meta >> {sa.META_CPU_SHIFT} & {sa.META_CPU_MASK}
            if cpu == {sa.META_CPU_MASK}:
                cpu = -1
            last_meta = meta
            {line.context}
        ts = (ns + (tsc - start) / per) / 1e9 if start <= tsc < end else seconds(tsc)
{body}
{keep}        append({line.expr})
    return "".join(out), len(out)
"""
        namespace: dict[str, Any] = {
            **line.names,
            **src.names,
            "iter_unpack": struct.Struct(fmt).iter_unpack,
            "threads_get": threads.get,
            "thread_miss": thread_miss,
            "seconds": seconds,
            "comm": comm,
            "string": _string,
        }
        exec(compile(source, f"<decoder of {self.spec.effective_event}>", "exec"), namespace)
        decoder: Decoder = namespace["decode"]
        if line.columns is None or line.keep or len(src.columns) < len(self.spec.args):
            return decoder

        def tid_of(thread: int) -> int:
            tid = threads.get(thread)
            return thread_miss(thread) if tid is None else tid

        columns = tuple(src.columns[i] for i in range(len(self.spec.args)))
        caller = src.offset(Value(Reg("rip"))) if self.is_return else None
        return ColumnDecoder(line.columns, columns, slots * sa.SLOT, caller, decoder, tid_of)

    def layout(
        self,
        group: str,
        event: str,
        pid: int,
        comm: Callable[[int], str],
        locate: Callable[[int], str] | None = None,
        func_ip: int = 0,
    ) -> RowLayout:
        """What the output is told of the values (``LineFormat``'s ``v0``, ``v1``...); for
        the records of returns, ``locate`` names an address as the reader's events do, and
        ``func_ip`` is the function's entry (the site)."""
        spec = self.spec
        types = tuple(type_text(arg.effective_type) for arg in spec.args)
        if not self.is_return:
            return RowLayout(group, event, pid, spec.arg_names, types, self.plain, comm)
        if locate is None:
            raise InternalError("the records of returns need their callers named")
        func = locate(func_ip).split("+")[0]  # as reader.py's return events
        return RowLayout(
            group, event, pid, spec.arg_names, types, self.plain, comm,
            is_return=True, func=func, func_ip=func_ip, locate=locate,
        )  # fmt: skip


def plan_decoder(
    spec: ProbeSpec, resolvers: Resolver, plan: CapturePlan, site_addr: int
) -> DecoderPlan | None:
    """How ``spec``'s values are read from the records of its site at ``site_addr``, which
    captures ``plan`` (a return spec's: the records its trampoline writes); None where the
    decoder could not give exactly the evaluator's values (see the module docstring)."""
    src = _Source(plan)
    is_return = spec.is_return
    try:
        plain = tuple(
            _arg(src, i, arg, resolvers, site_addr, is_return) for i, arg in enumerate(spec.args)
        )
        if is_return:
            src.capture(Value(Reg("rip")))  # the caller: the event's ip
    except _NotPlain:
        return None
    return DecoderPlan(spec, src, plain, is_return)
