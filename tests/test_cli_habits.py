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
import signal
import subprocess
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
import support

pytestmark = pytest.mark.ptrace

cli = support.cli
BACKENDS = support.CLI_BACKENDS
NEEDS_UPROBES = support.needs_uprobes


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
        pytest.param("uprobes", (), ROUNDING, marks=NEEDS_UPROBES),
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


def test_T_puts_the_time_before_a_probes_own_line(build: Callable[[str], Path]) -> None:
    prog = build("stamps")
    r = cli("trace", "-T", "--no-optimize", "-c", f"{prog} 3 100000",
            'p work i=%di:s64 "work(%d)", i')  # fmt: skip
    assert r.returncode == 0, r.stderr
    calls = program_calls(r.stdout)
    got = [line.split(" ", 1) for line in r.stdout.splitlines() if line.endswith(")")]
    assert [text for _, text in got] == ["work(0)", "work(1)", "work(2)"], r.stdout
    for i, (clock, _) in enumerate(got):
        before, after = calls[i]
        day = datetime.fromtimestamp(before // 10**9).strftime("%Y-%m-%d")
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


# -- -p A,B: several processes in one command ------------------------------------------------------


class Gated:
    """A program started by ``sh -c 'read x; exec PROG ARGS'``: attached to while the shell
    waits, then let go (``go``), so that the probes, pending on PROG's file, are in place
    from its exec on and count every call it makes."""

    def __init__(self, popen: Callable[..., subprocess.Popen[bytes]], prog: Path, *args: object):
        self.prog = prog
        words = " ".join(str(a) for a in (prog, *args))
        self.proc = popen(["sh", "-c", f"read x; exec {words}"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE)  # fmt: skip
        self.pid = self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()

    def output(self) -> list[str]:
        """Its lines, once it has ended (exit status 0)."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        assert self.proc.wait(timeout=120) == 0
        return out.decode().splitlines()


def run_gated(
    popen, tmp_path: Path, backend: str, args: list[object], *gated: Gated
) -> tuple[str, str]:
    """``kprobes ARGS`` on the gated programs: once its probes are placed (ours say they are
    pending; the kernel's are enabled in the session's instance), each
    program is let go; (stdout, stderr) once the command has ended, by itself."""
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        tool = popen([support.KPROBES, args[0], "--backend", backend, *args[1:]], stdout=o,
                     stderr=e, stdin=subprocess.DEVNULL)  # fmt: skip

    def placed() -> bool:
        assert tool.poll() is None, f"the command ended: {err.read_text()}"
        if backend == "uprobes":
            return support.armed(tool.pid)
        return "is pending" in err.read_text()

    support.wait_until(placed, 60, "the probes placed")
    for one in gated:
        one.go()
    assert tool.wait(timeout=120) == 0, err.read_text()
    return out.read_text(), err.read_text()


@pytest.fixture
def ticker(build: Callable[[str], Path]) -> Path:
    return build("ticker")


@pytest.fixture
def stamps(build: Callable[[str], Path]) -> Path:
    return build("stamps")


@pytest.mark.parametrize("backend", BACKENDS)
def test_count_sums_over_the_processes_each_counted_whole(
    popen, tmp_path, ticker, backend: str
) -> None:
    a, b = Gated(popen, ticker, 30, 5000), Gated(popen, ticker, 45, 5000)
    out, _ = run_gated(popen, tmp_path, backend, ["count", "-p", f"{a.pid},{b.pid}",
                                                  "--pending", f"{ticker}:work"], a, b)  # fmt: skip
    made = sum(line.startswith("tick ") for line in a.output() + b.output())
    assert made == 75
    assert out.splitlines()[1:] == [f"{f'{ticker}:work':<36} {made:>8}"], out


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_event_carries_its_process_and_one_ending_ends_none_other(
    popen, tmp_path, ticker, stamps, backend: str
) -> None:
    # -p given twice; the ticker, the first, ends long before the other: the session goes on.
    a, b = Gated(popen, ticker, 5, 1000), Gated(popen, stamps, 60, 20000)
    out, _ = run_gated(popen, tmp_path, backend, ["trace", "--json", "-p", a.pid, "-p", b.pid,
                                                  "--pending", f"{ticker}:work i=%di:s64",
                                                  f"{stamps}:work i=%di:s64"], a, b)  # fmt: skip
    seen: dict[int, list[int]] = {a.pid: [], b.pid: []}
    for line in out.splitlines():
        event = json.loads(line)
        seen[event["pid"]].append(event["args"]["i"])
        if backend == "ptrace":  # (the kernel's name of a task that exec'd is its own matter)
            assert event["comm"] == {a.pid: "ticker", b.pid: "stamps"}[event["pid"]], event
    # Each program's calls, as it says it made them, every one and in order.
    assert seen[a.pid] == [int(line.split()[1]) for line in a.output() if line[:4] == "tick"]
    assert seen[b.pid] == [int(line.split()[1]) for line in b.output() if line[:4] == "call"]
    assert (len(seen[a.pid]), len(seen[b.pid])) == (5, 60)


def started_tickers(
    popen, ticker: Path, tmp_path: Path
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """Two tickers that run for a minute, libc mapped, each writing to its own file."""
    started = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.out"
        with open(path, "wb") as out:
            started.append((popen([ticker, 3000, 20000], stdout=out), path))
    for _, path in started:
        support.wait_for_lines(path, 2, 10)
    return started


@pytest.mark.parametrize(
    ("backend", "ending"),
    [("ptrace", "-d"), ("ptrace", "SIGINT"), pytest.param("uprobes", "-d", marks=NEEDS_UPROBES)],
)
def test_every_process_is_let_go_untouched(
    popen, tmp_path, ticker, backend: str, ending: str
) -> None:
    (a, a_out), (b, b_out) = started_tickers(popen, ticker, tmp_path)
    args = ["trace", "--backend", backend, "-p", f"{a.pid},{b.pid}", "work", "r work"]
    if ending == "-d":
        r = cli(*args, "-d", "1")
        assert r.returncode == 0, r.stderr
        pids = {int(m.group(1)) for m in re.finditer(r"ticker-(\d+) ", r.stdout)}
        assert pids == {a.pid, b.pid}, r.stdout  # a second of each program's calls
    else:
        err = tmp_path / "err"
        with open(tmp_path / "out", "wb") as o, open(err, "wb") as e:
            tool = popen([support.KPROBES, *args], stdout=o, stderr=e)
        for pid in (a.pid, b.pid):  # a jump or an int3 on work in each
            addr = support.runtime_address(pid, ticker, "work")

            def placed(pid: int = pid, addr: int = addr) -> bool:
                assert tool.poll() is None, err.read_text()
                return support.raw_read(pid, addr, 1) in (b"\xcc", b"\xe9")

            support.wait_until(placed, 60, f"the probe on work in {pid}")
        tool.send_signal(signal.SIGINT)
        assert tool.wait(timeout=60) == 0, err.read_text()
    for prog, path in ((a, a_out), (b, b_out)):
        support.assert_untouched(prog.pid, ticker)
        lines = len(support.file_lines(path))
        support.wait_for_lines(path, lines + 2, 10)  # it goes on ticking
        assert prog.poll() is None


def test_a_second_processs_events_come_while_the_first_makes_none(
    popen, tmp_path, ticker
) -> None:
    # The first calls work() once and sleeps; the second's events, read from its own ring
    # while the first's loop waits, are the five -n asks for.
    quiet, busy = tmp_path / "quiet", tmp_path / "busy"
    with open(quiet, "wb") as q, open(busy, "wb") as b:
        first = popen([ticker, 2, 100_000_000], stdout=q)
        second = popen([ticker, 100_000, 10_000], stdout=b)
    support.wait_for_lines(quiet, 1, 10)
    support.wait_for_lines(busy, 1, 10)
    r = cli("trace", "-p", f"{first.pid},{second.pid}", "work", "-n", "5")
    assert r.returncode == 0, r.stderr
    pids = [int(m.group(1)) for m in re.finditer(r"ticker-(\d+) ", r.stdout)]
    assert pids == [second.pid] * 5, r.stdout


def test_follow_forks_follows_each_processs_tree(popen, build, tmp_path) -> None:
    tree = build("tree")
    trees = [popen([tree, n], stdin=subprocess.PIPE, stdout=subprocess.PIPE) for n in (3, 5)]
    for one in trees:
        assert one.stdout is not None and one.stdout.readline() == b"ready\n"
    pids = ",".join(str(one.pid) for one in trees)
    err = tmp_path / "err"
    with open(tmp_path / "out", "wb") as o, open(err, "wb") as e:
        tool = popen([support.KPROBES, "count", "--json", "-p", pids, "--follow-forks",
                      "work", "leaf"], stdout=o, stderr=e)  # fmt: skip
    for one in trees:  # a jump or an int3 on work in each
        addr = support.runtime_address(one.pid, tree, "work")

        def placed(pid: int = one.pid, addr: int = addr) -> bool:
            assert tool.poll() is None, err.read_text()
            return support.raw_read(pid, addr, 1) in (b"\xcc", b"\xe9")

        support.wait_until(placed, 60, f"the probe on work in {one.pid}")
    for one in trees:
        one.communicate(b"go\n", timeout=120)
        assert one.returncode == 0
    assert tool.wait(timeout=120) == 0, err.read_text()
    rows = [json.loads(line) for line in (tmp_path / "out").read_text().splitlines()]
    # tree.c: work() 10N times in a tree, leaf() twice (its two children that exec it).
    assert {row["probe"]: row["hits"] for row in rows} == {"work": 10 * (3 + 5), "leaf": 4}


def test_an_error_in_the_second_process_leaves_the_first_untouched(
    popen, tmp_path, ticker
) -> None:
    (a, _), _ = started_tickers(popen, ticker, tmp_path)
    other = popen(["sleep", "60"])
    r = cli("trace", "-p", f"{a.pid},{other.pid}", "work")  # sleep has no work()
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        f"kprobes: no symbol 'work' in {Path('/proc', str(other.pid), 'exe').resolve()} "
        "(searched .dynsym)"
    ]
    support.assert_untouched(a.pid, ticker)
    r = cli("trace", "-p", f"{a.pid},2", "work")
    assert (r.returncode, r.stderr) == (
        1, "kprobes: process 2 (kthreadd) is a kernel thread: only user processes can be traced\n"
    )
    support.assert_untouched(a.pid, ticker)
    assert a.poll() is None


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["trace", "-p", "12,x", "work"], "argument -p/--pid: 'x' is not a process id"),
        (["trace", "-p", "12,,13", "work"], "argument -p/--pid: '' is not a process id"),
        (["run", "m.py", "-p", "12,13"],
         "argument -p/--pid: one process only (several: trace, count, ...)"),
    ],
)
def test_p_takes_process_ids(args: list[str], error: str) -> None:
    r = cli(*args)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == f"kprobes {args[0]}: error: {error}"
