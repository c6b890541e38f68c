"""The kernel's uprobes and kprobes as a backend of the tracing commands, through tracefs
(``kprobes.Uprobes``/``kprobes.Kernel``): ``--backend uprobes`` and ``--kernel``. How a
session picks its backend is in backends.py.

``-p A,B`` is the instance's pid filter holding every one of them (``pids=``): the kernel
records only their tasks, and the run ends when all have exited. On the uprobes backend the
probes' places are read in the first process's files (a uprobe hangs on a file: the others
hit it where they map the same file; a function of another program is named by its path).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import time
from collections.abc import Sequence

from kprobes.cli.backends import UPROBES_BUFFER_KB, Backend, Placed, Sink
from kprobes.cli.notes import Progress
from kprobes.cli.targets import command_argv
from kprobes.cli.wallclock import trace_clock_id
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeError, ProbeRejected, SpecError, TargetError, TraceFsError
from kprobes.linux.perf import Counter
from kprobes.process.launch import spawn
from kprobes.process.target import Process
from kprobes.spec import FileOffsetLocation, ProbeSpec, SymbolLocation
from kprobes.tracefs.kernel import Kernel
from kprobes.tracefs.target import TraceTarget
from kprobes.tracefs.uprobes import Uprobes
from kprobes.values import dataclass, field


@dataclass(slots=True)
class TracePlaced:
    """One spec placed as a kernel probe event."""

    spec: ProbeSpec
    probe: Kprobe | Kretprobe
    event: str
    target: TraceTarget
    # Counted by the kernel (``count`` of every process that runs the file): perf counters
    # on the event, which is not enabled (no record is written); ``counted`` keeps their
    # sum once the run has ended (``stop_counting``).
    counters: list[Counter] = field(default_factory=list)
    counted: int | None = None

    @property
    def name(self) -> str:
        return self.event

    @property
    def counts_in_place(self) -> bool:
        """It makes no events: its hits are the count (``count`` reads them)."""
        return bool(self.counters) or self.counted is not None

    @property
    def hits(self) -> int:
        """The hits of the processes traced: the kernel's counters' (every process that
        runs the file); with ``-p``/``-c`` on uprobes, those recorded for them; otherwise
        the kernel's count in its profile."""
        if self.counted is not None:
            return self.counted
        if self.counters:
            return sum(c.read() for c in self.counters)
        target = self.target
        if isinstance(target, Uprobes) and target.pid is not None:
            return target.recorded_hits(self.event.rpartition("/")[2])
        return self.probe.nhit

    def stop_counting(self) -> None:
        """The counters disabled and their sum kept: the count is final (cheap)."""
        if self.counters and self.counted is None:
            with contextlib.suppress(OSError):
                for counter in self.counters:
                    counter.disable()
                self.counted = sum(c.read() for c in self.counters)

    def release(self) -> None:
        """The counters closed (an event counted cannot be removed; slow, perf.py)."""
        self.stop_counting()
        for counter in self.counters:
            counter.close()
        self.counters.clear()

    @property
    def missed(self) -> int:
        return self.probe.nmissed


# Pages of the kernel's ring read per CPU at a time: a batch is printed whole before the
# clock is looked at again, and 16 pages (~1,000 events) print in well under the
# ``READ_AFTER_END`` an ending allows; 256 (the library's default) took seconds to print, so
# ``-d`` and the signals ended a lagging run late on the kernel's backends.
PAGES_PER_READ = 16


class TraceFsBackend(Backend):
    """The kernel's uprobes or kprobes, through tracefs (``kprobes.Uprobes``/``Kernel``)."""

    skippable = (ProbeRejected, TraceFsError)

    def __init__(
        self,
        args: argparse.Namespace,
        sink: Sink,
        specs: Sequence[ProbeSpec],
        *,
        entry_times: bool = False,
        patterns: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.entry_times = entry_times
        self._unread = 0
        # Only hits wanted, of every process that runs the file: the kernel counts them
        # (kprobes/linux/perf.py). Those of some processes (-p, -c) are told apart by events:
        # a counter that follows a process and its children loses hits (docs/decisions.md).
        self._in_kernel = (
            getattr(args, "count_only", False) and args.pids is None and args.command is None
        )
        self._spawned: Process | None = None
        group = _group_of(specs)
        self.target: TraceTarget
        if args.backend == "uprobes":
            self.target = uprobes = self._open_uprobes(args, specs, patterns, sink, group)
            uprobes.pages_per_read = PAGES_PER_READ
            self.own_file = uprobes.main_file
            if args.command is not None:
                self.command_pid = self.target.pid
            return
        pids: list[int] = args.pids or []
        if args.command is not None:
            Kernel.require()  # before the command starts: refused, it never runs
            self._spawned = spawn(command_argv(args))
            pids = [self._spawned.pid]
            self.command_pid = self._spawned.pid
        try:
            self.target = Kernel(pids=pids, group=group, sink=sink)
            self.target.pages_per_read = PAGES_PER_READ
        except BaseException:
            self._detach_spawned()
            raise

    @staticmethod
    def _open_uprobes(
        args: argparse.Namespace,
        specs: Sequence[ProbeSpec],
        patterns: Sequence[str],
        sink: Sink,
        group: str | None,
    ) -> Uprobes:
        # trace --stack, stackcount: the kernel's userstacktrace (cli/stack_options.py).
        depth: int | None = args.stack_depth if getattr(args, "stack", False) else None
        if args.command is not None:
            return Uprobes(
                command=command_argv(args),
                group=group,
                sink=sink,
                buffer_kb=UPROBES_BUFFER_KB,
                stack_depth=depth,
            )
        if args.pids is not None:
            return Uprobes(
                pids=args.pids,
                follow_forks=getattr(args, "follow_forks", False),
                group=group,
                sink=sink,
                buffer_kb=UPROBES_BUFFER_KB,
                stack_depth=depth,
            )
        path = _path_of(specs, patterns)
        return Uprobes(
            path=path, group=group, sink=sink, buffer_kb=UPROBES_BUFFER_KB, stack_depth=depth
        )

    def _release(self) -> None:
        """Let a ``-c`` command run on its own: the kernel probes it from now on."""
        self._detach_spawned()
        if isinstance(self.target, Uprobes):
            self.target.start()

    def _detach_spawned(self) -> None:
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            spawned.detach()

    def place(self, specs: Sequence[ProbeSpec]) -> list[Placed]:
        done: list[TracePlaced] = []
        try:
            # Placed disabled, then enabled one right after the other: the entry and return
            # probes of one command go live together, not a placing apart.
            for spec in specs:
                probe = self.target.place_spec(spec, entry_times=self.entry_times, disabled=True)
                event = self.target.get_event_name(probe) or spec.effective_event
                done.append(TracePlaced(spec, probe, f"{self.target.group}/{event}", self.target))
            for placed in done:
                if self._in_kernel and self._count(placed):
                    continue  # counted by the kernel, never enabled: no record is written
                if isinstance(placed.probe, Kretprobe):
                    self.target.enable_kretprobe(placed.probe)
                else:
                    self.target.enable_kprobe(placed.probe)
        except BaseException:
            for placed in reversed(done):
                placed.release()
                with contextlib.suppress(ProbeError):
                    if isinstance(placed.probe, Kretprobe):
                        self.target.unregister_kretprobe(placed.probe)
                    else:
                        self.target.unregister_kprobe(placed.probe)
            raise
        self.placed += done
        return list(done)

    def _count(self, placed: TracePlaced) -> bool:
        """Counters on ``placed``'s event, one per CPU; False (none left open) where the
        kernel will not count it so (no perf events, out of files)."""
        event_id = int(self.target.fs.read("events", *placed.event.split("/"), "id"))
        try:  # every process: one counter per CPU
            placed.counters += [Counter(event_id, cpu=cpu) for cpu in _online_cpus()]
        except (TraceFsError, OSError):
            for counter in placed.counters:
                counter.close()
            placed.counters.clear()
            return False
        return True

    def functions(self, pattern: str) -> list[tuple[str, ...]]:
        return self.target.function_names(pattern)

    @property
    def event_clock(self) -> int:
        """The instance's trace clock (``mono`` wherever the kernel has it: session.py)."""
        return trace_clock_id(self.target.session.trace_clock())

    def run(self, timeout: float | None) -> bool:
        self._release()  # every probe is placed once events are wanted
        return self.target.run(timeout)

    def close(self) -> None:
        try:
            self._release_counters()  # the events can go once nothing counts them
            self.target.close()
        finally:
            self._detach_spawned()

    @property
    def dropped(self) -> int:
        """The kernel's count (per-CPU stats) once the buffer is gone or while it is there."""
        return max(self.target.lost, self.target.session.lost_events(), 0)

    @property
    def unread(self) -> int:
        return self._unread

    def stop(self) -> None:
        """Every event disabled in our instance (entries and returns alike): the kernel
        records nothing more for us."""
        for counted in self._counted():
            counted.stop_counting()  # the count is final: the table is printed before close()
        # Each disable costs the kernel an RCU grace period (tens of ms): thousands take
        # minutes, said on a terminal.
        progress = Progress(len(self.placed), "removing")
        for placed in self.placed:
            progress.tick()
            probe = getattr(placed, "probe", None)
            with contextlib.suppress(ProbeError, OSError):
                if isinstance(probe, Kretprobe):
                    self.target.disable_kretprobe(probe)
                elif isinstance(probe, Kprobe):
                    self.target.disable_kprobe(probe)
        progress.done()

    def _counted(self) -> list[TracePlaced]:
        return [p for p in self.placed if isinstance(p, TracePlaced) and p.counters]

    def _release_counters(self) -> None:
        """Every counter closed, after the command said its result (``Session.report``):
        the last one of an event costs the kernel an RCU grace period."""
        counted = self._counted()
        progress = Progress(len(counted), "removing")
        for placed in counted:
            progress.tick()
            placed.release()
        progress.done()

    def read_rest(self, until: float) -> None:
        try:
            while time.monotonic() < until and self.target.poll():
                pass
            self.target.poll(final=True)  # what waited for its user stack (userstacks.py)
        finally:
            self.discard_backlog()

    def discard_backlog(self) -> None:
        """What the buffer still holds is counted (``entries`` of each CPU's stats) and
        goes with the instance at ``close()``, with what was read but not handed over."""
        if self.target.session.is_open:
            self._unread = self.target.session.unread_events() + self.target.undelivered


def _group_of(specs: Sequence[ProbeSpec]) -> str | None:
    """The one group the specs name (the session's event group), or None for our own."""
    groups = {spec.group for spec in specs if spec.group is not None}
    if len(groups) > 1:
        raise SpecError(
            "with a kernel backend every probe goes in one event group, and these name "
            f"several: {', '.join(sorted(groups))}",
            column=0,
        )
    return groups.pop() if groups else None


def _path_of(specs: Sequence[ProbeSpec], patterns: Sequence[str]) -> str:
    """The file that ``--backend uprobes`` without -p/-c probes: the one the specs name."""
    paths = {p.rpartition(":")[0] for p in patterns if p.startswith("/")}
    for spec in specs:
        match spec.location:
            case FileOffsetLocation(path=path):
                paths.add(path)
            case SymbolLocation(module=str() as module) if "/" in module:
                paths.add(module)
    if len(paths) != 1:
        raise TargetError(
            "--backend uprobes without -p or -c probes one file for every process that runs "
            "it: name it in the specs as /PATH:SYMBOL (they name "
            f"{len(paths) or 'no'} file{'s' if len(paths) != 1 else ''})",
            errno=errno.EINVAL,
        )
    return os.path.realpath(paths.pop())


def _online_cpus() -> list[int]:
    """The CPUs ``/sys/devices/system/cpu/online`` lists (``0-3,6``)."""
    with open("/sys/devices/system/cpu/online") as f:
        text = f.read().strip()
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus
