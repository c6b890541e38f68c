"""``kprobes trace -p SHELL --follow-forks --pending SPEC``, stalled inside its K-th injection.

    trace_tree_until_killed.py PID K SPEC

The command line's ``main`` in this process, with ``calls._wait_for_trap`` wrapped: at the
K-th injected syscall run on a rescue's stub in a process other than PID (a child of the
tree; the thread is running our syscall), it writes
"stalled" on stderr and sleeps, holding the thread, for the test to SIGKILL it there. The
injections of a followed child that exec'd come at its loader's breakpoint, after the
loader's ``ret`` there was emulated: what the rescue gives the thread back must be that.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kprobes.cli.main import main as kprobes_main
from kprobes.process.inject import calls


def run() -> int:
    pid, stall_at, spec = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    seen = [0]
    original = calls._wait_for_trap

    def waiting(thread: Any, *, stepping: bool) -> None:
        if not stepping and thread.tracee.pid != int(pid):  # a child, on the rescue's stub
            seen[0] += 1
            if seen[0] == stall_at:
                sys.stderr.write("stalled\n")
                sys.stderr.flush()
                time.sleep(3600)
        original(thread, stepping=stepping)

    calls._wait_for_trap = waiting  # type: ignore[assignment]
    return kprobes_main(["trace", "-p", pid, "--follow-forks", "--pending", spec])


if __name__ == "__main__":
    sys.exit(run())
