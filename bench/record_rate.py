"""Events per second through ``trace``, ``record`` and ``script``, beside ``perf record`` and
``perf script`` on the kernel's uprobe of the same site (issue 21, item 5).

    python -m bench.record_rate [--calls N] [--runs R] [--only ROW,...] [--no-perf]

The program is ``bench/bin/target work_push N`` (a loop calling a 5-instruction function,
jump-optimized by our own backend: each call writes a record into the ring), probed with
``p work_push i=%di``. Rows, each the median of ``R`` runs:

- ``trace → /dev/null``, ``trace → file``: ``kprobes trace``, formatted as the records come;
- ``record``: ``kprobes record -o FILE``, the raw records to a file;
- ``script → /dev/null``, ``script → file``, ``script --json → file``: ``kprobes script``
  of the file ``record`` wrote (its events formatted, the program long gone);
- ``perf record``: ``perf record -e kpbench:work`` on the kernel's uprobe of the same
  function with the same argument (``perf probe -x TARGET 'kpbench:work=work_push
  i=%di:u64'``), and ``perf script → /dev/null`` of its file. Skipped without ``perf``
  (``scripts/ensure-system-deps`` installs Debian's ``linux-perf``) or with ``--no-perf``.
  The uprobe is in the kernel's global ``uprobe_events``: run this under
  ``flock /tmp/kprobes-tracefs.lock`` where other tools use tracefs too.

"wall" is the command's time from its start to its exit (interpreter start-up, placing the
probe, the program's run and the formatting all in it, as a user waits for them); "run" is
the run proper: for ``trace`` and ``record`` the summary's seconds (the probes live to the
end of the reading), for ``script`` the wall time less that of ``script`` on a file of one
event (its start-up), for perf the wall time. Then the events delivered and those lost
(ring or buffer full), and the file's size for the recorders.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.build import compile_c

SUMMARY = re.compile(r"(\d+) events, (\d+) hits, (\d+) missed, (\d+) dropped in ([\d.]+) s")
SCRIPT_SUMMARY = re.compile(r"(\d+) events printed")
PERF_SAMPLES = re.compile(r"\((\d+) samples\)")
PERF_LOST = re.compile(r"LOST_SAMPLES events:\s+(\d+)")
ROWS = (
    "trace-null",
    "trace-file",
    "record",
    "script-null",
    "script-file",
    "script-json",
    "perf-record",
    "perf-script",
)
LABELS = {
    "trace-null": "kprobes trace → /dev/null",
    "trace-file": "kprobes trace → file",
    "record": "kprobes record",
    "script-null": "kprobes script → /dev/null",
    "script-file": "kprobes script → file",
    "script-json": "kprobes script --json → file",
    "perf-record": "perf record (kernel uprobe)",
    "perf-script": "perf script → /dev/null",
}
PROBE = "p work_push i=%di"
PERF_EVENT = "kpbench:work"


@dataclass(frozen=True, slots=True)
class Run:
    wall: float
    events: int
    lost: int
    size: int = 0  # bytes of the file written (recorders)
    run: float = 0.0  # seconds of the run proper (see the module docstring); 0: the wall


def _kprobes(*argv: str) -> list[str]:
    """The command line run in a child interpreter (start-up included), as trace_rate does."""
    return [sys.executable, "-m", "bench.trace_rate", "--child", *argv]


def _timed(cmd: list[str], out: str) -> tuple[float, str]:
    with open(out, "w") as f:
        started = time.monotonic()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True, check=False)
        wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return wall, done.stderr


def _search(pattern: re.Pattern[str], text: str) -> re.Match[str]:
    m = pattern.search(text)
    if m is None:
        raise RuntimeError(f"no {pattern.pattern!r} in: {text[-2000:]}")
    return m


class Bench:
    """The rows of one target and call count, in a scratch directory of files."""

    def __init__(self, target: Path, calls: int, tmp: str) -> None:
        self.target, self.calls, self.tmp = target, calls, tmp
        self.program = f"{target} work_push {calls}"
        self.data = os.path.join(tmp, "kprobes.data")
        self.perf_data = os.path.join(tmp, "perf.data")
        self.out = os.path.join(tmp, "out.txt")
        self._script_start: float | None = None

    def _kprobes_summary(self, stderr: str) -> tuple[int, int, float]:
        m = _search(SUMMARY, stderr)
        events, hits, _, dropped = map(int, m.groups()[:4])
        if hits != self.calls or events + dropped != hits:
            raise RuntimeError(f"{events} events + {dropped} dropped of {hits} hits")
        return events, dropped, float(m.group(5))

    def trace(self, sink: str) -> Run:
        out = os.devnull if sink == "null" else self.out
        wall, err = _timed(_kprobes("trace", "-c", self.program, PROBE), out)
        events, dropped, run = self._kprobes_summary(err)
        return Run(wall, events, dropped, run=run)

    def record(self) -> Run:
        wall, err = _timed(_kprobes("record", "-o", self.data, "-c", self.program, PROBE), self.out)
        events, dropped, run = self._kprobes_summary(err)
        return Run(wall, events, dropped, os.path.getsize(self.data), run)

    def script(self, sink: str, *flags: str) -> Run:
        if not os.path.exists(self.data):
            self.record()
        if self._script_start is None:  # script of a file of one event: its start-up
            tiny = os.path.join(self.tmp, "tiny.data")
            program = f"{self.target} work_push 1"
            _timed(_kprobes("record", "-o", tiny, "-c", program, PROBE), self.out)
            self._script_start = statistics.median(
                _timed(_kprobes("script", tiny), os.devnull)[0] for _ in range(3)
            )
        out = os.devnull if sink == "null" else self.out
        wall, err = _timed(_kprobes("script", *flags, self.data), out)
        run = max(wall - self._script_start, 1e-3)
        return Run(wall, int(_search(SCRIPT_SUMMARY, err).group(1)), 0, run=run)

    def perf_record(self) -> Run:
        subprocess.run(["perf", "probe", "-q", "-d", "kpbench:*"], capture_output=True)
        spec = f"{PERF_EVENT}=work_push i=%di:u64"
        subprocess.run(["perf", "probe", "-q", "-x", str(self.target), spec], check=True)
        try:
            cmd = ["perf", "record", "-e", PERF_EVENT, "-o", self.perf_data, "--"]
            wall, err = _timed([*cmd, str(self.target), "work_push", str(self.calls)], self.out)
        finally:
            subprocess.run(["perf", "probe", "-q", "-d", "kpbench:*"], capture_output=True)
        samples = int(_search(PERF_SAMPLES, err).group(1))
        stats = subprocess.run(
            ["perf", "report", "-i", self.perf_data, "--stats"], capture_output=True, text=True
        ).stdout
        lost = sum(int(n) for n in PERF_LOST.findall(stats))
        return Run(wall, samples, lost, os.path.getsize(self.perf_data))

    def perf_script(self) -> Run:
        if not os.path.exists(self.perf_data):
            self.perf_record()
        started = time.monotonic()
        done = subprocess.run(
            ["perf", "script", "-i", self.perf_data], capture_output=True, text=True, check=True
        )
        wall = time.monotonic() - started
        return Run(wall, done.stdout.count("\n"), 0)

    def rows(self) -> dict[str, Callable[[], Run]]:
        return {
            "trace-null": lambda: self.trace("null"),
            "trace-file": lambda: self.trace("file"),
            "record": self.record,
            "script-null": lambda: self.script("null"),
            "script-file": lambda: self.script("file"),
            "script-json": lambda: self.script("file", "--json"),
            "perf-record": self.perf_record,
            "perf-script": self.perf_script,
        }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.record_rate", description=__doc__)
    p.add_argument("--calls", type=int, default=2_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", default=",".join(ROWS))
    p.add_argument("--no-perf", action="store_true")
    args = p.parse_args()
    rows = args.only.split(",")
    if args.no_perf or shutil.which("perf") is None:
        rows = [r for r in rows if not r.startswith("perf")]
    target = compile_c("target")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.calls:,} calls of work_push, {args.runs} runs a row, median; load {load}")
    head = ("row", "wall s", "events/s, wall", "events/s, run", "events", "lost")
    print("| {:<30} | {:>7} | {:>14} | {:>13} | {:>10} | {:>8} | MB |".format(*head))
    print(f"|{'-' * 32}|{'-' * 9}|{'-' * 16}|{'-' * 15}|{'-' * 12}|{'-' * 10}|----|")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        bench = Bench(target, args.calls, tmp)
        make = bench.rows()
        for row in rows:
            runs = [make[row]() for _ in range(args.runs)]
            wall = statistics.median(r.wall for r in runs)
            rate = statistics.median(r.events / r.wall for r in runs)
            run_rate = statistics.median(r.events / (r.run or r.wall) for r in runs)
            events = statistics.median(r.events for r in runs)
            lost = statistics.median(r.lost for r in runs)
            size = max(r.size for r in runs) / 1e6
            mb = f"{size:.0f}" if size else ""
            print(
                f"| {LABELS[row]:<30} | {wall:7.2f} | {rate:14,.0f} | {run_rate:13,.0f} "
                f"| {events:10,.0f} "
                f"| {lost:8,.0f} | {mb} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
