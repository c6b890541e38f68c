"""``python -m bench.counting``: what ``kprobes count`` on the kernel's uprobes costs the program.

``kprobes count --backend uprobes -x PROG FUNC`` (every process that runs PROG) has the kernel
count the hits (perf counters on the uprobe event, no record written: kprobes/linux/perf.py).
Its cost to the program should be the kernel's uprobe alone. Side by side, alternating, in one
run, each the program's own ns per call of the bench target (bench/target.c: the loop timed
from inside), the tool started first and ended with SIGINT once the program has run:

- ``none``: no probe;
- ``uprobe``: the kernel's uprobe enabled through tracefs in an instance nobody reads (the
  uprobes peer of ``python -m bench``);
- ``count -x``: counted in the kernel;
- ``count -c``: the command run by the tool, its hits told apart by events, each read and
  decoded to be counted (how every ``count`` on this backend worked before, and how
  ``-p``/``-c`` still do).

Each run checks the count the tool printed against the calls made.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.build import build_all
from bench.peer import Row
from bench.peer_uprobes import UprobesPeer, mount_tracefs

_TIMING = re.compile(r"^ns_per_call=([0-9.]+) calls=([0-9]+)$", re.MULTILINE)
KPROBES = [sys.executable, "-m", "kprobes.cli.main"]


def _ns(stdout: str) -> float:
    m = _TIMING.search(stdout)
    if m is None:
        raise RuntimeError(f"no timing line in {stdout[-500:]!r}")
    return float(m.group(1))


def _counted(stdout: str, func: str) -> int:
    for line in stdout.splitlines():
        if line.split()[:1] == [func]:
            return int(line.split()[1])
    raise RuntimeError(f"no count of {func} in {stdout[-500:]!r}")


def _wait_armed(pid: int, timeout: float = 60) -> None:
    """Until the tool's probe counts: its counters open, or its event enabled."""
    group = Path(f"/sys/kernel/tracing/instances/kprobes_{pid}/events/kprobes_{pid}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fds = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) == "anon_inode:[perf_event]" for fd in fds.iterdir()):
                return
            events = [e for e in group.iterdir() if e.is_dir()]
            if any((e / "enable").read_text().strip() == "1" for e in events):
                return
        time.sleep(0.05)
    raise RuntimeError("the tool did not place its probe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--func", default="work_lea", help="work_lea (stepped), work_push")
    args = parser.parse_args()
    if (why := mount_tracefs()) is not None:
        sys.exit(f"bench.counting: {why}")
    programs = build_all()
    target, func, calls = str(programs.target), args.func, args.calls

    def plain() -> float:
        return _ns(
            subprocess.run([target, func, str(calls)], capture_output=True, text=True).stdout
        )

    def uprobe() -> float:
        row = Row(peer="uprobes", key="count-uprobe", label="", func=func, variant="p")
        with UprobesPeer(programs).session(row) as runner:
            out = subprocess.run(runner.argv(calls), capture_output=True, text=True).stdout
            hits = runner.outcome(out).hits
        if hits != calls:
            raise RuntimeError(f"the raw uprobe counted {hits} of {calls} calls")
        return _ns(out)

    def tool(*extra: str) -> Callable[[], float]:
        def run() -> float:
            argv = [*KPROBES, "count", "--backend", "uprobes", *extra, "-x", target, func]
            with subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            ) as proc:
                try:
                    _wait_armed(proc.pid)
                    out = subprocess.run([target, func, str(calls)], capture_output=True, text=True)
                finally:
                    proc.send_signal(signal.SIGINT)
                    table, _ = proc.communicate(timeout=300)
            if (hits := _counted(table, func)) != calls:
                raise RuntimeError(f"{' '.join(extra) or 'count'}: {hits} of {calls} calls")
            return _ns(out.stdout)

        return run

    def command() -> float:
        argv = [*KPROBES, "count", "--backend", "uprobes", "-c", f"{target} {func} {calls}", func]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        if (hits := _counted(out, func)) != calls:
            raise RuntimeError(f"count -c: {hits} of {calls} calls")
        return _ns(out)

    cases: dict[str, Callable[[], float]] = {
        "none": plain,
        "uprobe": uprobe,
        "count -x": tool(),
        "count -c": command,
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, case in cases.items():
            samples[name].append(case())
    raw = statistics.median(samples["uprobe"])
    print(f"{func}, {calls:,} calls a run, {args.runs} runs each, the program's ns per call")
    for name, values in samples.items():
        values.sort()
        median = statistics.median(values)
        print(
            f"  {name:16} median {median:9.1f}  min {values[0]:9.1f}  max {values[-1]:9.1f}"
            f"  x uprobe {median / raw:5.2f}"
        )


if __name__ == "__main__":
    main()
