"""``kprobes list``: the probes in place, in the format of Appendix A's kprobes/list.

    kprobes list -p PID                  the probes a kprobes session placed in a process
    kprobes list --kernel                /sys/kernel/debug/kprobes/list: every kernel kprobe
    kprobes list --backend uprobes       uprobe_events: every kernel uprobe, of every tool

For a process the format is address, type, symbol+offset, [module], then [GONE], [DISABLED]
and the out-of-line plan. The session publishes its list in a state file whenever it changes;
a list for a process nobody traces is an error.
"""

from __future__ import annotations

import argparse
import errno
from typing import Any

from kprobes.cli.backends import add_backend_arguments
from kprobes.errors import TargetError
from kprobes.process.survival.cleanup import read_state
from kprobes.tracefs.control import TraceFs
from kprobes.tracefs.kernel import list_kprobes


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("list", help=help)
    p.add_argument("-p", "--pid", type=int, help="the traced process")
    add_backend_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.backend == "kernel":
        for kprobe in list_kprobes():
            print(kprobe)
        return 0
    if args.backend == "uprobes":
        fs = TraceFs.open()
        if not fs.exists("uprobe_events"):
            raise TargetError("this kernel has no uprobe_events", errno=errno.ENOSYS)
        for line in fs.iter_lines("uprobe_events"):
            print(line)
        return 0
    if args.pid is None:
        raise TargetError(
            "list: give -p PID (or --kernel, or --backend uprobes)", errno=errno.EINVAL
        )
    state = read_state(args.pid)
    if state is None:
        raise TargetError(f"process {args.pid} is not being traced by kprobes", errno=errno.ESRCH)
    _, listing = state
    for entry in listing:
        print(entry)
    return 0
