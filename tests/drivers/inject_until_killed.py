"""A kprobes user stalled inside its K-th injection, to be SIGKILLed there.

    inject_until_killed.py PID K SYMBOL

Attaches to PID and registers a kprobe on SYMBOL; the registration makes the injections (the
first one on the stub makes the rescue the program's SIGTRAP handler, the next ones map our
pages), then it detaches (more injections: our pages unmapped, the program's own actions
back). At the K-th, while the borrowed thread runs our syscall on the rescue's stub, or
wears the registers of one that goes home by itself (selfrestore.py: the rescue's own mmap,
and the clean end's last ones), it writes "stalled" on stdout and sleeps, for the test to
SIGKILL it ("stalled in the rescue's munmap" at the last one, whose way home is the
program's own code: see selfrestore.py). "placed" says the probe is in; with fewer
injections than K it ends cleanly.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import kprobes
from kprobes.linux.syscalls import NR_MUNMAP
from kprobes.process.inject import calls, selfrestore


def main() -> int:
    pid, stall_at, symbol = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    seen = [0]
    original = calls._wait_for_trap

    run_to_exit = selfrestore._run_to_exit

    def point(what: str = "") -> None:
        seen[0] += 1
        if seen[0] == stall_at:
            print("stalled" + what, flush=True)
            time.sleep(3600)

    def waiting(thread: Any, *, stepping: bool) -> None:
        if not stepping:  # the rescue's stub: the thread runs our syscall now
            point()
        original(thread, stepping=stepping)

    def running(thread: Any, way: Any, nr: int) -> int:
        # the thread wears the injection's registers, not yet resumed
        point(" in the rescue's munmap" if nr == NR_MUNMAP and not way.restarter else "")
        return run_to_exit(thread, way, nr)

    calls._wait_for_trap = waiting  # type: ignore[assignment]
    selfrestore._run_to_exit = running  # type: ignore[assignment]
    with kprobes.attach(pid) as proc:
        proc.register_kprobe(kprobes.Kprobe(symbol=symbol, pre_handler=lambda p, r: None))
        print("placed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
