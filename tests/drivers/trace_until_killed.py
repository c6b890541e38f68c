"""A minimal kprobes user, for the tests that kill or break the tracer.

    trace_until_killed.py [--symbol work] [--out FILE] [--raise-at K] PROGRAM [ARGS...]

Spawns PROGRAM (its stdout in FILE) with one probe on SYMBOL, prints

    pid PID
    list <one line of proc.list()>
    ready

on its own stdout, then dispatches hits until the program exits and prints "exit CODE hits N".
With --raise-at K the pre handler raises RuntimeError at the K-th hit (nothing handles it).

It does nothing about signals on purpose: the library must leave the program running and
unpatched whichever way this script ends (SIGINT, SIGTERM, SIGHUP, an exception).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import kprobes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--symbol", default="work")
    parser.add_argument("--out", default=None)
    parser.add_argument("--raise-at", type=int, default=0)
    parser.add_argument("program")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()

    hits = 0

    def pre(p: Any, regs: Any) -> None:
        nonlocal hits
        hits += 1
        if hits == opts.raise_at:
            raise RuntimeError(f"deliberate failure at hit {hits}")

    out = open(opts.out, "wb") if opts.out else None  # noqa: SIM115 - the child keeps its copy
    proc = kprobes.spawn([opts.program, *opts.args], stdout=out)
    if out is not None:
        out.close()
    with proc:
        kp = kprobes.Kprobe(symbol=opts.symbol, pre_handler=pre)
        proc.register_kprobe(kp)
        print(f"pid {proc.pid}", flush=True)
        for entry in proc.list():
            print(f"list {entry}", flush=True)
        print("ready", flush=True)
        proc.run()
    print(f"exit {proc.exit_code} hits {kp.nhit}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
