"""The target options every subcommand shares: ``-p PID`` or ``-c "CMD ARGS"``.

Picking the target is the command line's job (the library never chooses one): ``-p`` attaches
to a running process and leaves it running afterwards; ``-c`` spawns the command (split like
a shell would, without one) stopped at its entry point, so probes are in place before its
first instruction.
"""

from __future__ import annotations

import argparse
import errno
import shlex

from kprobes.errors import SpecError, TargetError
from kprobes.process.launch import attach, spawn
from kprobes.process.target import Process


def add_target_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("-p", "--pid", type=int, help="attach to this running process")
    group.add_argument("-c", "--command", metavar="CMD", help='spawn "CMD ARGS" traced')


def command_argv(args: argparse.Namespace) -> list[str]:
    """``-c "CMD ARGS"`` split as a shell would, without one."""
    try:
        argv = shlex.split(args.command)
    except ValueError as exc:
        raise SpecError(f"-c: {exc}", column=0, text=args.command) from exc
    if not argv:
        raise TargetError("-c: empty command", errno=errno.EINVAL)
    return argv


def open_target(args: argparse.Namespace, *, follow_forks: bool = False) -> Process:
    """The process ``-p``/``-c`` names, traced by us (``-c``: stopped at its entry point)."""
    if args.pid is not None:
        return attach(args.pid, follow_forks=follow_forks)
    return spawn(command_argv(args), follow_forks=follow_forks)
