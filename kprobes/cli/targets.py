"""The target options every subcommand shares: ``-p PID`` or ``-c "CMD ARGS"``.

Picking the target is the command line's job (the library never chooses one): ``-p`` attaches
to a running process and leaves it running afterwards; ``-c`` spawns the command (split like
a shell would, without one) stopped before its first instruction, so probes are in place
from it on: those on libraries wait for the loader to map them (pending).
"""

from __future__ import annotations

import argparse
import errno
import shlex
import sys
from collections.abc import Iterable

from kprobes.cli.notes import summarise
from kprobes.core.probes import Kprobe
from kprobes.errors import SpecError, TargetError
from kprobes.process.launch import attach, spawn
from kprobes.process.target import Process


def add_target_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("-p", "--pid", type=int, help="attach to this running process")
    group.add_argument("-c", "--command", metavar="CMD", help='spawn "CMD ARGS" traced')
    parser.add_argument(
        "--pending",
        action="store_true",
        help="with -p: a probe on a library the process has not loaded waits until it loads "
        "it (without, it is an error at once; with -c a probe always waits for its library)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the program's threads where the scheduler puts them (by default a thread "
        "the probes stop often runs on the tool's CPU while it does)",
    )


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
    """The process ``-p``/``-c`` names, traced by us (``-c``: stopped before its first
    instruction). Probes on libraries it has not loaded wait for them (pending), and what
    the program's loads say about them is said on stderr."""
    pin = not getattr(args, "no_pin", False)
    if args.pid is not None:
        pending = getattr(args, "pending", False)
        proc = attach(args.pid, follow_forks=follow_forks, pending=pending, pin_hot_threads=pin)
    else:
        argv = command_argv(args)
        proc = spawn(argv, follow_forks=follow_forks, pending=True, pin_hot_threads=pin)
    proc.on_notice = _say
    return proc


def _say(message: str) -> None:
    print(f"kprobes: {message}", file=sys.stderr, flush=True)


def say_pending(probes: Iterable[object], names: Iterable[str], *, verbose: bool) -> None:
    """Probes still waiting for their library after placement: a line each, or one for many
    (``notes.summarise``)."""
    waiting, libraries = [], []
    for probe, name in zip(probes, names, strict=True):
        entry = getattr(probe, "kp", probe)  # a Kretprobe's or Jprobe's entry probe
        if isinstance(entry, Kprobe) and entry.is_pending:
            waiting.append((name, "it is placed when the program loads its library"))
            libraries.append(f"in {name.partition(':')[0] or 'its library'}")
    for line in summarise(
        waiting,
        one="is pending",
        many="are pending, each placed when the program loads its library",
        verbose=verbose,
        kinds=libraries,
    ):
        _say(line)
