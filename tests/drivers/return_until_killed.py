"""A kprobes user holding an optimized return probe, which the tests kill with SIGKILL.

    return_until_killed.py PID SYMBOL...

Attaches to PID, registers ``Kretprobe(symbol=SYMBOL, optimize=True)`` for each SYMBOL (a
``SYMBOL@ARGS`` gets an ``async_handler`` and the fetch-args ARGS: its trampoline writes a
record of each return),
waits until ``list()`` shows them ``[OPTIMIZED]``, prints ``ready`` and dispatches until it
is killed. The frames the program enters meanwhile are hooked to a trampoline in the
program; nothing here puts their return addresses back: SIGKILL gives it no chance.
"""

from __future__ import annotations

import sys
import time

import kprobes


def main() -> int:
    pid, symbols = int(sys.argv[1]), sys.argv[2:]
    with kprobes.attach(pid) as proc:
        events: list[object] = []
        probes = []
        for spec in symbols:
            symbol, _, args = spec.partition("@")
            handler = (lambda _rp, ev: events.append(ev)) if args else None
            probes.append(
                kprobes.Kretprobe(symbol=symbol, optimize=True, async_handler=handler, args=args)
            )
        for rp in probes:
            proc.register_kretprobe(rp)
        deadline = time.monotonic() + 20
        while not all(entry.is_optimized for entry in proc.list()):
            if time.monotonic() > deadline:
                print(*proc.list(), sep="\n", file=sys.stderr)
                return 1
            proc.run(timeout=0.01)
        print("ready", flush=True)
        proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
