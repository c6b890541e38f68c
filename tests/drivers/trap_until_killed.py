"""A kprobes user with breakpoint probes only, which the tests kill with SIGKILL.

    trap_until_killed.py PID [--stall WHERE --after K [--at SPEC]] SPEC...

Attaches to PID and registers a kprobe (no handler, never optimized) at each SPEC,
``symbol`` or ``symbol+offset`` (``libc:malloc`` names a library's), prints ``ready`` and
dispatches their hits until it is killed. With ``--stall WHERE`` it prints ``stalled`` and
sleeps, holding what it holds, at the K-th trap stop of a thread it is about to reap, or has
just reaped (``waitpid``):

    held     the trap not reaped yet: the kernel still holds it (and delivers it if we die)
    reaped   the trap reaped: the kernel has dropped it, the thread goes on from its registers

With ``--at SPEC`` only the traps of threads whose rip (the kernel's, at that moment) is at
SPEC's address count: where the tool puts a thread back on the int3 it trapped on.

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

PTRACE_PEEKUSER = 3
RIP_OFFSET = 16 * 8  # struct user_regs_struct: rip is the 17th word


def probe(spec: str) -> kprobes.Kprobe:
    symbol, _, offset = spec.partition("+")
    return kprobes.Kprobe(symbol=symbol, offset=int(offset or "0", 0))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("pid", type=int)
    parser.add_argument("--stall", choices=("none", "held", "reaped"), default="none")
    parser.add_argument("--after", type=int, default=1)
    parser.add_argument("--at", default=None)
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
        if was_trapped and opts.stall == "reaped" and got[0] == pid:
            point()
        return got

    os.waitpid = reaping
    with kprobes.attach(opts.pid) as proc:
        kps = [probe(spec) for spec in opts.specs]
        proc.register_kprobes(kps)
        if opts.at is not None:
            (target,) = [kp for kp, spec in zip(kps, opts.specs, strict=True) if spec == opts.at]
            at = target.addr
        print("ready", flush=True)
        proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
