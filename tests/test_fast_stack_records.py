"""Records with a stack walked in the program take the ring's room their walk filled, not
the deepest walk's (issue 23, item 5): a record is reserved for ``--stack-depth`` frames,
and once its walk is done the slots it did not fill go back to the ring
(``RecordAction._emit_give_back``: the head moved back when no producer reserved after it).

``recurse`` (tests/programs/recurse.c, -O2, no frame pointers) hits ``bottom`` 300 frames
down a recursion, deeper than the walk's limit of 127, then from main, 4 return addresses
deep, 20 times each. The stacks must be the trap tier's, frame for frame, the deep ones cut
at the limit with its marker; no record is dropped; and the ring's head, the slots every
record took, must be each record's own size: 17 slots for a deep one, 2 for a shallow one
(34 for two shallow ones before). Four threads writing at once (``threads``), where a
record often cannot give its slots back, must still have every record whole.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_fast_stacks import DEPTH, stacks, traced

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.stackwalk import STATUS
from kprobes.model import Event
from kprobes.process.specs import SpecTracer
from kprobes.spec import parse

pytestmark = pytest.mark.ptrace

Build = Callable[[str], Path]


def record_slots(returns: int) -> int:
    """Slots of a record of ``p bottom`` (no fetch-arg, no registers) with ``returns``
    return addresses."""
    return sa.slots_for(sa.REC_HEADER + STATUS + 8 * returns)


def test_a_recursion_deeper_than_the_limit_as_on_traps(spawn: Any, build: Build) -> None:
    argv = [build("recurse"), 300, 20]
    fast, optimized = traced(spawn, argv, "bottom", fast=True)
    assert optimized, "the site must take a jump"
    trap, _ = traced(spawn, argv, "bottom", fast=False)
    assert len(fast) == len(trap) == 40
    assert stacks(fast) == stacks(trap)
    depths = Counter((len(e.stack.frames), e.stack.stop) for e in fast if e.stack)
    assert depths == {(DEPTH, "depth limit"): 20, (5, ""): 20}


def test_the_ring_holds_each_record_s_own_size(spawn: Any, build: Build) -> None:
    with open(os.devnull, "wb") as devnull:
        proc = spawn([build("recurse"), 300, 20], stdout=devnull)
    events: list[Event] = []
    tracer = SpecTracer(proc, events.append, optimize=True, stack_depth=DEPTH, fast_stacks=True)
    (placed,) = tracer.place([parse("p bottom")])
    (area,) = proc._jumps.areas
    assert proc.run(timeout=120) and proc.exit_code == 0
    proc.records.read_records()
    head = int(area.view.cast("B").cast("Q")[sa.OFF_HEAD // 8])
    tracer.close()
    assert placed.hits == len(events) == 40 and proc.records.dropped == 0
    want = sum(record_slots(len(e.stack.frames) - 1) for e in events if e.stack)
    assert (record_slots(DEPTH - 1), record_slots(4)) == (17, 2)
    assert head == want == 20 * 17 + 20 * 2  # before: 40 * 17


def test_records_written_at_once_by_threads_stay_whole(spawn: Any, build: Build) -> None:
    threads, calls = 4, 5_000
    events, optimized = traced(spawn, [build("threads"), threads, calls], "hammer", fast=True)
    assert optimized and len(events) == threads * calls
    assert all(e.stack is not None and e.stack.stop == "" for e in events)
    frames = Counter(tuple(f.func for f in e.stack.frames[:2]) for e in events if e.stack)
    assert frames == {("hammer", "run"): threads * calls}
    assert {e.tid for e in events} and len({e.tid for e in events}) == threads
