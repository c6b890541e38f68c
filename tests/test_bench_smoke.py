"""Smoke tests of the benchmark harness (``python -m bench``), which the suite does not run whole,
and of ``python -m bench.decode --quick``.

The cheap peers run in ``--quick`` mode on a small N and must report exactly N hits in both
placements; the kernel's uprobes must also leave ``uprobe_events`` and the tracefs instances as
they found them. GDB, python-ptrace and most of our own tiers are left to ``make bench``: too
slow here, and ours measures an engine the rest of the suite tests for correctness. The
exceptions are the document's §6 rows (k, j, r, kr, jr) and the optimized probes' rows, whose
hit checking lives in the harness itself: two probes on one function must both count every
call, the handlers must see the arguments and return values the target computes, and every
record must be delivered or counted as dropped.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.build import compile_c
from bench.elf import find_site
from bench.measure import Cell, RowResult, Sample
from bench.peer import Row
from bench.peer_optimized import FLOORS, OURS, STACK_ROWS
from bench.report import NOTATION, notation_table, notation_words
from bench.report_optimized import GOALS, optimized_table

ROOT = Path(__file__).resolve().parent.parent
TRACEFS = Path("/sys/kernel/tracing")
CALLS = 300


def run_bench(only: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """The JSON document and the Markdown report of one quick run."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench", "--quick", "--only", only, "--calls", str(CALLS)]
    result = subprocess.run(
        [*argv, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(out.read_text())
    return document, result.stdout


def assert_every_hit_counted(document: dict[str, Any], keys: set[str]) -> None:
    rows = {row["key"]: row for row in document["rows"]}
    assert set(rows) == keys
    for key, row in rows.items():
        for placement, cell in row["cells"].items():
            where = f"{key} {placement}"
            assert cell["error"] is None, f"{where}: {cell['error']}"
            assert cell["hits"] == [CALLS], where
            assert cell["count_ok"], where
            assert cell["overhead_ns"] > 0, where


def test_sites_are_the_instructions_the_tiers_need() -> None:
    """The ELF arithmetic lands on the intended first bytes (push, lea, syscall at +5)."""
    target = compile_c("target")
    data = target.read_bytes()
    expected = {
        ("work_push", 0): b"\x55",
        ("work_lea", 0): b"\x48\x8d",
        ("work_sys", 5): b"\x0f\x05",
    }
    for (func, offset), prefix in expected.items():
        site = find_site(target, func, offset)
        assert data[site.file_offset :].startswith(prefix), func
    nm = subprocess.run(["nm", str(target)], capture_output=True, text=True, check=True).stdout
    symbols = {
        line.split()[2]: int(line.split()[0], 16)
        for line in nm.splitlines()
        if len(line.split()) == 3
    }
    assert find_site(target, "work_push").vaddr == symbols["work_push"]


@pytest.mark.ptrace
def test_floor_counts_every_hit(tmp_path: Path) -> None:
    document, _ = run_bench("floor", tmp_path)
    assert_every_hit_counted(document, {"floor-one", "floor-two"})


@pytest.mark.ptrace
def test_push_rows_with_and_without_pinning_count_every_hit(tmp_path: Path) -> None:
    document, _ = run_bench("kprobes-push,kprobes-push-nopin", tmp_path)
    assert_every_hit_counted(document, {"kprobes-push", "kprobes-push-nopin"})


@pytest.mark.ptrace
def test_placement_bench_checks_its_hits() -> None:
    """``python -m bench.placement``: every setup of the one-thread and the four-thread
    programs, one run each; the run itself fails if a hit count is wrong."""
    argv = [sys.executable, "-m", "bench.placement", "--runs", "1", "--only", "one,four"]
    setups = "pinned,split,unpinned-off,unpinned,colocate,follow,spin"
    result = subprocess.run(
        [*argv, "--setups", setups], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and rows[1].startswith("| 1 thread") and rows[2].startswith("| 4 ")
    assert all(row.count(" µs (") + row.count(" ns (") == 8 for row in rows[1:])


@pytest.mark.ptrace
def test_signals_bench_checks_its_runs() -> None:
    """``python -m bench.signals`` with no timer and a slow one: every probed run ends (its
    hits and output are checked by the run itself), and each row says so."""
    argv = [sys.executable, "-m", "bench.signals", "--calls", "200", "--periods", "0,2000"]
    result = subprocess.run(
        [*argv, "--cap", "120"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["none", "2000"], result.stdout
    assert not any(">" in row for row in rows), result.stdout


@pytest.mark.tracefs
def test_uprobes_count_every_hit_and_clean_up(tmp_path: Path) -> None:
    # Only the benchmark's own events and instances are checked: other tools (or another test
    # run) may add and remove theirs at the same time.
    document, _ = run_bench("uprobes", tmp_path)
    rows = {row["key"]: row for row in document["rows"]}
    nest = {key: rows.pop(key) for key in ("uprobes-r-nest10", "uprobes-r-nest100")}
    assert_every_hit_counted(
        {"rows": list(rows.values())},
        {"uprobes-push", "uprobes-push-4t", "uprobes-lea", "uprobes-r-push", "uprobes-kr-push"},
    )
    # The nest rows: every return of work_nest10's 10 frames; of work_nest100's 100, the
    # kernel's uretprobes keep the 64 outermost (MAX_URETPROBE_DEPTH): a count the report marks.
    for key, returns, ok in (("uprobes-r-nest10", 10, True), ("uprobes-r-nest100", 64, False)):
        for placement, cell in nest[key]["cells"].items():
            assert cell["error"] is None, f"{key} {placement}: {cell['error']}"
            assert cell["hits"] == [CALLS * returns], (key, placement)
            assert cell["count_ok"] is ok, (key, placement)
    assert_no_uprobes_left()


@pytest.mark.ptrace
def test_our_nest_rows_count_every_return(tmp_path: Path) -> None:
    """work_nest10 and work_nest100 under our optimized return probe: N x depth returns."""
    document, _ = run_bench("optimized-ret-nest10,optimized-ret-nest100", tmp_path)
    rows = {row["key"]: row for row in document["rows"]}
    for key, depth in (("optimized-ret-nest10", 10), ("optimized-ret-nest100", 100)):
        for placement, cell in rows[key]["cells"].items():
            assert cell["error"] is None, f"{key} {placement}: {cell['error']}"
            assert cell["hits"] == [CALLS * depth] and cell["count_ok"], (key, placement)


def assert_no_uprobes_left() -> None:
    assert "kpbench" not in (TRACEFS / "uprobe_events").read_text()
    assert not [p.name for p in (TRACEFS / "instances").iterdir() if "kpbench" in p.name]


@pytest.mark.ptrace
@pytest.mark.tracefs
def test_section6_rows_count_every_hit_in_as_many_stops_as_designed(tmp_path: Path) -> None:
    """k, j, r, kr, jr of ours and the kernel's k, r, kr: every call counted by every probe."""
    keys = {n.ours for n in NOTATION} | {n.kernel for n in NOTATION if n.kernel is not None}
    document, report = run_bench(",".join(sorted(keys)), tmp_path)
    assert_every_hit_counted(document, keys)
    assert_no_uprobes_left()
    rows = {row["key"]: row for row in document["rows"]}
    for n in NOTATION:
        for placement, cell in rows[n.ours]["cells"].items():
            # Start-up adds a handful of stops to the whole run, not one per call.
            assert round(int(cell["info"]["stops"]) / CALLS) == n.stops, (n.symbol, placement)
    assert "The document's §6 notation" in report
    assert "r - k =" in report


@pytest.mark.ptrace
@pytest.mark.tracefs
@pytest.mark.deadline(900)  # a hang detector: three times the default
def test_optimized_rows_count_every_hit_and_judge_the_goals(tmp_path: Path) -> None:
    """Our optimized count, record and CLI trace rows and the C detour floors, one and four
    threads, beside the kernel's uprobe: every hit counted, every record delivered (a quick
    run fits the ring), and the report's section judges each goal."""
    keys = {key for key, *_ in OURS} | {key for key, *_ in FLOORS}
    keys |= {key for key, *_ in STACK_ROWS}  # issue 23: stacks walked in the program
    uprobes = {"uprobes-push", "uprobes-push-4t"}
    document, report = run_bench(",".join(sorted(keys | uprobes)), tmp_path)
    rows = {row["key"]: row for row in document["rows"]}
    assert set(rows) == keys | uprobes
    assert_no_uprobes_left()
    for key, row in rows.items():
        for placement, cell in row["cells"].items():
            where = f"{key} {placement}"
            assert cell["error"] is None, f"{where}: {cell['error']}"
            assert cell["hits"] == [CALLS], where
            assert cell["count_ok"], where
            assert cell["overhead_ns"] is not None, where  # a count may measure as 0 here
            if "dropped" in cell["info"]:
                assert cell["info"]["dropped"] == "0", where
    assert {"work_push/pinned/4t", "work_push/unpinned/4t"} <= set(document["baselines"])
    assert {"work_deep10/pinned", "work_deep10/unpinned"} <= set(document["baselines"])
    section = report.split("Optimized probes (issue 12)", 1)[1]
    judged = {goal.ours for goal in GOALS}  # issue 12's rows (the return rows have no goal)
    for key, label, *_ in (*OURS, *STACK_ROWS):
        if key not in judged:
            continue
        line = next(line for line in section.splitlines() if line.startswith(f"| {label} | "))
        assert line.count("**met**") + line.count("**missed**") == 2, (key, line)


@pytest.mark.tracefs
def test_decode_bench_checks_its_events_and_cleans_up() -> None:
    """``python -m bench.decode --quick``: a few thousand uprobe events decoded both ways; the
    run itself fails if either path's events differ from what the program passed."""
    argv = [sys.executable, "-m", "bench.decode", "--quick"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| **ours**: `trace_pipe_raw` pages → `Event` |" in result.stdout
    assert "| peer: `trace_pipe` text → `Event` |" in result.stdout
    group = re.search(r"`p:(kprobes_\d+)/", result.stdout)
    assert group is not None, result.stdout
    assert not (TRACEFS / "events" / group.group(1)).exists()
    assert group.group(1) not in (TRACEFS / "uprobe_events").read_text()
    assert_no_uprobes_left()


def fake_row(key: str, overhead_ns: float, *, hits: int = CALLS, ours: bool = True) -> RowResult:
    row = Row(peer="fake", key=key, label=key, func="work_push", ours=ours)
    cells = {
        p: Cell(
            placement=p,
            calls=CALLS,
            samples=[Sample(overhead_ns + 2.0, hits, {"stops": str(2 * CALLS)})],
            baseline_ns=2.0,
        )
        for p in ("pinned", "unpinned")
    }
    return RowResult(row=row, runs=1, calls=CALLS, cells=cells)


def test_section6_words_judge_r_minus_k_against_one_stop() -> None:
    met = [fake_row("kprobes-push", 7_000), fake_row("kprobes-r-push", 13_900)]
    missed = [fake_row("kprobes-push", 7_000), fake_row("kprobes-r-push", 14_100)]
    assert "r - k = 6.9 µs = 0.99 stops: **met**" in (notation_words(met) or "")
    assert "r - k = 7.1 µs = 1.01 stops: **missed**" in (notation_words(missed) or "")


def test_section6_table_shows_missing_and_miscounted_rows_as_such() -> None:
    results = [
        fake_row("kprobes-push", 7_000),
        fake_row("kprobes-r-push", 14_000, hits=CALLS - 1),  # a return went uncounted
        fake_row("uprobes-push", 500, ours=False),
    ]
    table = notation_table(results) or ""
    lines = {line.split(" | ")[0].strip("| *"): line for line in table.splitlines()[2:]}
    assert "| 7 µs |" in lines["k"] and "| 0.5 µs |" in lines["k"]
    assert "| 2 / 2.00 | ✗ (see above) | not run |" in lines["r"]
    assert "not run" in lines["j"] and "none (no jprobes since 4.15)" in lines["j"]
    assert "1.40 µs (2.46x k)" in lines["jr"]  # the document's i386 jr
    assert notation_words(results) is None  # no valid r: no verdict


def test_optimized_goals_compare_like_with_like() -> None:
    """A 4-thread row is judged against the 4-thread uprobe, and a missing peer judges nothing."""
    results = [
        fake_row("optimized-count", 1.0),
        fake_row("optimized-record-4t", 200),
        fake_row("uprobes-push", 1_000, ours=False),
        fake_row("uprobes-push-4t", 700, ours=False),
        fake_row("detour-floor-record-4t", 10, ours=False),
    ]
    lines = {
        line.split(" | ")[0].strip("| "): line
        for line in (optimized_table(results) or "").splitlines()[2:]
    }
    assert "0.001x / 0.001x" in lines["optimized-count"]
    assert "| — / — |" in lines["optimized-count"]  # no count floor in this run
    assert "**met** / **met**" in lines["optimized-count"]
    assert "0.29x / 0.29x" in lines["optimized-record-4t"]  # 200 / 700, not 200 / 1000
    assert "20x / 20x" in lines["optimized-record-4t"]
    assert "**missed** / **missed**" in lines["optimized-record-4t"]
    assert optimized_table([fake_row("uprobes-push", 1_000, ours=False)]) is None


def record_rate(*flags: str) -> str:
    """``python -m bench.record_rate`` on a small N: each row checks its own events (every
    hit delivered or counted lost), or the run fails."""
    argv = [sys.executable, "-m", "bench.record_rate", "--runs", "1", "--calls", "3000"]
    result = subprocess.run([*argv, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_record_rate_rows_deliver_every_event() -> None:
    out = record_rate("--no-perf")
    rows = [line.split("|") for line in out.splitlines()[3:]]
    assert len(rows) == 6, out
    assert all(row[5].strip() == "3,000" and row[6].strip() == "0" for row in rows), out


@pytest.mark.tracefs
def test_record_rate_perf_rows_clean_up() -> None:
    """The perf rows, where perf is installed: perf's uprobe is gone afterwards."""
    if subprocess.run(["sh", "-c", "command -v perf"], capture_output=True).returncode:
        pytest.skip("no perf: scripts/ensure-system-deps installs linux-perf")
    out = record_rate("--only", "perf-record,perf-script")
    assert "perf record (kernel uprobe)" in out and "perf script" in out
    assert "kpbench" not in (TRACEFS / "uprobe_events").read_text()
    assert_no_uprobes_left()
