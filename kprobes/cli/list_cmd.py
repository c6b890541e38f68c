"""``kprobes list -p PID``: the probes a kprobes session has placed in a process.

The format is Appendix A's ``/sys/kernel/debug/kprobes/list``: address, type, symbol+offset,
[module], then [GONE], [DISABLED] and the out-of-line plan. The session publishes its list in
a state file whenever it changes; a list for a process nobody traces is an error.
"""

from __future__ import annotations

import argparse
import errno
from typing import Any

from kprobes.errors import TargetError
from kprobes.process.cleanup import read_state


def add_parser(sub: Any) -> None:
    p = sub.add_parser("list", help="list the probes placed in a traced process")
    p.add_argument("-p", "--pid", type=int, required=True, help="the traced process")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    state = read_state(args.pid)
    if state is None:
        raise TargetError(f"process {args.pid} is not being traced by kprobes", errno=errno.ESRCH)
    _, listing = state
    for entry in listing:
        print(entry)
    return 0
