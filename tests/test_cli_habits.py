"""Habits of the peers' command lines (issue 22, item 7), on real programs:

    trace -T            each event's time on the wall clock, the hit's own (compared with the
                        program's own readings of CLOCK_REALTIME around each call)
    latency/hist -i     the histogram printed and reset every interval, each with its time,
                        the last partial interval at the end; the intervals sum to the run
    -p A,B, -p A -p B   several processes in one command: each event carries its own pid,
                        count sums over them, per-process counts are each program's own,
                        one process's end does not end the others', and every one of them
                        is left untouched
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
import support

pytestmark = pytest.mark.ptrace

cli = support.cli
BACKENDS = support.CLI_BACKENDS


# -- trace -T ------------------------------------------------------------------------------------


def program_calls(stdout: str) -> dict[int, tuple[int, int]]:
    """``stamps``'s ``call I BEFORE AFTER`` lines: {i: (before, after)} in ns since the epoch."""
    calls = {}
    for line in stdout.splitlines():
        if line.startswith("call "):
            _, i, before, after = line.split()
            calls[int(i)] = (int(before), int(after))
    return calls


def ns_of(when: datetime) -> int:
    return (int(when.timestamp()) * 1_000_000 + when.microsecond) * 1000


# How far a jump-optimized probe's time may be from the program's readings: its record holds
# TSC ticks, turned into CLOCK_MONOTONIC by a line fitted as the run goes (linux/tsc.py),
# tens of microseconds off at first. A time taken when the event is printed instead is off
# by the reader's lag, and by the run's length for the first events; a trap's time and the
# kernel's are exact (the microsecond the column rounds to).
TSC_FIT = 1_000_000
ROUNDING = 1000


@pytest.mark.parametrize(
    ("backend", "options", "slack"),
    [
        ("ptrace", ("--no-optimize",), ROUNDING),
        ("ptrace", (), TSC_FIT),
        pytest.param("uprobes", (), ROUNDING, marks=support.needs_uprobes),
    ],
    ids=["ptrace-trap", "ptrace-jump", "uprobes"],
)
def test_T_gives_each_hit_its_wall_clock_time(
    build: Callable[[str], Path], backend: str, options: tuple[str, ...], slack: int
) -> None:
    prog = build("stamps")
    r = cli("trace", "-T", "--json", "--backend", backend, *options, "-c", f"{prog} 6 100000",
            "work")  # fmt: skip
    assert r.returncode == 0, r.stderr
    calls = program_calls(r.stdout)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(events) == len(calls) == 6, r.stdout
    for i, event in enumerate(events):
        before, after = calls[i]
        hit = ns_of(datetime.fromisoformat(event["time"]))
        assert before - slack <= hit <= after + slack, (i, before, hit, after)


def test_T_prints_the_time_of_day_in_place_of_the_seconds(build: Callable[[str], Path]) -> None:
    prog = build("stamps")
    r = cli("trace", "-T", "--no-optimize", "-c", f"{prog} 3 100000", "work", "r work")
    assert r.returncode == 0, r.stderr
    calls = program_calls(r.stdout)
    line = re.compile(
        r"^ +stamps-\d+ +\[\d{3}\] +(\d\d:\d\d:\d\d\.\d{6}): (p_work_0|r_work_0): \(.*\)$"
    )
    got = [m.groups() for m in map(line.match, r.stdout.splitlines()) if m]
    assert [name for _, name in got] == ["p_work_0", "r_work_0"] * 3, r.stdout
    for i, (clock, _) in enumerate(got):
        before, after = calls[i // 2]
        day = datetime.fromtimestamp(before // 10**9).strftime("%Y-%m-%d")  # the local date
        hit = ns_of(datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S.%f"))
        assert before - ROUNDING <= hit <= after + ROUNDING, (i, before, hit, after)
