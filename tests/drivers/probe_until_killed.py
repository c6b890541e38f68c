"""A kprobes user that the survival tests kill with SIGKILL at a moment of their choosing.

    probe_until_killed.py PID [--stall WHERE] [--after K]

Attaches to PID and registers a kprobe on ``rec`` (pre handler), a kretprobe on ``rec`` and a
kprobe on ``hot`` with a post handler (``hot`` begins with a rip-relative ``mov``: with a post
handler it runs out of line and stops a second time, a step). Prints ``ready`` and dispatches
hits until it is killed. With ``--stall WHERE`` it prints ``stalled`` and sleeps, holding the
program's thread, at the K-th time it is:

    pre     in the pre handler of rec (the thread stopped on the int3)
    ret     in the kretprobe's handler (the thread stopped on the trampoline)
    post    in the post handler of hot (the thread stopped at the end of its stepped copy)
    inject  inside an injected syscall run on the rescue's stub (the first one makes the
            rescue the program's SIGTRAP handler; the second maps an out-of-line page)

Nothing here restores anything: SIGKILL gives it no chance. The program must carry on alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import kprobes
from kprobes.process.inject import calls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("pid", type=int)
    parser.add_argument("--stall", choices=("none", "pre", "ret", "post", "inject"), default="none")
    parser.add_argument("--after", type=int, default=100)
    opts = parser.parse_args()
    seen = {"pre": 0, "ret": 0, "post": 0, "inject": 0}

    def point(where: str) -> None:
        if opts.stall != where:
            return
        seen[where] += 1
        if seen[where] >= opts.after:
            print("stalled", flush=True)
            time.sleep(3600)

    def pre(p: Any, regs: Any) -> None:
        point("pre")

    def ret(ri: Any, regs: Any) -> None:
        point("ret")

    def post(p: Any, regs: Any, flags: int) -> None:
        point("post")

    if opts.stall == "inject":
        original = calls._wait_for_trap

        def waiting(thread: Any, *, stepping: bool) -> None:
            if not stepping:  # the rescue's stub: the thread runs our syscall now
                point("inject")
            original(thread, stepping=stepping)

        calls._wait_for_trap = waiting  # type: ignore[assignment]

    with kprobes.attach(opts.pid) as proc:
        proc.register_kprobe(kprobes.Kprobe(symbol="rec", pre_handler=pre))
        proc.register_kretprobe(kprobes.Kretprobe(symbol="rec", handler=ret, maxactive=256))
        proc.register_kprobe(kprobes.Kprobe(symbol="hot", post_handler=post))
        print("ready", flush=True)
        proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
