"""A kprobes user holding an optimized return probe, which the tests kill with SIGKILL.

    return_until_killed.py PID SYMBOL...

Attaches to PID, registers ``Kretprobe(symbol=SYMBOL, optimize=True)`` for each SYMBOL,
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
        proc.register_kretprobes([kprobes.Kretprobe(symbol=s, optimize=True) for s in symbols])
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
