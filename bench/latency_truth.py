"""``python -m bench.latency_truth``: what ``kprobes latency`` reports for a function of known
duration, against the duration the program itself measured (issue 20, item 6).

    python -m bench.latency_truth [--ns 200] [--calls 200000] [--runs 3] [--no-optimize]

bench/latency_truth.c calls ``spin(NS)`` N times (a busy wait on the TSC) and prints the mean
duration of a call as it saw it (``rdtsc`` around each call). Each run prints that truth
unprobed and probed (the probed one holds all our entry and return cost), the average
``kprobes latency -c`` reported, and its difference from the unprobed truth. Timing
figures: run it on a quiet machine, pinned (``taskset -c 0``) or not, and read the spread
of the runs (a preemption inside a call weighs on every mean).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _field(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise SystemExit(f"no {pattern!r} in {text!r}")
    return float(m.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency_truth")
    parser.add_argument("--ns", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-optimize", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "latency_truth"
        subprocess.run(
            ["gcc", "-O1", "-o", exe, HERE / "latency_truth.c"], check=True, capture_output=True
        )
        for _ in range(args.runs):
            alone = subprocess.run(
                [exe, str(args.ns), str(args.calls)], capture_output=True, text=True, check=True
            )
            unprobed = _field(r"truth_ns=([\d.]+)", alone.stdout)
            flags = ["--no-optimize"] if args.no_optimize else []
            command = f"{exe} {args.ns} {args.calls}"
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kprobes.cli.main",
                    "latency",
                    *flags,
                    "-c",
                    command,
                    "spin",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            truth = _field(r"truth_ns=([\d.]+)", r.stdout)
            avg = int(_field(r"avg = (\d+) nsecs", r.stdout))
            count = int(_field(r"count: (\d+)", r.stdout))
            print(
                f"spin({args.ns}): unprobed {unprobed:.1f} ns a call, probed {truth:.1f} ns "
                f"(as the program saw each call, rdtsc around it); latency avg {avg} ns: "
                f"{avg - unprobed:+.1f} ns ({100 * (avg - unprobed) / unprobed:+.1f}%) from the "
                f"unprobed, {count} calls",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
