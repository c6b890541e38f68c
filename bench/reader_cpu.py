"""The tool's CPU per event handed to an ``async_handler``: what the program-side rows of
``python -m bench`` do not time.

    python -m bench.reader_cpu opt|trap [CALLS]

spawns ``bench/bin/target work_push CALLS`` (``make -C bench`` builds it), registers one
``Kprobe(async_handler=count, args="i=%di")`` (``opt``: ``optimize=True``, a record probe
whose records carry ``i`` alone; ``trap``: the same handler at an int3), runs the program
to its end and prints the events handed over, the records dropped, and the tool's CPU and
wall time per event.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import kprobes

TARGET = Path(__file__).resolve().parent / "bin" / "target"


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "opt"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 150_000
    got = 0

    def count(_kp: kprobes.Kprobe, _event: kprobes.Event) -> None:
        nonlocal got
        got += 1

    with open(os.devnull, "wb") as null:
        proc = kprobes.spawn([str(TARGET), "work_push", str(calls)], stdout=null)
    kp = kprobes.Kprobe(
        symbol="work_push", optimize=mode == "opt", async_handler=count, args="i=%di"
    )
    proc.register_kprobe(kp)
    cpu, wall = time.process_time(), time.monotonic()
    proc.run()
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    per = max(got, 1)
    print(
        f"{mode} events={got} dropped={proc.dropped} "
        f"tool_cpu_us_per_event={cpu / per * 1e6:.2f} wall_us_per_event={wall / per * 1e6:.2f}"
    )
    return 0 if got + proc.dropped == calls else 1


if __name__ == "__main__":
    sys.exit(main())
