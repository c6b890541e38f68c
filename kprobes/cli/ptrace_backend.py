"""Our own kprobes as the tracing commands' backend (``--backend ptrace``, the default): the
processes ``-p`` names or the command ``-c`` starts, through ptrace (``kprobes.Process``).

The first process drives the others: ``-p A,B`` attaches B as a member of A's family
(``open_targets``), whose ``run()`` waits for the stops of both (a ptrace stop is reported
to the tracing thread alone: one loop must wait for every tracee, and a process left stopped
while we block in another's loop would be harmed), as it does for the followed children that
exec'd (process/following/family.py). Each process gets the specs, a bare symbol naming its
own executable, and its events carry its own pid; a spec goes in every process or in none.
How a session picks its backend is in backends.py.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Generator, Sequence
from functools import partial

from kprobes.cli.backends import Backend, Glob, Placed, Sink, Tried
from kprobes.cli.ownfile import in_own_file, own_file
from kprobes.cli.sigint import is_in_trace_stop
from kprobes.cli.targets import open_targets
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import InstancePool, Kretprobe, KretprobeInstance
from kprobes.errors import NotMapped, ProbeError
from kprobes.linux import procfs
from kprobes.process.specs import BatchOutputs, PlacedSpec, SpecTracer, StackSink
from kprobes.process.target import Process
from kprobes.spec import ProbeSpec
from kprobes.spec.render import render_location

# Seconds the program is held at a time, about, while a glob's thousands of probes are placed.
PLACING_STOP = 0.06


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


_RETURN_EVENTS_AT_TRAPS = "a return's event is made at a trap (its probe did not ask for a jump)"


class PtraceBackend(Backend):
    """Our own kprobes, through ptrace, on the processes ``-p`` names or the command ``-c``
    starts. The first process drives the others: each other ``-p`` process is a member of
    its family (``open_targets``), with specs of its own, a bare symbol naming its own
    executable; the specs go in every one of them or in none."""

    def __init__(
        self,
        args: argparse.Namespace,
        sink: Sink,
        batch: BatchOutputs | None = None,
        stack_counts: StackSink | None = None,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__()
        self.batch = batch  # the sink's events as rows, where they can be (specs.py)
        self.flush = flush  # after each poll of a process's rings
        # stackcount: hits counted by stack in the program, each stack's count to this.
        self.stack_counts = stack_counts
        self.max_stacks: int = getattr(args, "max_stacks", 0) if stack_counts else 0
        # -c follows the command and everything it starts, as perf does; -p on request.
        follow = args.command is not None or getattr(args, "follow_forks", False)
        procs = open_targets(args, follow_forks=follow)
        self.proc = procs[0]
        self._runs_command = args.command is not None
        if args.command is not None:
            self.command_pid = self.proc.pid
        self.sink = sink
        self.members: list[SpecTracer] = []  # followed children that exec'd (family.py)
        # Stacks are walked in the program where a probe takes a jump, if the command
        # allows it (``fast_stacks``), else unwound at a breakpoint (stack_options.py).
        self.stack_depth: int | None = args.stack_depth if getattr(args, "stack", False) else None
        self.fast_stacks: bool = getattr(args, "fast_stacks", False)
        self.optimize = not getattr(args, "no_optimize", False) and (
            self.stack_depth is None or self.fast_stacks
        )
        self._stacks_on_traps = False  # a return probe on traps put them all there
        self.count_only = getattr(args, "count_only", False)
        self.block = getattr(args, "block", False)  # trace --block (recording.py)
        self.durations_unit: int = getattr(args, "durations_unit", 0)
        self.retval_bits: int = getattr(args, "retval_bits", 0)
        self.linear: tuple[int, int, int] | None = getattr(args, "linear", None)
        self.attached: list[SpecTracer] = []  # the -p processes (or the -c command), in order
        try:
            for proc in procs:
                self.attached.append(self._spec_tracer(proc))
        except BaseException:
            self.proc.close()  # and the processes beside it
            for tracer in self.attached:
                tracer.close()
            raise
        self.tracer = self.attached[0]
        self.proc.family.on_new_process = self._follow
        self.own_file = own_file(self.proc.pid)
        # The specs placed in each process, by pid, a bare symbol in its own file: what a
        # followed child that execs gets (``_follow``).
        self._specs_of: dict[int, list[ProbeSpec]] = {}
        self._own_files = {proc.pid: own_file(proc.pid) for proc in procs}
        self._globs: list[Glob] = []
        self._glob_names: dict[int, set[str]] = {}  # pid -> the functions globs placed there

    def _spec_tracer(self, proc: Process) -> SpecTracer:
        proc.records.block_when_full = self.block
        proc.records.after_poll = self.flush
        return SpecTracer(
            proc,
            self.sink,
            optimize=self.optimize,
            count_only=self.count_only,
            stack_depth=self.stack_depth,
            fast_stacks=self.fast_stacks,
            durations_unit=self.durations_unit,
            retval_bits=self.retval_bits,
            linear=self.linear,
            batch=self.batch,
            stack_counts=self.stack_counts,
            max_stacks=self.max_stacks,
        )

    def place(self, specs: Sequence[ProbeSpec]) -> list[Placed]:
        """Every spec in every process, or none; what the first process placed is returned."""
        done: list[tuple[SpecTracer, list[ProbeSpec], list[Placed]]] = []
        try:
            for tracer in self.attached:
                pid = tracer.proc.pid
                mine = [in_own_file(spec, self._own_files[pid]) for spec in specs]
                done.append((tracer, mine, self._place_in(tracer, mine)))
        except BaseException:
            for tracer, _, placed in reversed(done):
                self._unplace(tracer, placed)
            raise
        for tracer, mine, _ in done:
            self._specs_of.setdefault(tracer.proc.pid, []).extend(mine)
        return done[0][2]

    def _place_in(self, tracer: SpecTracer, specs: Sequence[ProbeSpec]) -> list[Placed]:
        try:
            return self._place(tracer.proc, tracer, specs)
        except NotMapped as exc:
            if tracer.proc.pending:
                raise
            raise NotMapped(f"{exc}; --pending waits until it loads it", errno=exc.errno) from exc

    def _unplace(self, tracer: SpecTracer, placed: Sequence[Placed]) -> None:
        """Take out what ``_place`` placed in ``tracer``'s process (a rollback)."""
        ours = [p for p in tracer.placed if any(p is q for q in placed)]
        with contextlib.suppress(ProbeError, OSError):
            tracer.remove(ours)
        self.placed = [p for p in self.placed if not any(p is q for q in ours)]

    def place_each(self, specs: Sequence[ProbeSpec]) -> Generator[Tried, None, None]:
        """Each spec placed in stops of the program of about ``PLACING_STOP`` seconds each,
        as many specs a stop as the stops before took the time for: one stop for them all
        would hold a program for the seconds thousands of probes take, and one stop each
        would sweep every site each time (``Process.batch``: the jumps are made, and the
        program's counts collected, once a stop). What a stop placed is handed on after it,
        while the program runs. With several processes, each is held for its part."""
        per_spec = PLACING_STOP / 16  # a first guess; then what the stops took
        done = 0
        while done < len(specs):
            some = specs[done : done + max(1, int(PLACING_STOP / per_spec))]
            started = time.monotonic()
            with contextlib.ExitStack() as held:
                for tracer in self.attached:
                    held.enter_context(tracer.proc.batch())
                tried = [self._try_place(spec) for spec in some]
            per_spec = max((time.monotonic() - started) / len(some), 1e-4)
            done += len(some)
            yield from tried

    def _place(self, proc: Process, tracer: SpecTracer, specs: Sequence[ProbeSpec]) -> list[Placed]:
        placed = tracer.place(specs)
        self._keep_stacks_whole(proc, placed)
        for one in placed:
            # No instance is in flight yet: hits are handled only once run() is called.
            probe = one.probe
            if isinstance(probe, Kretprobe) and not one.spec.maxactive and probe.pool:
                equip = partial(proc.equip_kretprobe_instances, probe)
                probe.pool = GrowingPool(probe, probe.pool, equip)
        self.placed += placed
        return list(placed)

    def _keep_stacks_whole(self, proc: Process, placed: Sequence[PlacedSpec]) -> None:
        """Stacks walked in the program go through the frames of return probes that take a
        jump (their shadow stacks), not through those of a return probe on breakpoints (its
        real return addresses are in the tool): where one keeps its breakpoint, every probe
        of the process goes back to breakpoints, whose stacks are whole, and stderr says why
        (docs/decisions.md)."""
        if self.stack_depth is None or not self.optimize or not proc.optimization:
            return
        rps = [p.probe for p in placed if isinstance(p.probe, Kretprobe) and p.probe.addr]
        if not rps:
            return
        jumps = {entry.addr for entry in proc.list() if entry.is_optimized}
        if all(rp.optimize and rp.addr in jumps for rp in rps):
            return
        proc.optimization = False
        self._stacks_on_traps = True  # said once, here: no note per probe
        from kprobes.cli.stack_options import TIER_NOTE, WHY_TRAP_RETURNS

        sys.stderr.write(TIER_NOTE.format(why=WHY_TRAP_RETURNS))

    def _follow(self, member: Process) -> None:
        """A followed child exec'd (family.py): the specs of the process it comes from in its
        new image, its events read from its own memory and carrying its own pid; the globs
        matched in its own libraries as they come."""
        tracer = self._spec_tracer(member)
        self.members.append(tracer)
        specs = self._specs_of[self._ancestor(member.pid)]
        self._specs_of[member.pid] = specs
        self._place(member, tracer, specs)
        if self._globs:
            member.code_watchers.append(partial(self._match_globs, member, tracer))

    def _ancestor(self, pid: int) -> int:
        """The nearest process up ``pid``'s tree that has specs (an exec'd child's parent may
        be a fork child of it, which has none); the first process if none is found."""
        seen: set[int] = set()
        while pid not in self._specs_of and pid > 1 and pid not in seen:
            seen.add(pid)
            try:
                pid = int(procfs.read_status(pid).get("PPid", "0"))
            except (OSError, ValueError):
                break
        return pid if pid in self._specs_of else self.proc.pid

    def watch(self, glob: Glob) -> bool:
        if not self.proc.pending:
            return False  # -p without --pending: the library must be there now
        if not self._globs:
            for tracer in self.attached:
                tracer.proc.code_watchers.append(partial(self._match_globs, tracer.proc, tracer))
                with tracer.proc.batch():
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
        return [*(t.proc for t in self.attached), *(m.proc for m in self.members)]

    def run(self, timeout: float | None) -> bool:
        self.set_reading_deadline(None if timeout is None else time.monotonic() + timeout)
        return self.proc.run(timeout=timeout)

    @property
    def command_exit(self) -> int | None:
        return self.proc.exit_code if self._runs_command else None

    def never_placed(self) -> list[tuple[str, str]]:
        """Specs whose probe waited for its library in every process of the run: the
        library was never loaded, or came without the symbol (the reason it said then)."""
        tracers = [(t.proc, t) for t in (*self.attached, *self.members)]
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
        killed = []
        for tracer in self.attached:
            code = tracer.proc.exit_code
            if code is None or code >= 0:
                continue
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            killed.append(f"process {tracer.proc.pid} was killed by {name}")
        return "; ".join(killed)

    def left_behind(self) -> list[str]:
        return [
            f"mapping(s) of ours stay in process {proc.pid} ({'; '.join(proc.kept)}); a page "
            "a thread may still return into is given back by the next clean end"
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
            counts = self.count_only or self.durations_unit or self.retval_bits
            if proc.is_alive and (proc.records.is_recording or counts):
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
        """Probes that asked for a jump and keep their breakpoint (a return probe: its
        entry), and return probes whose events are made at traps: (name, why)."""
        if not self.optimize or self._stacks_on_traps:
            return []
        notes: dict[str, str] = {}  # one a probe, whichever process it keeps it in
        for tracer in self.attached:
            if not tracer.proc.is_alive:
                continue
            listed = {entry.addr: entry for entry in tracer.proc.list()}
            for p in tracer.placed:
                probe = p.probe
                if isinstance(probe, Kretprobe) and not probe.optimize and probe.addr:
                    notes.setdefault(p.name, _RETURN_EVENTS_AT_TRAPS)
                    continue
                if isinstance(probe, Kretprobe):
                    probe = probe.kp  # its entry takes the jump, or keeps the int3
                if isinstance(probe, Kprobe) and probe.optimize and probe.addr in listed:
                    entry = listed[probe.addr]
                    if not entry.is_optimized:
                        notes.setdefault(p.name, entry.why_not_optimized)
        return list(notes.items())

    def end_run(self, exc: BaseException) -> None:
        self.proc.end_run(exc)

    def is_mid_hit(self) -> bool:
        """A stop being handled, or a record of the rings (an exception would lose it)."""
        return any(
            proc.records.is_reading_records or proc.is_mid_stop or is_in_trace_stop(proc.pid)
            for proc in self._procs()
        )

    def close(self) -> None:
        try:
            self.proc.close()  # the processes beside it and the followed children first
        finally:
            for tracer in (*self.attached, *self.members):
                tracer.close()
