"""``python -m bench.startup``: what following a program from its first instruction costs.

A spawned program is stopped at the exit of its ``execve``; a probe on libc waits, and the
loader's startup runs under ``PTRACE_SYSCALL`` until libc is mapped (process/following/pending.py).
This times ``spawn`` + one pending ``libc:malloc`` probe + ``run()`` to the program's exit,
median of ``--runs``, for a program that loads libc alone and one that loads five libraries.
Compare with another checkout by running it with that checkout first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import kprobes

PROGRAMS = (
    ["/bin/true"],
    ["zstd", "-q", "-f", "/etc/services", "-o", os.devnull],
)


def once(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    with open(os.devnull, "wb") as null:
        proc = kprobes.spawn(argv, stdout=null, stderr=null)
    kp = kprobes.Kprobe(symbol="libc:malloc")
    proc.register_kprobe(kp)
    proc.run()
    return time.perf_counter() - start, kp.nhit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    for argv in PROGRAMS:
        path = shutil.which(argv[0])
        if path is None:
            print(f"{argv[0]}: not installed")
            continue
        runs = [once([path, *argv[1:]]) for _ in range(args.runs)]
        median = statistics.median(t for t, _ in runs) * 1000
        hits = runs[0][1]
        print(f"{argv[0]:>10}: {median:6.1f} ms per run (median of {args.runs}), malloc {hits}")


if __name__ == "__main__":
    main()
