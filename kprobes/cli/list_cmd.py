"""``kprobes list``: the probes in place, in the format of Appendix A's kprobes/list; with
``-l``, the functions that can be probed (list_functions.py).

    kprobes list -p PID                  the probes a kprobes session placed in a process
    kprobes list --kernel                /sys/kernel/debug/kprobes/list: every kernel kprobe
    kprobes list --backend uprobes       uprobe_events: every kernel uprobe, of every tool
    kprobes list -l [PATTERN] (-p PID | -c CMD | PATH)   the functions that can be probed

For a process the format is address, type, symbol+offset, [module], then [GONE], [DISABLED]
and the out-of-line plan; ``--json`` gives each probe as an object on a line. The session
publishes its list in a state file whenever it changes; a list for a process nobody traces
is an error.
"""

from __future__ import annotations

import argparse
import errno
import json
from collections.abc import Iterable
from typing import Any

from kprobes.cli import list_functions
from kprobes.cli.backends import add_backend_arguments
from kprobes.errors import TargetError
from kprobes.model import ProbeListing
from kprobes.process.survival.cleanup import read_state
from kprobes.tracefs.control import TraceFs
from kprobes.tracefs.kernel import list_kprobes


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("list", help=help)
    p.add_argument("-p", "--pid", type=int, help="the traced process (with -l: any process)")
    list_functions.add_arguments(p)
    add_backend_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.functions:
        return list_functions.run(args)
    for given, what in (
        (args.words, "PATTERN or PATH"),
        (args.command, "-c"),
        (args.verbose, "-v"),
    ):
        if given:
            raise TargetError(
                f"list: {what} goes with -l (list -l: the functions)", errno=errno.EINVAL
            )
    if args.backend == "kernel":
        _print(list_kprobes(), as_json=args.json)
        return 0
    if args.backend == "uprobes":
        if args.json:
            raise TargetError(
                "list --json: uprobe_events has no fields but its lines", errno=errno.EINVAL
            )
        fs = TraceFs.open()
        if not fs.exists("uprobe_events"):
            raise TargetError("this kernel has no uprobe_events", errno=errno.ENOSYS)
        for line in fs.iter_lines("uprobe_events"):
            print(line)
        return 0
    if args.pid is None:
        raise TargetError(
            "list: give -p PID (or --kernel, or --backend uprobes; -l for the functions)",
            errno=errno.EINVAL,
        )
    state = read_state(args.pid)
    if state is None:
        raise TargetError(f"process {args.pid} is not being traced by kprobes", errno=errno.ESRCH)
    _, listing = state
    _print(listing, as_json=args.json)
    return 0


def _print(listing: Iterable[ProbeListing], *, as_json: bool) -> None:
    for entry in listing:
        print(json.dumps(entry.to_json()) if as_json else entry)
