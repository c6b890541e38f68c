"""Hits counted by stack in the program (``stackcount`` on the fast tier, issue 23 item 5),
against the trap tier's counts of the same call paths.

Through the library's ``SpecTracer(stack_depth=N, fast_stacks=True, stack_counts=...)``: an
entry spec's site takes a jump whose detour walks the stack, hashes it into a stack id and
counts the hit in the id's entry of a table in the shared area
(arch/x86_64/stackids.py); the tool reads the table (process/fast/stackcounts.py) and hands
each stack's count over, with no event per hit. Each program is run once so and once on
traps, and the counts per stack must be equal, frame for frame (addresses aside). The
programs are built at -O2 without frame pointers: stacks.c's three known paths through
libstk.so, frames.c's recursion (five stacks of one function, three hits each). A table
too small for the stacks counts the hits it has no room for as dropped, never as another
stack's. And the command line: ``stackcount --folded`` equal with and without
``--no-optimize``, no tier note, and ``-n`` back on breakpoints.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import run_main as kprobes
from test_fast_stacks import frames_of

from kprobes.model import Event
from kprobes.process.specs import SpecTracer
from kprobes.spec import parse

pytestmark = pytest.mark.ptrace

Build = Callable[[str], Path]
DEPTH = 127


def counted(
    spawn: Callable[..., Any], argv: list[Any], spec: str, *, fast: bool, max_stacks: int = 64
) -> tuple[Counter[tuple[str, ...]], int, int, int]:
    """The hits of ``spec`` by stack over a run of ``argv`` (in the program, or on traps),
    the events made one by one, the probe's hits and the hits dropped."""
    with open(os.devnull, "wb") as devnull:
        proc = spawn(argv, stdout=devnull)
    by_stack: Counter[tuple[str, ...]] = Counter()
    events: list[Event] = []

    def sink(event: Event) -> None:  # a hit at a trap: one event
        events.append(event)
        assert event.stack is not None
        by_stack[frames_of(event.stack)] += 1

    def count(event: Event, n: int) -> None:  # a stack counted in the program
        assert event.stack is not None and n > 0
        by_stack[frames_of(event.stack)] += n

    tracer = SpecTracer(
        proc, sink, optimize=fast, stack_depth=DEPTH, fast_stacks=fast,
        stack_counts=count, max_stacks=max_stacks,
    )  # fmt: skip
    (placed,) = tracer.place([parse(f"p {spec}")])
    assert proc.run(timeout=120) and proc.exit_code == 0
    proc.records.read_records()
    dropped = proc.records.dropped
    tracer.close()
    return by_stack, len(events), placed.hits, dropped


@pytest.mark.parametrize(("name", "spec", "hits"), [("stacks", "leaf", 10), ("frames", "deep", 15)])
def test_counts_per_stack_equal_the_trap_tier_s(
    spawn: Any, build: Build, name: str, spec: str, hits: int
) -> None:
    fast, events, fast_hits, dropped = counted(spawn, [build(name)], spec, fast=True)
    assert events == 0 and dropped == 0  # every hit counted in the program, none as an event
    trap, trap_events, trap_hits, _ = counted(spawn, [build(name)], spec, fast=False)
    assert trap_events == trap_hits == fast_hits == hits
    assert fast == trap
    assert all(s[-1] == "" for s in fast)  # every walk complete
    # The known paths (a call site unrolled by the compiler is a stack of its own).
    paths: Counter[str] = Counter()
    for s, n in fast.items():
        paths[
            s[1].split("+")[0]
            if name == "stacks"
            else str(sum(f.startswith("deep+") for f in s) - 1)
        ] += n
    if name == "stacks":
        assert paths == {"b": 5, "a": 3, "stk_through": 2}
        assert all(s[1].endswith("[libstk.so]") for s in fast if "stk_through" in s[1])
    else:  # deep's recursion: 3 calls from main, each 4 deep
        assert paths == {str(depth): 3 for depth in range(5)}


def test_a_full_table_counts_the_rest_as_dropped(spawn: Any, build: Build) -> None:
    trap, _, _, _ = counted(spawn, [build("frames")], "deep", fast=False)
    fast, events, hits, dropped = counted(spawn, [build("frames")], "deep", fast=True,
                                          max_stacks=2)  # fmt: skip
    assert events == 0 and hits == 15
    assert len(fast) == 2  # the two stacks the table holds, each exact
    assert all(trap[s] == n for s, n in fast.items())
    assert dropped == hits - sum(fast.values()) == 9


def test_stackcount_counts_in_the_program_as_on_breakpoints(build: Build) -> None:
    program = build("stacks")
    fast, err = kprobes("stackcount", "--folded", "-c", program, "leaf")
    assert "breakpoint" not in err, err  # no tier note: the probe took its jump
    trap, _ = kprobes("stackcount", "--folded", "--no-optimize", "-c", program, "leaf")
    assert fast == trap and len(fast.splitlines()) == 3, fast
    assert "10 events" in err and "0 dropped" in err, err
    out, err = kprobes("stackcount", "--folded", "-n", "4", "-c", program, "leaf")
    assert "stacks keep every probe on a breakpoint" in err  # -n: each hit an event
    assert sum(int(line.split()[-1]) for line in out.splitlines()) == 4


def test_threads_hitting_one_stack_at_once_lose_no_count(spawn: Any, build: Build) -> None:
    # Four threads released together by a barrier, 50,000 calls each: the claim of the
    # stack's entry and its count are contended, and every hit must be in it.
    threads, calls = 4, 50_000
    fast, events, hits, dropped = counted(
        spawn, [build("threads"), threads, calls], "hammer", fast=True
    )
    assert hits == threads * calls and dropped == 0
    assert events + sum(fast.values()) == hits
    assert events == 0, "every hit counted in the program"
    assert all(s[0].startswith("hammer+0x0/") and s[-1] == "" for s in fast), fast
