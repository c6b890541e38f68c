"""Where the tracing commands' probes go: our own kprobes, the kernel's uprobes, the kernel's
kprobes. The commands hand specs and a sink to a backend and never see which one it is.

    (default) --backend ptrace    -p PID | -c CMD      the Process target (``SpecTracer``)
              --backend uprobes   -p PID | -c CMD      ``kprobes.Uprobes(pid=...)``
              --backend uprobes   (no target)          ``Uprobes(path=...)``: every process
                                                       running the file the specs name
    --kernel (--backend kernel)   [-p PID | -c CMD]    ``kprobes.Kernel()``, ``pid=`` to keep
                                                       only that process's events

With ``-c`` and the uprobes backend the command is forked and held before its exec while the
instance's pid filter takes its pid and the probes are placed on the files it will map
(``Uprobes(command=...)``), then let go: the kernel counts it from its first instruction, and
every process it starts (``event-fork``), as perf does. Our own backend follows the same tree:
``-c`` stops the command before its first instruction, and each child that execs becomes a
process of its own with the specs placed again in its image (process/following/family.py).
``-p PID`` follows that process, and with ``--follow-forks`` the processes it starts from then
on. With ``--kernel`` the command is started stopped by the Process target (``spawn``) and released,
untraced, once the probes are placed. Either way its exit ends the session. Rejected
alternative: starting it with ``subprocess`` and registering afterwards, which misses whatever
it does first.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import os
import signal
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from kprobes.cli.ownfile import in_own_file, own_file
from kprobes.cli.sigint import is_in_trace_stop
from kprobes.cli.targets import open_target
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import InstancePool, Kretprobe, KretprobeInstance
from kprobes.errors import NotMapped, ProbeError, ProbeRejected
from kprobes.model import Event
from kprobes.process.specs import SpecTracer
from kprobes.process.target import Process
from kprobes.spec import ProbeSpec
from kprobes.spec.render import render_location

Sink = Callable[[Event], None]
BACKENDS = ("ptrace", "uprobes", "kernel")
# Per-CPU ring buffer of the uprobes backend: a program's startup makes ~100,000 libc:malloc
# and free hits in a fraction of a second, ~20 bytes each, faster than Python decodes them.
UPROBES_BUFFER_KB = 8192
# Seconds the program is held at a time, about, while a glob's thousands of probes are placed.
PLACING_STOP = 0.06


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
        help="ptrace backend: keep every probe on a breakpoint (by default an entry probe "
        "whose site allows it is a jump to code in the program: no trap per hit)",
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


# Instances a return probe of the command line may have in flight when its line gives no
# ``rN``: a frame is at least 16 bytes (return address, alignment), so an 8 MiB stack holds
# at most 2**19 frames; 2**20 covers any realistic depth over a few threads, and bounds the
# memory (~180 bytes an instance) of a function that never returns.
GROWING_MAXACTIVE = 1 << 20


class GrowingPool(InstancePool):
    """A kretprobe instance pool that makes more instances whenever none is free, twice as
    many each time, up to ``limit``: the command line's return probes when the line gives no
    ``rN``. It takes over the instances the target made at registration (``start``), before
    any call used one, and hands each new block to ``equip`` (the target's per-instance
    state: ``Process.equip_kretprobe_instances``).

    The API keeps the document's pool, ``maxactive`` instances made at registration
    (``max(10, 2 * threads)`` by default), as a program's handlers expect. The commands have
    no reason to drop calls: ``latency rec`` on a recursion 10,000 deep must count every one.
    Rejected: a large fixed ``maxactive`` (4096 made at registration costs ~10 ms and ~0.75 MB
    per probe, and a deeper recursion still loses calls).
    """

    __slots__ = ("equip", "limit", "probe")

    def __init__(
        self,
        probe: Kretprobe,
        start: InstancePool,
        equip: Callable[[list[KretprobeInstance]], None],
        limit: int = GROWING_MAXACTIVE,
    ) -> None:
        super().__init__(probe, 0)
        self.probe = probe
        self.free = start.free
        self.size = start.size
        self.equip = equip
        self.limit = limit

    def get(self) -> KretprobeInstance | None:
        free = self.free
        if free:
            return free.pop()
        if self.size >= self.limit:
            return None
        made = [
            KretprobeInstance(self.probe)
            for _ in range(min(max(self.size, 16), self.limit - self.size))
        ]
        self.equip(made)
        self.size += len(made)
        free.extend(made)
        return free.pop()


class PtraceBackend(Backend):
    """Our own kprobes on one process, through ptrace."""

    def __init__(self, args: argparse.Namespace, sink: Sink) -> None:
        super().__init__()
        # -c follows the command and everything it starts, as perf does; -p on request.
        follow = args.command is not None or getattr(args, "follow_forks", False)
        self.proc = open_target(args, follow_forks=follow)
        self._runs_command = args.command is not None
        if args.command is not None:
            self.command_pid = self.proc.pid
        self.sink = sink
        self.specs: list[ProbeSpec] = []
        self.members: list[SpecTracer] = []
        self.optimize = not getattr(args, "no_optimize", False)
        self.count_only = getattr(args, "count_only", False)
        try:
            self.tracer = self._spec_tracer(self.proc)
        except BaseException:
            self.proc.close()
            raise
        self.proc.family.on_new_process = self._follow
        self.own_file = own_file(self.proc.pid)
        self._globs: list[Glob] = []
        self._glob_names: dict[int, set[str]] = {}  # pid -> the functions globs placed there

    def _spec_tracer(self, proc: Process) -> SpecTracer:
        return SpecTracer(proc, self.sink, optimize=self.optimize, count_only=self.count_only)

    def place(self, specs: Sequence[ProbeSpec]) -> list[Placed]:
        specs = [in_own_file(spec, self.own_file) for spec in specs]
        try:
            placed = self._place(self.proc, self.tracer, specs)
        except NotMapped as exc:
            if self.proc.pending:
                raise
            raise NotMapped(f"{exc}; --pending waits until it loads it", errno=exc.errno) from exc
        self.specs += specs
        return list(placed)

    def place_each(self, specs: Sequence[ProbeSpec]) -> Generator[Tried, None, None]:
        """Each spec placed in stops of the program of about ``PLACING_STOP`` seconds each,
        as many specs a stop as the stops before took the time for: one stop for them all
        would hold a program for the seconds thousands of probes take, and one stop each
        would sweep every site each time (``Process.batch``: the jumps are made, and the
        program's counts collected, once a stop). What a stop placed is handed on after it,
        while the program runs."""
        per_spec = PLACING_STOP / 16  # a first guess; then what the stops took
        done = 0
        while done < len(specs):
            some = specs[done : done + max(1, int(PLACING_STOP / per_spec))]
            started = time.monotonic()
            with self.proc.batch():
                tried = [self._try_place(spec) for spec in some]
            per_spec = max((time.monotonic() - started) / len(some), 1e-4)
            done += len(some)
            yield from tried

    def _place(self, proc: Process, tracer: SpecTracer, specs: Sequence[ProbeSpec]) -> list[Placed]:
        placed = tracer.place(specs)
        for one in placed:
            # No instance is in flight yet: hits are handled only once run() is called.
            probe = one.probe
            if isinstance(probe, Kretprobe) and not one.spec.maxactive and probe.pool:
                equip = partial(proc.equip_kretprobe_instances, probe)
                probe.pool = GrowingPool(probe, probe.pool, equip)
        self.placed += placed
        return list(placed)

    def _follow(self, member: Process) -> None:
        """A followed child exec'd (family.py): the same specs in its new image, its events
        read from its own memory and carrying its own pid; the globs matched in its own
        libraries as they come."""
        tracer = self._spec_tracer(member)
        self.members.append(tracer)
        self._place(member, tracer, self.specs)
        if self._globs:
            member.code_watchers.append(partial(self._match_globs, member, tracer))

    def watch(self, glob: Glob) -> bool:
        if not self.proc.pending:
            return False  # -p without --pending: the library must be there now
        if not self._globs:
            self.proc.code_watchers.append(partial(self._match_globs, self.proc, self.tracer))
            with self.proc.batch():
                pass  # a stop of the program: its loader's rendezvous is watched from now on
        self._globs.append(glob)
        return True

    @property
    def watched(self) -> list[Glob]:
        return list(self._globs)

    def _match_globs(self, proc: Process, tracer: SpecTracer) -> None:
        """Code came in ``proc`` (it is stopped): each glob whose library is now mapped
        there is matched in it, once, and its functions placed, each once (a name two globs
        match: by the first). Never raises: it runs in the middle of a stop of the program
        (pending.py)."""
        taken = self._glob_names.setdefault(proc.pid, set())
        for glob in self._globs:
            if proc.pid in glob.matched_in:
                continue
            try:
                names = proc.function_names(glob.pattern)
            except NotMapped:
                continue  # not yet
            except ProbeError as exc:  # two libraries answer to the name, say
                glob.matched_in.add(proc.pid)
                glob.why = str(exc)
                continue
            glob.matched_in.add(proc.pid)
            if not names or len(names) > glob.limit:
                glob.why = (
                    f"{len(names):,} functions of {glob.module} match, more than "
                    f"--max-probes allows ({glob.limit:,})"
                    if names
                    else f"no function of {glob.module} matches"
                )
                continue
            for each in names:  # one probe on each function, named by its first name
                if not taken.isdisjoint(each):
                    glob.placed += 1  # by an earlier glob: it has its row
                    continue
                taken.update(each)
                try:
                    (placed,) = self._place(proc, tracer, [glob.to_spec(each[0])])
                except ProbeError as exc:
                    glob.found(each, exc)
                    continue
                glob.placed += 1
                glob.found(each, placed)

    def functions(self, pattern: str) -> list[tuple[str, ...]]:
        return self.proc.function_names(pattern)

    def _procs(self) -> list[Process]:
        return [self.proc, *(m.proc for m in self.members)]

    def run(self, timeout: float | None) -> bool:
        self.set_reading_deadline(None if timeout is None else time.monotonic() + timeout)
        return self.proc.run(timeout=timeout)

    @property
    def command_exit(self) -> int | None:
        return self.proc.exit_code if self._runs_command else None

    def never_placed(self) -> list[tuple[str, str]]:
        """Specs whose probe waited for its library in every process of the run: the
        library was never loaded, or came without the symbol (the reason it said then)."""
        tracers = [(self.proc, self.tracer), *((m.proc, m) for m in self.members)]
        placed_somewhere: set[int] = set()
        reasons: dict[int, str] = {}
        for proc, tracer in tracers:
            for one in tracer.placed:
                entry = one.probe.kp if isinstance(one.probe, Kretprobe) else one.probe
                if not entry.is_pending or entry.location is not None:
                    placed_somewhere.add(id(one.spec))
                elif (why := proc.get_pending_reason(entry)) is not None:
                    reasons[id(one.spec)] = why
        never = []
        for one in self.tracer.placed:
            if id(one.spec) in placed_somewhere:
                continue
            module = getattr(one.spec.location, "module", None) or "its library"
            why = reasons.get(id(one.spec), f"the program never loaded {module}")
            never.append(
                (render_location(one.spec.location) if one.spec.location else one.name, why)
            )
        for glob in self._globs:
            if not glob.placed:
                never.append((glob.pattern, glob.why or f"the program never loaded {glob.module}"))
        return never

    def how_it_ended(self) -> str:
        code = self.proc.exit_code
        if code is None or code >= 0:
            return ""
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process {self.proc.pid} was killed by {name}"

    def left_behind(self) -> list[str]:
        return [
            f"{len(proc.kept)} mapping(s) of ours stay in process {proc.pid}, given back by "
            f"the next clean end: a thread may still return into them ({'; '.join(proc.kept)})"
            for proc in self._procs()
            if proc.kept
        ]

    def set_reading_deadline(self, when: float | None) -> None:
        for proc in self._procs():
            proc.records.reading_deadline = when

    @property
    def dropped(self) -> int:
        return sum(p.dropped for p in self._procs())

    @property
    def unread(self) -> int:
        return sum(p.unread for p in self._procs())

    def stop(self) -> None:
        """Every probe disarmed in one stop of the world (jumps taken out): nothing more is
        written to the rings, and ``read_rest`` has an end; the counts of ``count`` are
        final (its table is printed before ``close()``). A process with neither has
        nothing left to read or count: its probes go at ``close()``, in one stop."""
        for proc in self._procs():
            proc.take_pending_error()  # the run is over: what was to end it is not wanted
            if proc.is_alive and (proc.records.is_recording or self.count_only):
                with contextlib.suppress(ProbeError, OSError):
                    proc.enabled = False

    def read_rest(self, until: float) -> None:
        try:
            for proc in self._procs():
                proc.records.reading_deadline = until
                proc.records.read_records()
        finally:
            self.discard_backlog()

    def discard_backlog(self) -> None:
        for proc in self._procs():
            proc.records.discard_records()

    def placement_notes(self) -> list[tuple[str, str]]:
        """Entry probes that asked for a jump and keep their breakpoint: (name, why)."""
        if not self.optimize:
            return []
        listed = {entry.addr: entry for entry in self.proc.list()}
        notes = []
        for p in self.placed:
            probe = getattr(p, "probe", None)
            if isinstance(probe, Kprobe) and probe.optimize and probe.addr in listed:
                entry = listed[probe.addr]
                if not entry.is_optimized:
                    notes.append((p.name, entry.why_not_optimized))
        return notes

    def end_run(self, exc: BaseException) -> None:
        self.proc.end_run(exc)

    def is_mid_hit(self) -> bool:
        """A stop being handled, or a record of the rings (an exception would lose it)."""
        return self.proc.records.is_reading_records or is_in_trace_stop(self.proc.pid)

    def close(self) -> None:
        try:
            self.proc.close()
        finally:
            self.tracer.close()
            for member in self.members:
                member.close()
