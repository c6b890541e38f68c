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


# -- latency -i, hist -i --------------------------------------------------------------------------

CLOCK = re.compile(r"\d\d:\d\d:\d\d")


def intervals(stdout: str, header: re.Pattern[str]) -> list[list[str]]:
    """The lines of each interval, each list opening with its header line (the lines before
    the first header are left out)."""
    parts: list[list[str]] = []
    for line in stdout.splitlines():
        if header.fullmatch(line):
            parts.append([line])
        elif parts:
            parts[-1].append(line)
    return parts


def hist_counts(lines: list[str]) -> int:
    """The sum of a log2 histogram's counts (``LOW -> HIGH : COUNT |...|`` rows)."""
    return sum(int(line.split(":")[1].split("|")[0]) for line in lines if "->" in line)


@pytest.mark.parametrize("backend", BACKENDS)
def test_latency_i_prints_and_resets_the_histogram_every_interval(
    build: Callable[[str], Path], backend: str
) -> None:
    calls = 15
    r = cli("latency", "--backend", backend, "-i", "0.2", "-c", f"{build('ticker')} {calls} 60000",
            "work")  # fmt: skip
    assert r.returncode == 0, r.stderr
    parts = intervals(r.stdout, CLOCK)
    assert len(parts) >= 2, r.stdout  # the run lasts 0.9 s at least
    counts = [hist_counts(part) for part in parts]
    assert sum(counts) == calls, r.stdout  # each call in one interval: reset between them
    for part, n in zip(parts, counts, strict=True):
        average = [line for line in part if line.startswith("avg = ")]
        assert len(average) == (1 if n else 0), r.stdout  # funclatency's: none when empty
        if n:
            assert re.fullmatch(rf"avg = \d+ nsecs, total: \d+ nsecs, count: {n}", average[0])
    lines = r.stdout.splitlines()
    at = [i for i, line in enumerate(lines) if CLOCK.fullmatch(line)]  # each interval's line
    assert "done" in " ".join(lines[: at[-1]]), r.stdout  # the last at the end, partial
    if backend == "ptrace":
        # A return is counted (at its trap) before the program prints its tick line, and the
        # next call comes after that line: up to each interval's time, the calls counted are
        # the tick lines printed before it, or one more.
        seen = 0
        for start, n in zip(at, counts, strict=True):
            seen += n
            ticks = sum(1 for line in lines[:start] if line.startswith("tick "))
            assert ticks <= seen <= ticks + 1, r.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_hist_i_prints_and_resets_the_table_every_interval(
    build: Callable[[str], Path], backend: str
) -> None:
    calls = 12
    r = cli("hist", "--backend", backend, "-i", "0.2", "-c", f"{build('stamps')} {calls} 60000",
            "work i=%di:u64", "--key", "i")  # fmt: skip
    assert r.returncode == 0, r.stderr
    parts = intervals(r.stdout, re.compile(r"\[\d\d:\d\d:\d\d\]"))
    assert len(parts) >= 2, r.stdout
    values: list[int] = []
    for part in parts:
        assert part[1:3] == ["p_work_0:i", "\tCOUNT      EVENT"], r.stdout
        rows = [line.split() for line in part[3:] if line.startswith("\t")]
        assert all(count == "1" for count, _ in rows), r.stdout
        values += [int(value) for _, value in rows]
    assert sorted(values) == list(range(calls)), r.stdout  # each value once: reset each time

    r = cli("hist", "--backend", backend, "-i", "0.2", "-H", "-c",
            f"{build('stamps')} {calls} 60000", "work i=%di:u64", "--key", "i")  # fmt: skip
    assert r.returncode == 0, r.stderr
    parts = intervals(r.stdout, re.compile(r"\[\d\d:\d\d:\d\d\]"))
    assert len(parts) >= 2 and sum(map(hist_counts, parts)) == calls, r.stdout


@pytest.mark.parametrize("command", ["latency work", "hist work --key x", "count work"])
@pytest.mark.parametrize("seconds", ["0", "-1", "soon"])
def test_i_needs_a_number_of_seconds_above_0(command: str, seconds: str) -> None:
    name, *rest = command.split()
    r = cli(name, "-c", "true", "-i", seconds, *rest)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        f"kprobes {name}: error: argument -i/--interval: '{seconds}' is not a number of "
        "seconds above 0"
    )
