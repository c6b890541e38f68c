"""``python -m bench.placement``: the trap tier's cost by where the tool and the program run.

    python -m bench.placement [--runs R] [--only SCENARIO,...] [--setups SETUP,...]

For each scenario (a program shape) and each setup (where the tool and the program may run,
and whether ``pin_hot_threads`` is on), R runs of the bench target under
``bench.peer_kprobes``, the setups alternating run by run so that a drift of the machine
touches them alike. Reports ns per call (the target's own figure: for the threaded scenarios,
wall time over all calls, so a program squeezed onto one CPU shows) as median (min to max),
and the same program with no tool. Every run's hit count is checked.

Setups:

- ``pinned``: tool and program on CPU 0 (``taskset -c 0``): the floor.
- ``split``: the tool on CPU 0, the program on CPU 1: every stop and resume wakes the other CPU.
- ``split-busy``: the same with both CPUs kept out of idle by a busy loop of idle priority
  (``SCHED_IDLE``) on each, started by the tool in its own session (its autogroup: from
  another session it would compete at normal weight): what waking a CPU out of idle costs.
- ``unpinned-off``: no affinity set, ``pin_hot_threads=False``: what a user got before.
- ``unpinned``: no affinity set, the default (``pin_hot_threads=True``).

And the alternatives that were measured and rejected (docs/decisions.md), all unpinned with
``pin_hot_threads`` off:

- ``colocate``: ``proc.colocate()``, the tool and every thread of the program on one CPU.
- ``follow``: the tool moves itself to the CPU of the thread that stopped (read from
  /proc/PID/task/TID/stat every 32nd stop of a thread), the program is left alone.
- ``spin``: the tool polls ``waitpid(WNOHANG)`` for up to 50 µs before it blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.build import build_all
from bench.measure import PIN, parse_timing, run_command, timeout_for
from bench.peer import RunError, hits_from_fields
from kprobes.linux import procfs


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    label: str
    probe: str  # the probed function
    args: tuple[str, ...]  # the target's arguments: NAME N [threads=T spin=S wall]
    hits: bool = True  # every call hits the probe (else none does)

    @property
    def calls(self) -> int:
        return int(self.args[1])


SCENARIOS = (
    Scenario("one", "1 thread, a hit per call", "work_push", ("work_push", "10000")),
    Scenario(
        "four",
        "4 threads, a hit per call",
        "work_push",
        ("work_push", "20000", "threads=4", "wall"),
    ),
    Scenario(
        "four-work",
        "4 threads, a hit per ~110 µs of work",
        "work_push",
        ("work_push", "4000", "threads=4", "spin=400000", "wall"),
    ),
    Scenario(
        "four-unhit",
        "4 threads, ~11 µs of work per call, probe never hit",
        "work_boost",
        ("work_push", "40000", "threads=4", "spin=40000", "wall"),
        hits=False,
    ),
)
SETUPS = {  # key: (label, prefix, peer_kprobes variant)
    "pinned": ("tool and program on CPU 0", PIN, "pre"),
    "split": ("tool on CPU 0, program on CPU 1", (), "split"),
    "split-busy": ("the same, no CPU idle", (), "split-busy"),
    "unpinned-off": ("unpinned, pin_hot_threads off (before)", (), "nopin"),
    "unpinned": ("unpinned, default (pin_hot_threads on)", (), "pre"),
    "colocate": ("unpinned, colocate()", (), "colocate"),
    "follow": ("unpinned, the tool follows the thread", (), "follow"),
    "spin": ("unpinned, 50 µs spin before waiting", (), "spin"),
}
DEFAULT_SETUPS = ("pinned", "split", "unpinned-off", "unpinned")
FOLLOW_EVERY = 32  # the follow variant's stops of a thread between two looks at its CPU
SPIN_NS = 50_000


def waiting_variant(variant: str) -> Callable[[int, int], tuple[int, int]] | None:
    """A stand-in for ``os.waitpid`` that the tracer's loop picks up (it reads ``os.waitpid``
    when ``run()`` starts), for the rejected variants; None for the others."""
    waitpid = os.waitpid
    if variant == "spin":

        def spinning(pid: int, options: int) -> tuple[int, int]:
            end = time.monotonic_ns() + SPIN_NS
            while time.monotonic_ns() < end:
                got = waitpid(pid, options | os.WNOHANG)
                if got[0]:
                    return got
            return waitpid(pid, options)

        return spinning
    if variant == "follow":
        stops: dict[int, int] = {}
        where = [-1]

        def following(pid: int, options: int) -> tuple[int, int]:
            got = waitpid(pid, options)
            tid = got[0]
            stops[tid] = stops.get(tid, 0) + 1
            if tid > 0 and stops[tid] % FOLLOW_EVERY == 0:
                cpu = procfs.task_cpu(tid, tid)  # /proc/TID/task/TID: any thread
                if cpu >= 0 and cpu != where[0]:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(0, {cpu})
                        where[0] = cpu
            return got

        return following
    return None


@contextlib.contextmanager
def busy_cpus(cpus: list[int]) -> Iterator[None]:
    """A ``SCHED_IDLE`` busy loop on each CPU while the block runs: no CPU ever goes idle,
    and anything else that wants one of them gets it at once."""
    loop = (
        "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"
    )
    spinners = [subprocess.Popen([sys.executable, "-c", loop, str(cpu)]) for cpu in cpus]
    if spinners:
        time.sleep(0.2)  # their start-up is not part of what is measured
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def once(target: str, scenario: Scenario, setup: str | None) -> float:
    """ns per call of one run (``setup`` None: the program alone)."""
    program = [target, *scenario.args]
    if setup is None:
        argv = program
    else:
        _, prefix, variant = SETUPS[setup]
        tool = [sys.executable, "-m", "bench.peer_kprobes", scenario.probe, "0", variant]
        argv = [*prefix, *tool, *program]
    stdout = run_command(argv, timeout_for(scenario.calls * 10))
    ns = parse_timing(stdout, scenario.calls)
    if setup is not None:
        hits = hits_from_fields(stdout).hits
        expected = scenario.calls if scenario.hits else 0
        if hits != expected:
            raise RunError(f"{scenario.key} {setup}: {hits} hits, not {expected}")
    return ns


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--only", default="", help="scenarios: " + ",".join(s.key for s in SCENARIOS)
    )
    parser.add_argument(
        "--setups", default=",".join(DEFAULT_SETUPS), help="of: " + ",".join(SETUPS)
    )
    args = parser.parse_args(argv)
    wanted = {w for w in args.only.split(",") if w}
    scenarios = [s for s in SCENARIOS if not wanted or s.key in wanted]
    setups = [s for s in args.setups.split(",") if s]
    unknown = {*setups} - set(SETUPS) | wanted - {s.key for s in SCENARIOS}
    if unknown:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    if len(os.sched_getaffinity(0)) < 2 and {"split", "split-busy"} & {*setups}:
        parser.error("the split setups need two CPUs")
    with contextlib.suppress(OSError):  # unpinned must mean free, even under taskset
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    target = str(build_all().target)
    columns: list[str | None] = [None, *setups]
    rows = []
    for scenario in scenarios:
        samples: dict[str | None, list[float]] = {c: [] for c in columns}
        for i in range(args.runs):
            for setup in columns:
                ns = once(target, scenario, setup)
                samples[setup].append(ns)
                print(
                    f"{scenario.key} {setup or 'no tool'} run {i + 1}: {ns:.1f} ns/call",
                    file=sys.stderr,
                    flush=True,
                )
        rows.append((scenario, samples))
    print(render(rows, columns, args.runs))
    return 0


def _cell(values: list[float]) -> str:
    """Median (min to max), in µs from 1 µs up, else in ns."""
    scale, unit = (1000.0, "µs") if statistics.median(values) >= 1000 else (1.0, "ns")
    low, mid, high = (
        f"{v / scale:.3g}" for v in (min(values), statistics.median(values), max(values))
    )
    return f"{mid} {unit} ({low} to {high})"


def render(
    rows: list[tuple[Scenario, dict[str | None, list[float]]]],
    columns: list[str | None],
    runs: int,
) -> str:
    head = ["program", *(SETUPS[c][0] if c else "no tool" for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, samples in rows:
        cells = [_cell(samples[c]) for c in columns]
        lines.append(f"| {scenario.label} | " + " | ".join(cells) + " |")
    note = (
        f"ns per call of the target, median (min to max) of {runs} runs; the setups "
        "alternate run by run. A hit per call: the figure is the hit's cost plus ~1.5 ns."
    )
    return "\n".join([*lines, "", note])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
