"""Runs the cells: every row, pinned and unpinned, R times, each run checked.

A run is one process (the tool, which starts the target; or the target alone for the no-probe
baseline), in a session of its own so that a timeout or an interrupt can kill it together with
whatever it started. The target prints ``ns_per_call=<float> calls=<N>``; the run is accepted
only if ``calls`` is the N asked for. The tool's hit count is recorded per run: a count that is
not N marks the cell, it does not discard the run.

Pinned and unpinned runs alternate (pinned, unpinned, pinned, ...) so that a slow drift of the
machine touches both columns alike.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.peer import Peer, Row, RunError, target_argv

PLACEMENTS = ("pinned", "unpinned")
PIN = ("taskset", "-c", "0")
_TIMING = re.compile(r"^ns_per_call=([0-9.]+) calls=([0-9]+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Sample:
    ns_per_call: float
    hits: int
    info: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Cell:
    """One row in one placement: the runs made, and the baseline they are compared with."""

    placement: str
    calls: int
    samples: list[Sample] = field(default_factory=list)
    baseline_ns: float | None = None
    error: str | None = None
    hits_per_call: int = 1  # the site's calls in one call of the target's loop (nest rows)

    @property
    def expected_hits(self) -> int:
        return self.calls * self.hits_per_call

    @property
    def bad_counts(self) -> list[int]:
        return [s.hits for s in self.samples if s.hits != self.expected_hits]

    @property
    def with_ns(self) -> float | None:
        return statistics.median(s.ns_per_call for s in self.samples) if self.samples else None

    def overhead(self) -> tuple[float, float, float] | None:
        """(median, min, max) of ns per call with the probe, minus the baseline's median."""
        if not self.samples or self.baseline_ns is None:
            return None
        values = [s.ns_per_call - self.baseline_ns for s in self.samples]
        return statistics.median(values), min(values), max(values)

    @property
    def info(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for s in self.samples:
            merged.update(s.info)
        return merged


@dataclass(slots=True)
class RowResult:
    row: Row
    runs: int
    calls: int
    cells: dict[str, Cell]


def placement_prefix(placement: str) -> list[str]:
    return list(PIN) if placement == "pinned" else []


def run_command(argv: list[str], timeout: float) -> str:
    """Run ``argv`` to its end and return its stdout; RunError with the tool's last word if not."""
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:
        raise RunError(f"{argv[0]}: {e.strerror}") from e
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RunError(f"timed out after {timeout:.0f} s") from None
    except BaseException:
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        last = (err.strip() or out.strip() or f"exit status {proc.returncode}").splitlines()[-1]
        raise RunError(last)
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the process we started and everything in its session (its pgid is its pid)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def parse_timing(stdout: str, calls: int) -> float:
    m = _TIMING.search(stdout)
    if m is None:
        raise RunError("the target printed no ns_per_call= line")
    if int(m.group(2)) != calls:
        raise RunError(f"the target made {m.group(2)} calls, not {calls}")
    return float(m.group(1))


def timeout_for(calls: int) -> float:
    """Generous: ten times the slowest peer's expected time, never less than a minute."""
    return min(600.0, 60.0 + calls * 0.002)


class Baselines:
    """ns per call of each function with no probe, per placement and number of threads (a
    threaded run is timed in CPU time: bench/target.c); measured once, on demand."""

    def __init__(self, target: str, runs: int, calls: int) -> None:
        self.target = target
        self.runs = runs
        self.calls = calls
        self.samples: dict[tuple[str, str, int], list[float]] = {}

    def get(self, func: str, placement: str, threads: int = 1) -> float:
        key = (func, placement, threads)
        if key not in self.samples:
            command = target_argv(self.target, func, self.calls, threads)
            argv = [*placement_prefix(placement), *command]
            self.samples[key] = [
                parse_timing(run_command(argv, timeout_for(self.calls)), self.calls)
                for _ in range(self.runs)
            ]
        return statistics.median(self.samples[key])


def measure_row(
    peer: Peer,
    row: Row,
    runs: int,
    calls: int,
    baselines: Baselines,
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> RowResult:
    """Measure one row in both placements; failures end up in the cells, never raised."""
    cells = {p: Cell(placement=p, calls=calls, hits_per_call=row.hits_per_call) for p in PLACEMENTS}
    result = RowResult(row=row, runs=runs, calls=calls, cells=cells)
    try:
        for placement, cell in cells.items():
            cell.baseline_ns = baselines.get(row.func, placement, row.threads)
        with peer.session(row) as runner:
            for i in range(runs):
                for placement, cell in cells.items():
                    if cell.error is not None:
                        continue
                    try:
                        argv = [*placement_prefix(placement), *runner.argv(calls)]
                        stdout = run_command(argv, timeout_for(calls))
                        ns = parse_timing(stdout, calls)
                        outcome = runner.outcome(stdout)
                    except RunError as e:
                        cell.error = str(e)
                        continue
                    cell.samples.append(Sample(ns, outcome.hits, outcome.info))
                    progress(f"  {row.key} {placement} run {i + 1}/{runs}: {ns:.1f} ns/call")
    except Exception as e:  # the baseline, or the session's set-up or teardown, failed
        for cell in cells.values():
            if cell.error is None:
                cell.error = f"{type(e).__name__}: {e}"
    return result
