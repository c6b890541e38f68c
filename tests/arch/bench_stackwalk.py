"""Cost of the fast tier's stack walk (kprobes/arch/x86_64/stackwalk.py), by hand (not a test):

    cd tests/arch && ../../.venv/bin/python bench_stackwalk.py [WALKS]

Runs tests/programs/walk_harness.c pinned (``taskset -c 0``) in its bench mode: WALKS walks
from ``leaf`` under ``deep(D)`` for D = 0, 10, 30 and 100 (best of 5 rounds each), with the
compact tables of every file it maps (libc, libstk.so, the harness itself, ld.so, libgcc_s);
prints ns per walk for each depth (in return addresses) and the cost per frame between them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import build_program
from test_stackwalk import run_harness


def main() -> None:
    walks = sys.argv[1] if len(sys.argv) > 1 else "200000"
    lines: list[str] = []
    run_harness(build_program("walk_harness"), f"bench={walks}", lines=lines)
    points = []
    for line in lines:
        _, frames, ns = line.split()
        points.append((int(frames), float(ns)))
        print(f"{int(frames):4d} return addresses: {float(ns):7.1f} ns a walk")
    (f0, t0), (f1, t1) = points[0], points[-1]
    print(f"per frame: {(t1 - t0) / (f1 - f0):.1f} ns ({f0} to {f1} return addresses)")


if __name__ == "__main__":
    main()
