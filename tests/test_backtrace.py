"""Stack traces at probe hits (``Process.backtrace``), with and without return probes.

The program (tests/programs/backtrace.c) calls main → a → b → c. A trace taken in a handler
must name that chain with the exact return addresses, which objdump gives independently: the
instruction after each ``call``. Return probes are the hard part: a frame hooked by a
kretprobe holds the trampoline's address in its return-address slot, and the traces of the
kernel's uprobes-based tools show ``[uprobes]`` there. Ours must show the real address, at
an entry probe, at nested hooked frames (recursion), and in a return handler.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

from kprobes import Kprobe, Kretprobe
from kprobes.symbols.resolve import SymbolResolver
from kprobes.symbols.unwind import unwind

pytestmark = pytest.mark.ptrace

Trace = list[tuple[int, str]]


@pytest.fixture
def program(build: Callable[[str], Path]) -> Path:
    return build("backtrace")


def start(spawn: Callable[..., Any], program: Path, *args: object) -> Any:
    with open(os.devnull, "wb") as devnull:
        return spawn([program, *args], stdout=devnull)


def return_site(pid: int, program: Path, caller: str, callee: str) -> int:
    """Run-time address of the instruction after ``caller``'s call to ``callee`` (objdump)."""
    insns = support.function_insns(program, caller)
    call = re.compile(rf"^call\s+[0-9a-f]+ <{re.escape(callee)}>$")
    for (_off, text), (next_off, _text) in itertools.pairwise(insns):
        if call.match(text):
            return support.runtime_address(pid, program, caller) + next_off
    raise AssertionError(f"{caller} has no call to {callee}:\n{insns}")


def site_text(pid: int, program: Path, function: str, addr: int) -> str:
    offset = addr - support.runtime_address(pid, program, function)
    return f"{function}+{offset:#x} [{program.name}]"


def expected_chain(pid: int, program: Path, calls: list[tuple[str, str]]) -> Trace:
    """c's entry, then the return site of every (caller, callee) call, innermost first."""
    entry = support.runtime_address(pid, program, "c")
    frames = [(entry, f"c+0x0 [{program.name}]")]
    for caller, callee in calls:
        addr = return_site(pid, program, caller, callee)
        frames.append((addr, site_text(pid, program, caller, addr)))
    return frames


CHAIN = [("b", "c"), ("a", "b"), ("main", "a")]


def check_outer_frames(trace: Trace, depth: int, program: Path) -> None:
    """Past main: libc's start frames (one or two), then _start, where the walk ends."""
    assert depth + 2 <= len(trace) <= depth + 3, trace
    assert all("[libc" in text for _addr, text in trace[depth:-1]), trace
    assert trace[-1][1].startswith("_start+") and trace[-1][1].endswith(f"[{program.name}]")


def test_trace_at_a_kprobe_names_the_call_chain(spawn, program):
    proc = start(spawn, program, "chain", 3)
    traces: list[Trace] = []
    proc.register_kprobe(
        Kprobe(symbol="c", pre_handler=lambda kp, regs: traces.append(proc.backtrace(regs)))
    )
    expected = expected_chain(proc.pid, program, CHAIN)
    assert proc.run(timeout=30) and proc.exit_code == 0
    assert len(traces) == 3
    for trace in traces:
        assert trace[:4] == expected
        check_outer_frames(trace, 4, program)
    assert traces[0] == traces[1] == traces[2]


def test_frames_hooked_by_kretprobes_show_the_real_return_address(spawn, program):
    proc = start(spawn, program, "chain", 3)
    resolver = SymbolResolver(proc.pid)
    traces: list[Trace] = []
    raw: list[list[int]] = []  # the same walk without the trampoline translation

    def module_at(addr: int) -> tuple[str, int] | None:
        module = resolver.get_module_at(addr)
        return None if module is None else (f"/proc/{proc.pid}/root{module.path}", module.bias)

    def pre_handler(_kp: Kprobe, regs: Any) -> None:
        traces.append(proc.backtrace(regs))
        read_word = lambda addr: int.from_bytes(proc.read(addr, 8), "little")  # noqa: E731
        raw.append([frame.addr for frame in unwind(regs.as_dict(), read_word, module_at)])

    returns: dict[str, int] = {}

    def count(ri: Any, _regs: Any) -> None:
        returns[ri.probe.symbol] = returns.get(ri.probe.symbol, 0) + 1

    # c's own return probe is at the same address as the Kprobe: an aggregate probe, where
    # either handler may run first.
    rps = [Kretprobe(symbol=name, handler=count) for name in ("a", "b", "c")]
    proc.register_kretprobes(rps)
    proc.register_kprobe(Kprobe(symbol="c", pre_handler=pre_handler))
    expected = expected_chain(proc.pid, program, CHAIN)
    xol = [entry for entry in proc.blacklist() if "out-of-line" in entry.reason]
    assert xol, "the trampoline lives in kprobes' out-of-line area"

    def is_ours(addr: int) -> bool:
        return any(addr in entry for entry in xol)

    assert proc.run(timeout=30) and proc.exit_code == 0
    assert len(traces) == 3
    for trace, untranslated in zip(traces, raw, strict=True):
        assert trace[:4] == expected
        check_outer_frames(trace, 4, program)
        assert not any(is_ours(addr) for addr, _text in trace)
        # Without the translation the walk runs into the trampoline: the slots are hooked.
        assert any(is_ours(addr) for addr in untranslated), [hex(a) for a in untranslated]
    assert returns == {"a": 3, "b": 3, "c": 3}


def test_recursion_with_every_frame_hooked(spawn, program):
    depth = 5
    proc = start(spawn, program, "rec", depth)
    traces: list[Trace] = []
    rp = Kretprobe(symbol="rec", handler=lambda ri, regs: None, maxactive=depth + 5)
    proc.register_kretprobe(rp)
    proc.register_kprobe(
        Kprobe(symbol="c", pre_handler=lambda kp, regs: traces.append(proc.backtrace(regs)))
    )
    calls = [("rec", "c")] + [("rec", "rec")] * depth + [("main", "rec")]
    expected = expected_chain(proc.pid, program, calls)
    assert proc.run(timeout=30) and proc.exit_code == 0
    assert rp.nhit == depth + 1 and rp.nmissed == 0
    [trace] = traces
    assert trace[: len(expected)] == expected
    check_outer_frames(trace, len(expected), program)


def test_trace_in_a_return_handler_starts_at_the_real_return_site(spawn, program):
    proc = start(spawn, program, "chain", 2)
    traces: dict[str, list[Trace]] = {"a": [], "b": [], "c": []}

    def handler(ri: Any, regs: Any) -> None:
        traces[ri.probe.symbol].append(proc.backtrace(regs))

    proc.register_kretprobes([Kretprobe(symbol=name, handler=handler) for name in ("a", "b", "c")])
    expected = expected_chain(proc.pid, program, CHAIN)
    assert proc.run(timeout=30) and proc.exit_code == 0
    # When c returns, the thread is at the return site in b, and a's and b's frames are
    # still hooked; when b returns, it is in a; when a returns, in main.
    for name, depth in (("c", 3), ("b", 2), ("a", 1)):
        assert len(traces[name]) == 2
        for trace in traces[name]:
            assert trace[:depth] == expected[4 - depth :], name
            check_outer_frames(trace, depth, program)
