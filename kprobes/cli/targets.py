"""The target options every subcommand shares: ``-p PID`` or ``-c "CMD ARGS"``.

Picking the target is the command line's job (the library never chooses one): ``-p`` attaches
to a running process and leaves it running afterwards; ``-c`` spawns the command (split like
a shell would, without one) stopped before its first instruction, so probes are in place
from it on: those on libraries wait for the loader to map them (pending).

``-p A,B`` (or ``-p A -p B``), as perf's ``-p``, traces several processes in one command
(``args.pids``, in the order given, each once). Our own backend attaches the first, then
each other one as a member of its family (``attach(pid, beside=first)``): one wait loop, the
first's ``run()``, drives them all, as it drives the followed children that exec'd
(following/family.py); a process that cannot be attached lets the ones before it go, as
they were.
"""

from __future__ import annotations

import argparse
import errno
import shlex
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kprobes.cli.notes import summarise
from kprobes.core.probes import Kprobe
from kprobes.errors import SpecError, TargetError

if TYPE_CHECKING:
    from kprobes.process.target import Process


class _Pids(argparse.Action):
    """``-p A,B`` and ``-p A -p B``: every pid, in order, each once (``args.pids``); at
    most ``const`` of them when it is given."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        pids: list[int] = list(getattr(namespace, self.dest, None) or [])
        for word in str(values).split(","):
            if not word.strip().isdigit() or int(word) <= 0:
                parser.error(f"argument -p/--pid: {word.strip()!r} is not a process id")
            if int(word) not in pids:
                pids.append(int(word))
        if self.const is not None and len(pids) > self.const:
            parser.error("argument -p/--pid: one process only (several: trace, count, ...)")
        setattr(namespace, self.dest, pids)


def add_target_arguments(
    parser: argparse.ArgumentParser, *, required: bool = True, several: bool = True
) -> None:
    """``-p``/``-c``, and ``--pending``, ``--no-pin``; ``several``: ``-p`` takes more than
    one process (``args.pids`` holds them; one only, else)."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument(
        "-p",
        "--pid",
        dest="pids",
        action=_Pids,
        const=None if several else 1,
        metavar="PID[,PID...]" if several else "PID",
        help="attach to these running processes (-p A,B or -p A -p B; each event says "
        "whose it is, counts are summed over them)"
        if several
        else "attach to this running process",
    )
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
    (proc,) = open_targets(args, follow_forks=follow_forks)
    return proc


def open_targets(args: argparse.Namespace, *, follow_forks: bool = False) -> list[Process]:
    """The processes ``-p`` names (or the one ``-c`` starts), as ``open_target``: every
    one after the first is a member of the first's family, whose ``run()`` drives them
    all and whose ``close()`` lets them all go. One that cannot be attached lets those
    before it go, untouched."""
    from kprobes.process.launch import attach, spawn  # the engine: not for ``--help``

    pin = not getattr(args, "no_pin", False)
    if args.pids is None:
        argv = command_argv(args)
        proc = spawn(argv, follow_forks=follow_forks, pending=True, pin_hot_threads=pin)
        proc.on_notice = _say
        return [proc]
    pending = getattr(args, "pending", False)
    first, *others = args.pids
    procs = [attach(first, follow_forks=follow_forks, pending=pending, pin_hot_threads=pin)]
    try:
        for pid in others:
            procs.append(attach(pid, follow_forks=follow_forks, pending=pending, beside=procs[0]))
    except BaseException:
        procs[0].close()  # and the members before the one that failed
        raise
    for proc in procs:
        proc.on_notice = _say
    return procs


def _say(message: str) -> None:
    print(f"kprobes: {message}", file=sys.stderr, flush=True)


_PLACED_WHEN = "placed when its file is mapped (a library loaded, or a program run by exec)"


def say_pending(probes: Iterable[object], names: Iterable[str], *, verbose: bool) -> None:
    """Probes still waiting for their library after placement: a line each, or one for many
    (``notes.summarise``)."""
    waiting, libraries = [], []
    for probe, name in zip(probes, names, strict=True):
        entry = getattr(probe, "kp", probe)  # a Kretprobe's or Jprobe's entry probe
        if isinstance(entry, Kprobe) and entry.is_pending:
            waiting.append((name, f"it is {_PLACED_WHEN}"))
            libraries.append(f"in {name.partition(':')[0] or 'its library'}")
    for line in summarise(
        waiting,
        one="is pending",
        many=f"are pending, each {_PLACED_WHEN}",
        verbose=verbose,
        kinds=libraries,
    ):
        _say(line)
