"""Batch registration speed: register_kprobes / unregister_kprobes of N probes at once.

The issue's goal is 1,000 probes registered in one batch in under a second, and unregistered
likewise. The probes go on the entries of N distinct (non-ifunc) functions of libc in a spawned
program, so every one of them is resolved, checked, planned and armed for real::

    python -m bench.registration [N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import kprobes
from bench.build import build_all


def measure(n: int) -> tuple[float, float, int]:
    target = str(build_all().target)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        with kprobes.spawn([target, "work_push", "1"], stdout=devnull) as proc:
            from kprobes.symbols.resolve import SymbolResolver

            names = sorted(
                {
                    loc.symbol.name
                    for loc in SymbolResolver(proc.pid).iter_functions("*", module="libc")
                    if loc.symbol is not None and loc.symbol.kind.name == "FUNC"
                }
            )[:n]
            kps = [kprobes.Kprobe(symbol=f"libc:{name}") for name in names]
            t0 = time.perf_counter()
            proc.register_kprobes(kps)
            t1 = time.perf_counter()
            armed = len(proc.list())
            proc.unregister_kprobes(kps)
            t2 = time.perf_counter()
            proc.run(timeout=10)
    finally:
        os.close(devnull)
    return t1 - t0, t2 - t1, armed


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 1000
    runs = [measure(n) for _ in range(5)]
    reg = statistics.median(r[0] for r in runs)
    unreg = statistics.median(r[1] for r in runs)
    print(f"batch of {runs[0][2]} probes (median of {len(runs)}):")
    print(f"  register_kprobes   {reg * 1e3:8.1f} ms  ({reg / runs[0][2] * 1e6:.1f} µs/probe)")
    print(f"  unregister_kprobes {unreg * 1e3:8.1f} ms  ({unreg / runs[0][2] * 1e6:.1f} µs/probe)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
