"""``python -m bench.tool_start``: how long the ``kprobes`` command takes to start and end.

Times, wall clock, median and range of ``--runs``: ``kprobes --help``, ``kprobes --version``,
``kprobes count --help``, and ``kprobes count -c /bin/true libc:malloc`` (the whole command:
start-up, spawn, one pending probe placed when libc comes, the run, the summary). Each runs
as a user would run it, a new interpreter each time, from the checkout first on
``PYTHONPATH`` (compare two checkouts by running this with each). The figure for ``--help``
is the tool's start-up alone: the interpreter's own (``python -c pass``) is printed beside it.
The last row is the tool's start-up as a user of ``-c`` waits for it: from the command line
given to the program's ``main`` running with its probe in (``count -c 'date +%s%N'
libc:malloc``: ``date`` prints the time it starts, after the loader mapped libc and the
tool placed the probe; the program's own start is in it, ~1 ms).
``--against CHECKOUT`` runs each case alternately with this checkout and another (the way
to compare two on a loaded machine). The package's bytecode is compiled first, as ``pip
install`` does (an environment with ``PYTHONDONTWRITEBYTECODE`` set would otherwise compile
every module on every start).
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

CASES = (
    ("python -c pass", [sys.executable, "-c", "pass"]),
    ("kprobes --help", [sys.executable, "-m", "kprobes.cli.main", "--help"]),
    ("kprobes --version", [sys.executable, "-m", "kprobes.cli.main", "--version"]),
    ("kprobes count --help", [sys.executable, "-m", "kprobes.cli.main", "count", "--help"]),
    (
        "kprobes count -c /bin/true libc:malloc",
        [sys.executable, "-m", "kprobes.cli.main", "count", "-c", "/bin/true", "libc:malloc"],
    ),
)


def once(argv: list[str], tree: str | None = None) -> float:
    start = time.perf_counter()
    before = cpu_of_children()
    subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, **where(tree)
    )
    CPU.append(cpu_of_children() - before)
    return time.perf_counter() - start


# The CPU time (user and system) of each ``once``, the last one last: steadier than the
# wall clock on a machine whose other guests take its CPUs now and then.
CPU: list[float] = []


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


STARTS = (
    "kprobes count -c 'date +%s%N' libc:malloc, to the program's main",
    [sys.executable, "-m", "kprobes.cli.main", "count", "-c", "date +%s%N", "libc:malloc"],
)


def to_start(argv: list[str], tree: str | None = None) -> float:
    """Seconds from starting ``argv`` to the time its program printed (its first line of
    digits on stdout)."""
    start = time.time_ns()
    out = subprocess.run(argv, capture_output=True, text=True, check=True, **where(tree)).stdout
    printed = next(int(line) for line in out.splitlines() if line.strip().isdigit())
    return (printed - start) / 1e9


def where(tree: str | None) -> dict[str, Any]:
    """How to run a command with the checkout ``tree`` imported (None: as this process):
    first on PYTHONPATH, and the current directory, which ``python -m`` puts before it."""
    if tree is None:
        return {}
    return {"cwd": tree, "env": {**os.environ, "PYTHONPATH": tree}}


def row(label: str, times: list[float], width: int = 42, cpu: list[float] | None = None) -> str:
    times = sorted(times)
    text = (
        f"{label:{width}} median {statistics.median(times):6.0f}  "
        f"min {times[0]:6.0f}  max {times[-1]:6.0f}"
    )
    if cpu:
        text += f"  cpu median {statistics.median(cpu) * 1000:4.0f} min {min(cpu) * 1000:4.0f}"
    return text


def interleaved(runs: int, against: str) -> None:
    """Each case run alternately with this checkout and ``against`` first on PYTHONPATH
    (the order swapped every run): two checkouts compared on a loaded machine."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here, "other": os.path.abspath(against)}
    for tree in trees.values():
        compileall.compile_dir(os.path.join(tree, "kprobes"), quiet=1)
    print(
        f"this = {here}, other = {trees['other']}; {runs} runs each, interleaved, wall ms "
        "(and the command's CPU time)"
    )
    cases = [(label, argv, once) for label, argv in CASES[1:]]
    cases.append(("count -c 'date +%s%N' libc:malloc, to main", STARTS[1], to_start))
    for label, argv, measure in cases:
        times: dict[str, list[float]] = {name: [] for name in trees}
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        for name in trees:
            measure(argv, trees[name])  # warm the page cache
        for run in range(runs):
            for name in sorted(trees, reverse=run % 2 == 1):
                CPU.clear()
                times[name].append(measure(argv, trees[name]) * 1000)
                cpu[name].extend(CPU)
        for name in trees:
            print(row(f"{name:5} {label}", times[name], width=50, cpu=cpu[name]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument(
        "--against", metavar="CHECKOUT", help="compare with another checkout, runs interleaved"
    )
    args = parser.parse_args()
    if args.against:
        interleaved(args.runs, args.against)
        return
    import kprobes

    compileall.compile_dir(os.path.dirname(kprobes.__file__), quiet=1)
    env_path = os.environ.get("PYTHONPATH", "")
    print(
        f"PYTHONPATH={env_path or '(unset)'}; {args.runs} runs each, wall ms "
        "(and the command's CPU time)"
    )
    for label, argv in CASES:
        once(argv)  # warm the page cache
        CPU.clear()
        print(row(label, [once(argv) * 1000 for _ in range(args.runs)], cpu=list(CPU)))
    label, argv = STARTS
    to_start(argv)
    times = [to_start(argv) * 1000 for _ in range(args.runs)]
    print(f"{label}\n{row('', times)}")


if __name__ == "__main__":
    main()
