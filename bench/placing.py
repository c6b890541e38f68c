"""``python -m bench.placing COMMAND ARGS...``: a ``kprobes`` command run in this process,
with how long it held the program at each stop of the world.

    python -m bench.placing count -p PID 'libpython3.11:*' -d 1

Prints, on stderr after the command's own output: the number of stops, the time held in all,
the median, p95 and longest stop, and the wall time of the whole command. A glob's probes are
placed in stops of about ``PLACING_STOP`` (cli/backends.py); this is what shows whether they
are (docs/performance.md, "Thousands of probes").
"""

from __future__ import annotations

import sys
import time

from kprobes.cli.main import main
from kprobes.process.engine.world import World


def run(argv: list[str]) -> int:
    held: list[float] = []
    since = 0.0
    stop, resume = World.stop, World.resume

    def stopping(world: World, **kw: bool) -> None:
        nonlocal since
        if not world.is_stopped:
            since = time.monotonic()
        stop(world, **kw)

    def resuming(world: World) -> None:
        resume(world)
        if not world.is_stopped:
            held.append(time.monotonic() - since)

    World.stop, World.resume = stopping, resuming  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        return main(argv)
    finally:
        World.stop, World.resume = stop, resume  # type: ignore[method-assign]
        wall = time.monotonic() - started
        held.sort()
        n = len(held)
        if n:
            print(
                f"stops {n}, held {sum(held):.2f} s in all, median {held[n // 2] * 1000:.0f} ms, "
                f"p95 {held[int(n * 0.95)] * 1000:.0f} ms, max {held[-1] * 1000:.0f} ms; "
                f"wall {wall:.1f} s",
                file=sys.stderr,
            )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
