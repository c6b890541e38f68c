"""Where the tracing commands' probes go: our own kprobes, the kernel's uprobes, the kernel's
kprobes. The commands hand specs and a sink to a backend and never see which one it is.

    (default) --backend ptrace    -p PIDS | -c CMD     the Process target (``SpecTracer``):
                                                       ptrace_backend.py
              --backend uprobes   -p PIDS | -c CMD     ``kprobes.Uprobes(pid=...)``
              --backend uprobes   (no target)          ``Uprobes(path=...)``: every process
                                                       running the file the specs name
    --kernel (--backend kernel)   [-p PIDS | -c CMD]   ``kprobes.Kernel()``, ``pid=`` to keep
                                                       only those processes' events

(``-p PIDS``: one process, or several, ``-p A,B`` or ``-p A -p B``.)

With ``-c`` and the uprobes backend the command is forked and held before its exec while the
instance's pid filter takes its pid and the probes are placed on the files it will map
(``Uprobes(command=...)``), then let go: the kernel counts it from its first instruction, and
every process it starts (``event-fork``), as perf does. Our own backend follows the same tree:
``-c`` stops the command before its first instruction, and each child that execs becomes a
process of its own with the specs placed again in its image (process/following/family.py).
``-p PID`` follows that process (``-p A,B``, each of them), and with ``--follow-forks`` the
processes it starts from then on. With ``--kernel`` the command is started stopped by the
Process target (``spawn``) and released, untraced, once the probes are placed. Either way
its exit ends the session. Rejected alternative: starting it with ``subprocess`` and
registering afterwards, which misses whatever it does first.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import os
import signal
import time
from collections.abc import Callable, Generator, Sequence
from typing import Protocol

from kprobes.errors import ProbeError, ProbeRejected
from kprobes.model import Event
from kprobes.spec import ProbeSpec
from kprobes.values import dataclass, field

Sink = Callable[[Event], None]
BACKENDS = ("ptrace", "uprobes", "kernel")
# Per-CPU ring buffer of the uprobes backend: a program's startup makes ~100,000 libc:malloc
# and free hits in a fraction of a second, ~20 bytes each, faster than Python decodes them.
UPROBES_BUFFER_KB = 8192


class Placed(Protocol):
    """One spec and its probe, as the summary sees it."""

    spec: ProbeSpec

    @property
    def name(self) -> str: ...

    @property
    def hits(self) -> int: ...

    @property
    def missed(self) -> int: ...


# A spec of a glob and what became of it: placed, or the error that kept it out.
Tried = tuple[ProbeSpec, "Placed | ProbeError"]


@dataclass(slots=True, eq=False)
class Glob:
    """A glob over the functions of a library the program has not mapped yet
    (``count -c CMD 'libc:str*'``): matched in each process of the run when that library
    comes, and each function it matches placed there (``Backend.watch``)."""

    pattern: str  # MODULE:GLOB
    to_spec: Callable[[str], ProbeSpec]  # a matched ``MODULE:NAME`` as a spec
    # Each function's fate, as it is placed: its names (aliases, the row's first), and what
    # was placed on its address or why nothing was.
    found: Callable[[tuple[str, ...], Placed | ProbeError], None]
    limit: int  # more matches than this are refused (``--max-probes``)
    matched_in: set[int] = field(default_factory=set)  # the pids it was matched in
    placed: int = 0  # functions placed (maybe by an earlier glob), in every process
    why: str | None = None  # why it placed nothing where its library came

    @property
    def module(self) -> str:
        return self.pattern.rpartition(":")[0]


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default="ptrace",
        help="ptrace: our own kprobes (handlers may change the program); uprobes: the "
        "kernel's uprobes (fast, read-only); kernel: the kernel's kprobes",
    )
    group.add_argument(
        "--kernel",
        dest="backend",
        action="store_const",
        const="kernel",
        help="probe kernel functions with the kernel's kprobes (= --backend kernel)",
    )
    parser.add_argument(
        "--no-optimize",
        action="store_true",
        help="ptrace backend: keep every probe on a breakpoint (by default a probe whose "
        "entry site allows it is a jump to code in the program: no trap per hit, a return "
        "probe's event written at the return, its $argN kept by the entry)",
    )
    parser.add_argument(
        "--follow-forks",
        action="store_true",
        help="with -p: also the processes it starts from now on (-c always follows them)",
    )


class Backend(abc.ABC):
    """A session's probes on one target; ``run`` delivers their events to the sink."""

    # Errors that skip one function of a glob (``count 'vfs_*'``) instead of ending the run.
    skippable: tuple[type[ProbeError], ...] = (ProbeRejected,)

    def __init__(self) -> None:
        self.placed: list[Placed] = []
        self.command_pid: int | None = None  # the -c command's, once started
        self._command_exit: int | None = None
        self.own_file: str | None = None  # the file a bare symbol names (README)

    def end_command(self) -> None:
        """Stop a ``-c`` command the session ended before (``-d``, ``-n``): it was started for
        this session and ends with it, as under ``bpftrace -c``. Called after ``close()``, so
        it has no probe left in it. SIGTERM, then SIGKILL if it lingers; reaped either way."""
        pid, self.command_pid = self.command_pid, None
        if pid is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:  # it had exited by itself: now reaped
                    if sig == signal.SIGTERM:
                        self._command_exit = os.waitstatus_to_exitcode(status)
                    return
                os.kill(pid, sig)
            except (ChildProcessError, ProcessLookupError):
                return  # reaped already (the ptrace backend saw it exit)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG) != (0, 0):
                        return
                time.sleep(0.01)

    @property
    def command_exit(self) -> int | None:
        """How the ``-c`` command ended, if it ended by itself and has been reaped: its exit
        code, or minus the signal that killed it."""
        return self._command_exit

    @abc.abstractmethod
    def place(self, specs: Sequence[ProbeSpec]) -> list[Placed]:
        """Place every spec, or none (a failure removes the ones already placed)."""

    def place_each(self, specs: Sequence[ProbeSpec]) -> Generator[Tried, None, None]:
        """Place each spec on its own (a glob's functions), in order: each comes back with
        what was placed, or with the ``skippable`` error that kept it out. Stop iterating
        (and close the iterator) to stop placing."""
        for spec in specs:
            yield self._try_place(spec)

    def _try_place(self, spec: ProbeSpec) -> Tried:
        try:
            (placed,) = self.place([spec])
        except self.skippable as exc:
            return spec, exc
        return spec, placed

    @abc.abstractmethod
    def functions(self, pattern: str) -> list[tuple[str, ...]]:
        """The functions matching ``[MOD:]GLOB``, each as its locations (``lib:name``,
        ``name``): the names of one address, the row's first (symbols/aliases.py)."""

    @abc.abstractmethod
    def run(self, timeout: float | None) -> bool:
        """Deliver events for up to ``timeout`` seconds; True once the target is finished."""

    @abc.abstractmethod
    def close(self) -> None:
        """Remove every probe; a ``-p`` process carries on."""

    @property
    def dropped(self) -> int:
        """Events lost before they could be read (a full ring buffer)."""
        return 0

    def placement_notes(self) -> list[tuple[str, str]]:
        """Probes that asked for a jump and keep their breakpoint: (name, why)."""
        return []

    def never_placed(self) -> list[tuple[str, str]]:
        """After the run: the probes never placed in any process, each with why (name, why)."""
        return []

    def watch(self, glob: Glob) -> bool:
        """Match ``glob`` in its library when the program maps it; False: this backend does
        not wait for libraries (its module must be there now)."""
        return False

    @property
    def watched(self) -> list[Glob]:
        """The globs ``watch`` took."""
        return []

    def how_it_ended(self) -> str:
        """A line for a traced program that a signal killed while we traced it, else ""."""
        return ""

    @property
    def event_clock(self) -> int:
        """The POSIX clock of the events' ``timestamp`` (``wallclock.py``): our own
        backend's is CLOCK_MONOTONIC (``time.monotonic()``, and the TSC turned into it)."""
        return time.CLOCK_MONOTONIC

    def left_behind(self) -> list[str]:
        """After ``close``: what stays in the program and why (one line each)."""
        return []

    @property
    def unread(self) -> int:
        """Events the probes recorded that were never read: the run ended first."""
        return 0

    def stop(self) -> None:  # noqa: B027 - the kernel's: removed with the session
        """Disable every probe (the first step of every ending): the program stops making
        events, so that what is left to read is what was made before the end."""

    def set_reading_deadline(self, when: float | None) -> None:  # noqa: B027
        """Reads of events stop at ``when`` (``time.monotonic()``) and go on at the next
        ``run()``: a reader that lags still returns on time."""

    def read_rest(self, until: float) -> None:  # noqa: B027 - most have no backlog
        """Once stopped: deliver what is left to read until ``until``, then release the
        rest unread (counted in ``unread``)."""

    def discard_backlog(self) -> None:  # noqa: B027 - most have none
        """The run ended early (SIGINT, ``-n``): events not read yet are not wanted."""

    def end_run(self, exc: BaseException) -> None:  # noqa: B027 - most need nothing
        """Make ``run()`` raise ``exc`` at its next safe point (``sigint.py``); the kernel's
        probes need none: an exception anywhere leaves them whole."""

    def is_mid_hit(self) -> bool:
        """Could an exception raised now cut a stop of the program in two? (``sigint.py``)"""
        return False
