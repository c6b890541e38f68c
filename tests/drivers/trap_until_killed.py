"""A kprobes user with breakpoint probes only, which the tests kill with SIGKILL.

    trap_until_killed.py PID [--follow [--cycle]] [--stall WHERE --after K [--at SPEC]] SPEC...

Attaches to PID and registers a kprobe (no handler, never optimized) at each SPEC,
``symbol`` or ``symbol+offset`` (``libc:malloc`` names a library's), prints ``ready`` and
dispatches their hits until it is killed. With ``--stall WHERE`` it prints ``stalled`` and
sleeps, holding what it holds, at the K-th trap stop of a thread it is about to reap, or has
just reaped (``waitpid``):

    held     the trap not reaped yet: the kernel still holds it (and delivers it if we die)
    reaped   the trap reaped: the kernel has dropped it, the thread goes on from its registers
    aside    reaped by a tracer that does not own the thread (``Tracer.set_aside``: the root
             stopping its world while a member's thread traps)

With ``--at SPEC`` only the traps of threads whose rip (the kernel's, at that moment) is at
SPEC's address count: where the tool puts a thread back on the int3 it trapped on. With
``--follow`` it follows PID's children (``follow_forks``, the probes pending where they are
not mapped yet), and only the traps of processes other than PID count: a child that exec'd
is a member of the family, whose stops reach the tool through the root's loop (family.py).
``--cycle`` registers and unregisters one more probe (``libc:free``) all the time: each time,
the root stops its world, and the members' traps meanwhile are the root's to set aside.

Nothing here restores anything: SIGKILL gives it no chance. The program must carry on alone.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time

import kprobes
from kprobes.process.engine.tracer import Tracer

PTRACE_PEEKUSER = 3
RIP_OFFSET = 16 * 8  # struct user_regs_struct: rip is the 17th word


def probe(spec: str) -> kprobes.Kprobe:
    symbol, _, offset = spec.partition("+")
    return kprobes.Kprobe(symbol=symbol, offset=int(offset or "0", 0))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("pid", type=int)
    parser.add_argument("--stall", choices=("none", "held", "reaped", "aside"), default="none")
    parser.add_argument("--after", type=int, default=1)
    parser.add_argument("--at", default=None)
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--cycle", action="store_true")
    parser.add_argument("specs", nargs="+")
    opts = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    seen = 0
    at = 0

    def trapped(tid: int) -> bool:
        """``tid`` sits in a SIGTRAP stop not reaped yet (at ``--at``'s address)."""
        info = os.waitid(
            os.P_PID,
            tid,
            os.WSTOPPED | os.WNOWAIT | os.WNOHANG | 0x40000000,  # __WALL
        )
        if info is None or info.si_code != os.CLD_TRAPPED or info.si_status != signal.SIGTRAP:
            return False
        if opts.follow and os.path.exists(f"/proc/{opts.pid}/task/{tid}"):
            return False  # the root's own
        return not at or libc.ptrace(PTRACE_PEEKUSER, tid, RIP_OFFSET, None) == at

    def point() -> None:
        nonlocal seen
        seen += 1
        if seen >= opts.after:
            print("stalled", flush=True)
            time.sleep(3600)

    waitpid = os.waitpid

    def reaping(pid: int, options: int) -> tuple[int, int]:
        if pid <= 0 or opts.stall == "none":
            return waitpid(pid, options)
        was_trapped = trapped(pid)
        if was_trapped and opts.stall == "held":
            point()
        got = waitpid(pid, options)
        if was_trapped and got[0] == pid and opts.stall == ("aside" if aside else "reaped"):
            point()
        return got

    set_aside = Tracer.set_aside
    aside = False

    def setting_aside(self: Tracer, tid: int, status: int) -> None:
        nonlocal aside
        aside = True
        try:
            set_aside(self, tid, status)
        finally:
            aside = False

    os.waitpid = reaping
    Tracer.set_aside = setting_aside  # type: ignore[method-assign]
    with kprobes.attach(opts.pid, follow_forks=opts.follow, pending=opts.follow) as proc:
        kps = [probe(spec) for spec in opts.specs]
        proc.register_kprobes(kps)
        if opts.at is not None:
            (target,) = [kp for kp, spec in zip(kps, opts.specs, strict=True) if spec == opts.at]
            at = target.addr
        print("ready", flush=True)
        if not opts.cycle:
            proc.run()
            return 0
        extra: kprobes.Kprobe | None = None
        while not proc.run(timeout=0.005):
            if extra is None:
                extra = kprobes.Kprobe(symbol="libc:free")
                proc.register_kprobe(extra)
            else:
                proc.unregister_kprobe(extra)
                extra = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
