"""A kprobes user holding optimized count probes, which the tests kill with SIGKILL.

    optimize_until_killed.py PID MODE [--inside OFFSET] [--stall WHERE --after K] OFFSET...

Attaches to PID (tests/programs/hammer.c), registers an ``optimize=True`` count probe at each
``mix+OFFSET``, waits until ``list()`` shows every one ``[OPTIMIZED]`` (a site waits while a
thread is inside its region), prints ``ready`` and then, until it is killed:

    steady  dispatches: nothing traps, the program counts through the jumps
    switch  switches the optimization off and on every few milliseconds: the jumps go back to
            their int3s and come again
    toggle  disables and enables the probes in turn, and registers and unregisters one more at
            ``mix+INSIDE`` (inside the region of the first jump, which goes back to its int3
            meanwhile)
    traps   switches the optimization off and dispatches the hits of the int3s

With ``--stall WHERE`` it prints ``stalled`` and sleeps, holding what it holds, at the K-th
time after ``ready`` that it is:

    patch    just past writing a jump over an int3 (the world is held; the other sites of
             the same stop may not have theirs yet)
    unpatch  just past writing a site's original bytes back over its jump (likewise)
    patch-tail, unpatch-int3, unpatch-tail
             just past that step of the three writes that put a jump in or take it out
             (breakpoints.py ``PokeStep``): an int3 followed by the jump's 4 other bytes, by
             the jump's again, or by the original 4
    reaped   just past reaping a thread's SIGTRAP stop (waitpid), before anything else

Nothing here restores anything: SIGKILL gives it no chance. The program must carry on alone.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from typing import Any

import kprobes
from kprobes.process.engine.breakpoints import Breakpoints, PokeStep
from kprobes.process.engine.tracee import Tracee

STALLS = ("none", "patch", "unpatch", "patch-tail", "unpatch-int3", "unpatch-tail", "reaped")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("pid", type=int)
    parser.add_argument("mode", choices=("steady", "switch", "toggle", "traps"))
    parser.add_argument("--inside", type=lambda s: int(s, 0), default=None)
    parser.add_argument("--stall", choices=STALLS, default="none")
    parser.add_argument("--after", type=int, default=1)
    parser.add_argument("offsets", type=lambda s: int(s, 0), nargs="+")
    opts = parser.parse_args()
    seen = 0
    is_ready = False

    def point(where: str) -> None:
        nonlocal seen
        if not is_ready or opts.stall != where:
            return
        seen += 1
        if seen >= opts.after:
            print("stalled", flush=True)
            time.sleep(3600)

    patch_jump, unpatch_jump, waitpid = Breakpoints.patch_jump, Breakpoints.unpatch_jump, os.waitpid
    poke = Breakpoints._poke
    doing = ""

    def patching(self: Breakpoints, *args: Any, **kwargs: Any) -> None:
        nonlocal doing
        doing = "patch"
        patch_jump(self, *args, **kwargs)
        doing = ""
        point("patch")

    def unpatching(self: Breakpoints, *args: Any, **kwargs: Any) -> None:
        nonlocal doing
        doing = "unpatch"
        unpatch_jump(self, *args, **kwargs)
        doing = ""
        point("unpatch")

    def poking(self: Breakpoints, space: Tracee, addr: int, data: bytes, step: PokeStep) -> None:
        poke(self, space, addr, data, step)
        if doing:
            point(f"{doing}-{step.value}")

    def reaping(pid: int, options: int) -> tuple[int, int]:
        tid, status = waitpid(pid, options)
        if tid and os.WIFSTOPPED(status) and status >> 8 == signal.SIGTRAP:
            point("reaped")
        return tid, status

    Breakpoints.patch_jump = patching  # type: ignore[method-assign]
    Breakpoints.unpatch_jump = unpatching  # type: ignore[method-assign]
    Breakpoints._poke = poking  # type: ignore[method-assign]
    os.waitpid = reaping

    with kprobes.attach(opts.pid) as proc:
        kps = [kprobes.Kprobe(symbol="mix", offset=off, optimize=True) for off in opts.offsets]
        proc.register_kprobes(kps)
        deadline = time.monotonic() + 20
        while not all(entry.is_optimized for entry in proc.list()):
            if time.monotonic() > deadline:  # a thread kept being in a region's way
                print(*proc.list(), sep="\n", file=sys.stderr)
                return 1
            proc.run(timeout=0.01)  # it retries when it returns
        print("ready", flush=True)
        is_ready = True
        if opts.mode in ("steady", "traps"):
            proc.optimization = opts.mode == "steady"
            proc.run()
            return 0
        guest: kprobes.Kprobe | None = None
        for kp in itertools.cycle(kps):
            proc.run(timeout=0.003)
            if opts.mode == "switch":
                proc.optimization = not proc.optimization
                continue
            (proc.enable_kprobe if kp.is_disabled else proc.disable_kprobe)(kp)
            if guest is not None:
                proc.unregister_kprobe(guest)
                guest = None
            elif opts.inside is not None:
                guest = kprobes.Kprobe(symbol="mix", offset=opts.inside, optimize=True)
                proc.register_kprobe(guest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
