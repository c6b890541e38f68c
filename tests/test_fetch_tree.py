"""The fetch-arg tree walked once (kprobes/process/fetch/tree.py), seen through a lowering that
writes down what it is asked, in order: the rules of each node kind, the order of the reads
(the register before the word at its offset, the inner dereference before the outer), and
what the two real lowerings build from one walk (the evaluator's closures read what the
detour's captures copy, in the same order).
"""

from __future__ import annotations

from typing import Any

import pytest

from kprobes.arch.x86_64.capture import Bytes, Reg, Value, Word
from kprobes.arch.x86_64.regs import Regs
from kprobes.errors import InternalError, TargetError
from kprobes.process.fetch.evaluate import ArgFetcher, Memory
from kprobes.process.fetch.fast import NotCapturable, plan_captures
from kprobes.process.fetch.tree import Kind, address, kind_of, reads_function_args, value
from kprobes.spec import Comm, Dereference, FetchArg, ImmediateString, parse

ENTRY, RETURN, UPROBE = "p:g/e work ", "r:g/e work ", "p:g/e /bin/true:0x1000 "


class Recorder:
    """A lowering to text: ``[rsi+16]`` is the word at rsi+16; ``asked`` is every call."""

    def __init__(self, refuse: str = "") -> None:
        self.asked: list[tuple[Any, ...]] = []
        self.refuse = refuse  # a register this lowering cannot give

    def register(self, name: str, spelled: str) -> str:
        self.asked.append(("register", name, spelled))
        if name == self.refuse:
            raise LookupError(f"{spelled} refused")
        return name

    def immediate(self, value: int) -> str:
        self.asked.append(("immediate", value))
        return f"#{value}"

    def constant(self, address: int) -> str:
        self.asked.append(("constant", address))
        return f"{address:#x}"

    def word(self, base: str, offset: int) -> str:
        self.asked.append(("word", base, offset))
        return f"[{base}+{offset}]"

    def retval(self) -> str:
        self.asked.append(("retval",))
        return "retval"

    def no_value(self, fetch: FetchArg) -> Exception:
        return ValueError(f"no value: {type(fetch).__name__}")


SYMBOLS = {"counter": 0x601040, "lib.so:table": 0x7F00_0000_2000}
resolved: list[object] = []


def resolve_data(name: str) -> int:
    resolved.append(name)
    return SYMBOLS[name]


def file_addr(offset: int) -> int:
    resolved.append(offset)
    return 0x5555_0000_0000 + offset


def fetch_of(line: str) -> FetchArg:
    return parse(line).args[0].fetch


def walk(line: str, refuse: str = "") -> tuple[str, list[tuple[Any, ...]]]:
    resolved.clear()
    lowering = Recorder(refuse)
    return value(fetch_of(line), lowering, resolve_data, file_addr), lowering.asked


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (ENTRY + "%di", "rdi"),
        (ENTRY + "%ax", "rax"),  # pt_regs names: %ax is rax, %flags eflags, %ip rip
        (ENTRY + "%flags", "eflags"),
        (ENTRY + "%ip", "rip"),
        (ENTRY + "%r12", "r12"),
        (ENTRY + "$stack", "rsp"),
        (ENTRY + "$stack0", "[rsp+0]"),
        (ENTRY + "$stack3", "[rsp+24]"),
        (ENTRY + "$arg1", "rdi"),  # the SysV ABI: rdi, rsi, rdx, rcx, r8, r9
        (ENTRY + "$arg2", "rsi"),
        (ENTRY + "$arg3", "rdx"),
        (ENTRY + "$arg4", "rcx"),
        (ENTRY + "$arg5", "r8"),
        (ENTRY + "$arg6", "r9"),
        (ENTRY + "$arg7", "[rsp+8]"),  # then the stack, above the return address at [rsp]
        (ENTRY + "$arg9", "[rsp+24]"),
        (RETURN + "$retval", "retval"),
        (ENTRY + "\\7", "#7"),
        (ENTRY + "\\-1", "#-1"),  # as written: a lowering decides what a negative is
        (ENTRY + "@0x601040", "[0x601040+0]"),
        (ENTRY + "@counter", "[0x601040+0]"),
        (ENTRY + "@counter+4", "[0x601044+0]"),  # the symbol's offset is in the constant
        (ENTRY + "@counter-8", "[0x601038+0]"),
        (UPROBE + "@+0x10", "[0x555500000010+0]"),
        (ENTRY + "+8(%si)", "[rsi+8]"),
        (ENTRY + "-8(%sp)", "[rsp+-8]"),
        (ENTRY + "+8(+16(%si))", "[[rsi+16]+8]"),
        (ENTRY + "+4($stack2)", "[[rsp+16]+4]"),
        (ENTRY + "+0($arg8)", "[[rsp+16]+0]"),
        (ENTRY + "+0(@counter)", "[[0x601040+0]+0]"),
        (ENTRY + "+16(\\4096)", "[#4096+16]"),
        (RETURN + "+8($retval)", "[retval+8]"),
    ],
)
def test_the_value_of_each_node(line: str, want: str) -> None:
    got, _ = walk(line)
    assert got == want


def test_the_walk_asks_in_the_order_of_the_reads() -> None:
    _, asked = walk(ENTRY + "+8(+16(%si))")
    assert asked == [
        ("register", "rsi", "%si"),
        ("word", "rsi", 16),
        ("word", "[rsi+16]", 8),
    ]
    _, asked = walk(ENTRY + "$arg7")
    assert asked == [("register", "rsp", "$arg7"), ("word", "rsp", 8)]
    _, asked = walk(ENTRY + "+0(+8(@counter))")
    assert asked == [
        ("constant", 0x601040),
        ("word", "0x601040", 0),
        ("word", "[0x601040+0]", 8),
        ("word", "[[0x601040+0]+8]", 0),
    ]


def test_registers_are_named_as_pt_regs_and_as_the_spec_wrote_them() -> None:
    assert walk(ENTRY + "%orig_ax")[1] == [("register", "orig_rax", "%orig_ax")]
    assert walk(ENTRY + "$stack")[1] == [("register", "rsp", "$stack")]
    assert walk(ENTRY + "$stack2")[1][0] == ("register", "rsp", "$stack2")
    assert walk(ENTRY + "$arg3")[1] == [("register", "rdx", "$arg3")]


def test_symbols_and_file_offsets_are_resolved_once_and_only_when_named() -> None:
    walk(ENTRY + "+0(+8(%di))")
    assert resolved == []
    walk(ENTRY + "+0(@counter+4)")
    assert resolved == ["counter"]
    walk(UPROBE + "+4(@+0x10)")
    assert resolved == [0x10]


def test_the_address_of_a_memory_fetch() -> None:
    lowering = Recorder()
    cases = {
        ENTRY + "@0x601040": ("0x601040", 0),
        ENTRY + "@counter+4": ("0x601044", 0),
        UPROBE + "@+0x10": ("0x555500000010", 0),
        ENTRY + "+8(%si)": ("rsi", 8),
        ENTRY + "+8(+16(%si))": ("[rsi+16]", 8),
        ENTRY + "-0x10($stack)": ("rsp", -16),
    }
    for line, want in cases.items():
        assert address(fetch_of(line), lowering, resolve_data, file_addr) == want, line


def test_a_refused_part_stops_the_walk() -> None:
    with pytest.raises(LookupError, match="%cs refused"):
        walk(ENTRY + "+8(+16(%cs))", refuse="cs")
    lowering = Recorder(refuse="cs")
    with pytest.raises(LookupError):
        value(fetch_of(ENTRY + "+8(+16(%cs))"), lowering, resolve_data, file_addr)
    assert lowering.asked == [("register", "cs", "%cs")]  # no word was asked after it


def test_a_node_without_a_value_is_the_lowerings_error() -> None:
    # The parser refuses $comm and text under a dereference; a tree built by hand may not.
    for base in (Comm(), ImmediateString("x")):
        with pytest.raises(ValueError, match=f"no value: {type(base).__name__}"):
            value(Dereference(0, base), Recorder(), resolve_data, file_addr)


def test_only_a_memory_fetch_has_an_address() -> None:
    with pytest.raises(InternalError, match="Register does not read memory"):
        address(fetch_of(ENTRY + "%di"), Recorder(), resolve_data, file_addr)


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (ENTRY + "$comm", Kind.COMM),
        (ENTRY + '\\"text"', Kind.TEXT),
        (ENTRY + "@0x601040", Kind.MEMORY),
        (ENTRY + "@counter", Kind.MEMORY),
        (UPROBE + "@+0x10", Kind.MEMORY),
        (ENTRY + "+0(%di):string", Kind.MEMORY),
        (ENTRY + "%di", Kind.VALUE),
        (ENTRY + "$stack", Kind.VALUE),
        (ENTRY + "$stack3", Kind.VALUE),  # a word of the stack, but always 8 bytes: a value
        (ENTRY + "$arg7", Kind.VALUE),
        (ENTRY + "\\7", Kind.VALUE),
        (RETURN + "$retval", Kind.VALUE),
    ],
)
def test_kind_of_the_top(line: str, kind: Kind) -> None:
    assert kind_of(fetch_of(line)) is kind


def test_function_args_under_dereferences() -> None:
    assert reads_function_args(fetch_of(ENTRY + "$arg1"))
    assert reads_function_args(fetch_of(ENTRY + "+8(+0($arg2))"))
    assert not reads_function_args(fetch_of(ENTRY + "%di"))
    assert not reads_function_args(fetch_of(ENTRY + "+0(+8(%di))"))
    assert not reads_function_args(fetch_of(RETURN + "$retval"))


# ---- the two lowerings of one walk ------------------------------------------------------------


class Reads:
    """Memory that writes down the addresses the evaluator reads, in order."""

    def __init__(self) -> None:
        self.log: list[int] = []

    def read(self, addr: int, size: int) -> bytes:
        self.log.append(addr)
        return (0x2000_0000 + addr % 0x1000).to_bytes(8, "little")[:size]

    def read_string(self, addr: int, max_len: int) -> bytes:
        raise TargetError("no strings here")


def test_one_walk_two_lowerings() -> None:
    """The detour's captures and the evaluator's reads come from the same walk: the same
    registers, the same words, in the same order."""
    spec = parse(ENTRY + "+8(+16(%si)):u32 $arg7")
    lowering = Recorder()
    for arg in spec.args:
        if kind_of(arg.fetch) is Kind.MEMORY:
            address(arg.fetch, lowering, resolve_data, file_addr)
        else:
            value(arg.fetch, lowering, resolve_data, file_addr)
    assert lowering.asked == [
        ("register", "rsi", "%si"),
        ("word", "rsi", 16),  # the u32 at [rsi+16]+8 is the type's read, not the walk's
        ("register", "rsp", "$arg7"),
        ("word", "rsp", 8),
    ]
    rsi, rsp = Reg("rsi"), Reg("rsp")
    assert plan_captures([(spec, (resolve_data, file_addr))]).captures == [
        Value(rsi),
        Bytes(rsi, 16, 8, 8),
        Bytes(Word(1), 8, 4, 4),
        Value(rsp),
        Bytes(rsp, 8, 8, 8),
    ]
    regs = Regs(1)
    regs.rsi, regs.rsp = 0x5000, 0x7FFC_0000
    memory = Reads()
    ArgFetcher(spec, resolve_data, file_addr).fetch(
        regs, Memory(memory.read, memory.read_string, hex, str)
    )
    word = 0x2000_0000 + 0x5010 % 0x1000
    assert memory.log == [0x5010, word + 8, 0x7FFC_0008]


def test_what_cannot_be_copied_is_refused_by_the_captures_alone() -> None:
    spec = parse(ENTRY + "+8(%orig_ax):u32")
    with pytest.raises(NotCapturable, match=r"^%orig_ax is not copied by an optimized probe$"):
        plan_captures([(spec, (resolve_data, file_addr))])
    regs = Regs(1)
    regs.orig_rax = 0x5000
    memory = Reads()
    ArgFetcher(spec, resolve_data, file_addr).fetch(
        regs, Memory(memory.read, memory.read_string, hex, str)
    )
    assert memory.log == [0x5008]
