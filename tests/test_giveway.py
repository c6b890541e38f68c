"""The reader gives way to the program (process/fast/giveway.py): the records a poll reads
while ``run()`` waits are read at nice 19, the rest at the tool's own priority, and never
lower than it can come back from, nor with ``--block``.

The handler runs in the reader, so it sees the priority its record was read at.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kprobes
from kprobes.process.fast.giveway import LOWEST

pytestmark = pytest.mark.ptrace

TICKS = 150


def priorities_seen(spawn: Any, ticker: Path, *, block: bool) -> tuple[list[int], int]:
    """``ticker`` (a call of ``work`` every 2 ms) to its end, recorded: the nice value each
    record was handled at, and the tool's after ``run()``."""
    with open(os.devnull, "wb") as null:
        proc = spawn([ticker, TICKS, 2000], stdout=null.fileno())
    proc.records.block_when_full = block
    seen: list[int] = []
    kp = kprobes.Kprobe(
        symbol="work",
        optimize=True,
        async_handler=lambda p, h: seen.append(os.getpriority(os.PRIO_PROCESS, 0)),
    )
    proc.register_kprobe(kp)
    (entry,) = proc.list()
    assert entry.is_optimized, entry
    assert proc.run(timeout=120)
    assert proc.exit_code == 0
    assert len(seen) == kp.nhit == TICKS
    return seen, os.getpriority(os.PRIO_PROCESS, 0)


@pytest.fixture
def ticker(build: Callable[[str], Path]) -> Path:
    return build("ticker")


def test_a_poll_reads_at_the_lowest_priority_and_the_tool_gets_its_own_back(spawn, ticker):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert own < LOWEST
    down = LOWEST
    seen, after = priorities_seen(spawn, ticker, block=False)
    # A record is read by a poll (every 2 ms while run() waits), or by the read that ends
    # run(); the program sleeps 2 ms between two, so polls read most of them.
    assert seen.count(down) > TICKS // 2, seen
    assert set(seen) <= {down, own}, seen
    assert after == own


def test_with_block_the_reader_keeps_its_priority(spawn, ticker):
    """The program's threads spin in their detours for room: the reader must not yield."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    seen, after = priorities_seen(spawn, ticker, block=True)
    assert set(seen) == {own}
    assert after == own


CAN_COME_BACK = "from kprobes.process.fast.giveway import GiveWay; print(GiveWay().is_on)"


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ([], "True"),  # root: CAP_SYS_NICE
        (["setpriv", "--bounding-set=-sys_nice"], "False"),  # root without it
        (["nice", "-n", "19"], "False"),  # at the lowest already
    ],
    ids=["with-cap", "without-cap", "nice-19"],
)
def test_it_gives_way_only_where_it_can_come_back(how: list[str], expected: str) -> None:
    out = subprocess.run(
        [*how, sys.executable, "-c", CAN_COME_BACK], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected, out.stderr


CALLS = 3_000_000


def test_a_ring_half_full_is_read_at_the_tools_own_priority(spawn, build):
    """A reader that cannot keep up (a slow handler, a ring of 128 slots) takes its full
    share again rather than let the ring overflow while it gives way."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with open(os.devnull, "wb") as null:
        proc = spawn([build("busy"), 1, CALLS, 4], stdout=null.fileno())
    proc.ring_size = 8192
    seen: list[int] = []

    def slow(p: object, h: object) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))
        time.sleep(0.0002)

    kp = kprobes.Kprobe(symbol="hot", optimize=True, async_handler=slow)
    proc.register_kprobe(kp)
    assert proc.run(timeout=300)
    assert proc.exit_code == 0
    assert kp.nhit >= CALLS and len(seen) + proc.dropped == kp.nhit
    assert seen.count(own) > 10 * seen.count(LOWEST), (seen.count(own), seen.count(LOWEST))
