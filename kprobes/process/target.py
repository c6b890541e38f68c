"""The Process target: Kprobes on a live process, with the mechanism run by us over ptrace.

``Process`` is what users hold: the public API of the Kprobes document (register/unregister,
single and batch; enable/disable; the ``enabled`` knob; ``list()`` in Appendix A's format;
``blacklist()``), and the core's ``ArchHooks``. It does little itself: it assembles the
parts, each a mechanism of its own that holds the others through written contracts
(``docs/decisions.md``, "process/ in rooms"), and hands each call on to the part it is for:

``Attachment`` (the program as every part sees it), ``Arming`` (the core's hooks),
``ReturnProbes`` (engine/); ``ProgramCalls`` (inject/); ``DetourMemory``, ``Recording`` and
``Optimizer`` over one ``JumpState`` (fast/); ``Following`` and the ``Family`` (following/);
``Backtraces`` (stacks.py).

``launch.py`` starts (``spawn``) or seizes (``attach``) the program and hands over a Process.
"""

from __future__ import annotations

import builtins
import errno
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kprobes.core.manager import ProbeManager
from kprobes.core.probes import Kprobe, args_given
from kprobes.core.retprobes import Jprobe, Kretprobe, KretprobeInstance
from kprobes.core.table import ProbeSite
from kprobes.errors import ProbeRejected, TargetError
from kprobes.lifetime import uninterrupted
from kprobes.model import BlacklistEntry, ProbeListing
from kprobes.process import listing
from kprobes.process.engine.arming import Arming, ProbeLocation
from kprobes.process.engine.attachment import Attachment
from kprobes.process.engine.rescue import Rescue
from kprobes.process.engine.returns import ReturnProbes
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind
from kprobes.process.engine.tracer import Tracer
from kprobes.process.fast.memory import DetourMemory
from kprobes.process.fast.optimizer import Optimizer
from kprobes.process.fast.recording import Recording
from kprobes.process.fast.state import JumpState
from kprobes.process.fetch.faults import FetchFaults
from kprobes.process.following.family import Family
from kprobes.process.following.pending import Following
from kprobes.process.inject.program import ProgramCalls
from kprobes.process.specs import LineHandler, SpecTracer
from kprobes.process.stacks import Backtraces
from kprobes.process.survival import cleanup
from kprobes.process.survival.detach import detach_all
from kprobes.process.survival.trapguard import TrapGuard
from kprobes.symbols.maps import read_maps
from kprobes.symbols.resolve import SymbolResolver


class Process:
    """A traced program. Use ``spawn()`` or ``attach()`` to get one."""

    def __init__(
        self,
        pid: int,
        *,
        follow_forks: bool = False,
        pending: bool = False,
        pin_hot_threads: bool = True,
        family: Family | None = None,
    ) -> None:
        self.pid = pid
        self.follow_forks = follow_forks
        self._manager = manager = ProbeManager(self)
        rescue = Rescue()
        tracer = Tracer(
            manager, follow_forks=follow_forks, rescue=rescue, fetch_faults=FetchFaults(rescue)
        )
        self._tracer = tracer
        tracer.placement.is_on = pin_hot_threads
        # The parts, each given what it may use of the others (the module docstring).
        self._program = program = Attachment(pid, tracer)
        self._calls = calls = ProgramCalls(program)
        tracer.trap_guard = TrapGuard(pid, lambda: calls.find_syscall(read_maps(pid)), rescue)
        self._jumps = jumps = JumpState()
        tracer.fast = jumps
        self._recording = Recording(program, calls, jumps, manager.table)
        memory = DetourMemory(program, calls, jumps)
        self._optimizer = Optimizer(
            program, calls, memory, self._recording, jumps, manager.table, self.batch
        )
        self._arming = Arming(
            program, calls, manager.table, self._optimizer, lambda: self._following.is_starting
        )
        self._returns = ReturnProbes(program, calls, manager, self.batch)
        self._following = Following(
            program,
            manager,
            self._returns,
            jumps,
            batch=self.batch,
            publish=self._publish,
            forget_image=[program.forget_image, calls.forget_image, self._arming.forget_image],
            pending=pending,
        )
        self.stacks = Backtraces(program)  # backtraces, and stacks as values (stacks.py)
        self._recording.follow_stacks(self.stacks, self._following.code_watchers)
        self.family = Family(self) if family is None else family
        tracer.on_gone = self._publish if family is None else self._member_gone
        tracer.on_child_exec = self._adopt
        self.kept: list[str] = []  # after close(): what kept pages of ours in the program
        self._lines: SpecTracer | None = None  # the probes add() placed
        self._state_file = cleanup.StateFile(
            self, lambda: self.list() if self._tracer.main is not None else []
        )
        self._is_batching = False

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def exit_code(self) -> int | None:
        """Exit status once the program exited; minus the signal number if a signal killed it."""
        return self._tracer.exit_code

    @property
    def is_alive(self) -> bool:
        return self._program.is_attached and self._tracer.is_alive

    @property
    def is_attached(self) -> bool:
        """Not closed yet (the program may have exited meanwhile: ``is_alive``)."""
        return self._program.is_attached

    @property
    def threads(self) -> list[int]:
        return sorted(self._tracer.main.threads) if self._tracer.main else []

    def run(self, timeout: float | None = None) -> bool:
        """Dispatch hits until the program exits (True) or ``timeout`` seconds pass (False)."""
        if not self._program.is_attached:
            raise TargetError(f"process {self.pid} is detached")
        self._state_file.flush()
        is_root = self.family.root is self  # members that exited have left the family
        self._tracer.is_dispatching = True
        try:
            done = self._tracer.run(timeout)
            exc = None
            for proc in [self, *(self.members if is_root else ())]:  # the members' hits too
                proc._recording.drain_rings()  # every hit handled before run() returns
                exc = exc or proc._manager.table.take_error()  # an asynchronous handler's
            if exc is not None:
                raise exc
            if not done:
                self._optimizer.retry_optimizing()
        finally:
            for proc in [self, *(self.members if is_root else ())]:
                proc._optimizer.collect_counts()
            self._tracer.is_dispatching = False
        if done:
            self._finish()
        return done

    @property
    def is_mid_stop(self) -> bool:
        """In ``run()`` and not in its wait: an exception now could lose a stop (sigint.py)."""
        return self._tracer.is_dispatching

    def end_run(self, exc: BaseException) -> None:
        """Make ``run()`` raise ``exc`` once it has finished the stop it handles: a way out
        that never leaves a thread half-way through a hit. Signal-safe; the first counts."""
        self._manager.table.park(exc)

    def take_pending_error(self) -> BaseException | None:
        """The exception ``run()`` was to raise next (``end_run``'s or a handler's), taken so
        that it is raised nowhere (a caller that left ``run()`` another way forgets it so)."""
        return self._manager.table.take_error()

    def close(self) -> None:
        """Restore every patched byte and release every thread; the program carries on.
        Idempotent, run by ``with`` on the way out; ``detach()`` is the same call."""
        if not self._program.is_attached:
            return
        # Whole, whatever signal comes (lifetime.py): cut in two by the exception of one, it
        # left our bytes in the program with nobody to answer them.
        with uninterrupted():
            try:
                if self.family.root is self:  # the members go first
                    self.family.close_members()
                    self._tracer.family.clear()
                self._recording.drain_rings()
                self._optimizer.collect_counts()
                if self._tracer.is_alive:
                    self._tracer.placement.release(list(self._tracer.threads))
                    self.kept = detach_all(self._tracer, self._jumps)
            finally:
                self._finish()
                if self._lines is not None:
                    self._lines.close()

    detach = close  # by the name ptrace gives it: the same call, kept for callers of it

    def colocate(self, cpu: int | None = None) -> int:
        """Run this tool and every thread of the program (and those to come) on one CPU,
        returned: a hit's two context switches are then not cross-CPU wake-ups, 4-10x
        dearer here (docs/performance.md). ``pin_hot_threads`` moves only the threads that
        stop often. It narrows the program to one CPU until ``close()`` gives its own back."""
        return self._tracer.placement.colocate(self._tracer.threads, cpu)

    @property
    def pin_hot_threads(self) -> bool:
        """Threads that stop more than once every 100 µs run on the tool's CPU (cpus.py), on
        by default; each gets its mask back when it slows down, when off, and at detach."""
        return self._tracer.placement.is_on

    @pin_hot_threads.setter
    def pin_hot_threads(self, value: bool) -> None:
        placement = self._tracer.placement
        placement.is_on = bool(value)
        if not value and not placement.is_colocated:
            placement.release(list(self._tracer.threads))

    def _finish(self) -> None:
        if self.family.root is self:
            self._tracer.placement.close()
        if self._program.is_attached:
            # What the program counted and recorded by itself, to the probes first (a
            # member of a family ends here without a run() of its own).
            self._recording.drain_rings()
            self._optimizer.collect_counts()
            self._program.is_attached = False
            self._recording.close()
            self._manager.mark_gone()
            cleanup.forget(self)
            self._publish()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_alive else f"exited ({self.exit_code})"
        return f"<Process {self.pid} {state}>"

    # -- memory ----------------------------------------------------------------------------

    def read(self, addr: int, size: int) -> bytes:
        return self._program.memory().read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        self._program.memory().write(addr, bytes(data))

    def read_string(self, addr: int, max_len: int = 4096) -> bytes:
        return self._program.memory().read_string(addr, max_len)

    def fetch(self, addr: int, size: int) -> bytes:
        """``read`` as the program itself could read: a page it may not read (PROT_NONE)
        is a fault here, as in the kernel's fetch-args (``read`` sees through it)."""
        return self._program.memory().read_as_program(addr, size)

    def fetch_string(self, addr: int, max_len: int = 4096) -> bytes:
        return self._program.memory().read_string(addr, max_len, as_program=True)

    # -- the Kprobes API -------------------------------------------------------------------

    def register_kprobe(self, kp: Kprobe, args: Sequence[str] = (), *, event: str = "") -> None:
        """Register ``kp``; ``args`` and ``event`` as on every target: the fetch-args and
        the name of the events its ``async_handler`` receives (else ``kp.args``, and the
        kernel's default name)."""
        self.register_kprobes([kp], {kp: args}, events={kp: event} if event else None)

    def register_kprobes(
        self,
        kps: Sequence[Kprobe],
        args: Mapping[Kprobe, Sequence[str]] | None = None,
        *,
        events: Mapping[Kprobe, str] | None = None,
    ) -> None:
        """Register every probe or none (``args``: fetch-args by probe, as ``kp.args``)."""
        given = [(kp, (args or {}).get(kp, ())) for kp in kps]
        with self._program.registering(), args_given(given):
            try:
                self._recording.equip_async(kps, events or {})
                self._manager.register_many(kps)
            except BaseException:
                self._recording.forget([kp for kp in kps if not kp.is_registered])
                raise

    def add(self, text: str, handler: LineHandler | None = None) -> Kprobe | Kretprobe:
        """Register a probe written as a probe line, as on every target (``"r:work
        ret=$retval:s64"``; a ``SpecError`` names the column). Its events, named and
        fetched as the line says, go to ``handler(kp, event)`` (a return's to
        ``handler(ri, event)``) after the fact; an entry is jump-optimized where its site
        allows. Returns the probe (unregister it as any other)."""
        if self._lines is None:
            self._lines = SpecTracer(self, lambda _event: None, optimize=True)  # no sink
        return self._lines.add(text, handler)

    def added_lines(self) -> builtins.list[tuple[Kprobe | Kretprobe, str, LineHandler | None]]:
        """The probes ``add()`` placed and still registered: (probe, line, handler)."""
        lines = self._lines.lines if self._lines is not None else []
        return [line for line in lines if line[0].is_registered]

    def unregister_kprobe(self, kp: Kprobe) -> None:
        self.unregister_kprobes([kp])

    def unregister_kprobes(self, kps: Sequence[Kprobe]) -> None:
        self._manager.unregister_many(kps)
        self._recording.forget([kp for kp in kps if not kp.is_registered])
        self.family.unregister_copies(list(kps))

    def get_event_name(self, probe: Kprobe) -> str | None:
        """The name of the events an ``async_handler`` of ``probe`` receives (None: it
        has none), as the tracefs targets name their probes' events."""
        fp = self._recording.fast_of(probe)
        return None if fp is None else fp.event

    def enable_kprobe(self, kp: Kprobe) -> None:
        self._manager.enable(kp)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self._manager.disable(kp)

    # -- return probes ---------------------------------------------------------------------

    def register_kretprobe(
        self, rp: Kretprobe, args: Sequence[str] = (), *, event: str = ""
    ) -> None:
        """Register a return probe. ``args`` and ``event`` are for the events of an
        ``async_handler`` (as ``rp.args``; the kernel's default name), refused without one."""
        with args_given([(rp, args)]):
            self.register_kretprobes([rp], events={rp: event} if event else None)

    def register_kretprobes(
        self, rps: Sequence[Kretprobe], *, events: Mapping[Kretprobe, str] | None = None
    ) -> None:
        """Register return probes; a failure rolls back the ones already registered."""
        with self._program.registering(), self._recording.returns_equipped(rps, events or {}):
            self._returns.register(rps)

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        self.unregister_kretprobes([rp])

    def unregister_kretprobes(self, rps: Sequence[Kretprobe]) -> None:
        """Unregister; every frame still hooked for them gets its real return address back."""
        with self.batch():
            for rp in rps:
                self._returns.unregister(rp)
        self._recording.forget([rp for rp in rps if not rp.is_registered])
        self.family.unregister_copies(list(rps))

    def equip_kretprobe_instances(
        self, rp: Kretprobe, instances: Sequence[KretprobeInstance]
    ) -> None:
        """Instances the pool of the registered ``rp`` made since (pools that grow on demand)
        get their place in the rescue's return records. Callable from a handler."""
        if rp.pool is None:
            raise ProbeRejected(f"{rp!r} is not registered", errno=errno.EINVAL)
        self._returns.give_records(rp, instances)

    def enable_kretprobe(self, rp: Kretprobe) -> None:
        self._manager.enable(rp.kp)

    def disable_kretprobe(self, rp: Kretprobe) -> None:
        self._manager.disable(rp.kp)

    # -- jprobes ---------------------------------------------------------------------------

    def register_jprobe(self, jp: Jprobe) -> None:
        self.register_jprobes([jp])

    def register_jprobes(self, jps: Sequence[Jprobe]) -> None:
        """Register jprobes; a failure rolls back the ones already registered."""
        from kprobes.process.engine import jprobes  # and DWARF: only for jprobes

        tracer = self._tracer
        with self._program.registering():
            jprobes.register_jprobes(
                jps,
                self._manager,
                self._arming.resolve,
                lambda tid: tracer.threads[tid].tracee,
                self.batch,
            )

    def unregister_jprobe(self, jp: Jprobe) -> None:
        self._manager.unregister(jp.kp)

    def unregister_jprobes(self, jps: Sequence[Jprobe]) -> None:
        self._manager.unregister_many([jp.kp for jp in jps])

    def enable_jprobe(self, jp: Jprobe) -> None:
        self._manager.enable(jp.kp)

    def disable_jprobe(self, jp: Jprobe) -> None:
        self._manager.disable(jp.kp)

    @property
    def enabled(self) -> bool:
        """Appendix A's ``enabled`` knob: False disarms every probe, keeping each one's state."""
        return self._manager.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._manager.set_enabled(value)

    def list(self) -> builtins.list[ProbeListing]:
        """Appendix A's list: every probe placed here, then the pending ones (listing.py)."""
        self._optimizer.collect_counts()
        m, plan_of = self._manager, self._optimizer.plan_of
        return listing.list_probes(m.table, self.iter_pending(), plan_of, m.requested_addr)

    def blacklist(self) -> builtins.list[BlacklistEntry]:
        """What may not be probed: our own pages, and what ``add_blacklist`` added."""
        return self._arming.blacklist()

    def add_blacklist(self, start: int, end: int | None = None, reason: str = "user") -> None:
        self._arming.user_blacklist.append(BlacklistEntry(start, end or start + 1, reason))

    def symbols(self) -> SymbolResolver:
        """The program's symbols: its mapped ELF files, as this process sees them."""
        return self._program.symbols()

    def function_names(self, pattern: str) -> builtins.list[tuple[str, ...]]:
        """The functions matching ``[MODULE:]GLOB`` in the mapped files, as on the tracefs
        targets: the names of each, its aliases, row name first (``MODULE:`` kept if given)."""
        return self._program.symbols().function_names(pattern)

    def iter_probes(self) -> Iterator[Kprobe]:
        """Every probe registered here, placed or pending, not those kprobes placed itself."""
        return (p for p in self._manager.iter_probes() if not listing.is_ours(p))

    # -- the parts' own knobs, handed on ---------------------------------------------------

    @property
    def optimization(self) -> bool:
        """The document's ``debug.kprobes-optimization`` sysctl (False: every probe on int3)."""
        return self._optimizer.optimization

    @optimization.setter
    def optimization(self, value: bool) -> None:
        self._optimizer.optimization = value

    @property
    def pending(self) -> bool:
        """A probe on a library not mapped yet waits for it instead of failing with ENOENT."""
        return self._manager.allow_pending

    @pending.setter
    def pending(self, value: bool) -> None:
        self._manager.allow_pending = bool(value)

    def iter_pending(self) -> Iterator[Kprobe]:
        """The registered probes that wait for their library (never mapped, or unmapped)."""
        return self._following.iter_pending()

    def get_pending_reason(self, kp: Kprobe) -> str | None:
        """Why the pending ``kp`` was not placed in a library that came (no such symbol)."""
        return self._following.misses.get(id(kp))

    @property
    def code_watchers(self) -> builtins.list[Callable[[], None]]:
        """Called, the program stopped, each time code comes (an image, a library mapped)."""
        return self._following.code_watchers

    @property
    def on_notice(self) -> Callable[[str], None]:
        """Called with a line to say (a pending probe that stays pending...): warns by default."""
        return self._following.on_notice

    @on_notice.setter
    def on_notice(self, value: Callable[[str], None]) -> None:
        self._following.on_notice = value

    def backtrace(self, regs: Any, max_frames: int = 64) -> builtins.list[tuple[int, str]]:
        """The call stack of the thread whose registers are ``regs`` (stacks.py)."""
        return self.stacks.backtrace(regs, max_frames)

    @property
    def dropped(self) -> int:
        """Records lost to a full ring (perf's lost events): in ``nhit``, not handled."""
        return self._recording.dropped

    @property
    def unread(self) -> int:
        """Records released unread (``discard_records``): in ``nhit``, not handled."""
        return self._recording.unread

    @property
    def ring_size(self) -> int:
        """Bytes of each shared ring of records (set before the first record probe)."""
        return self._recording.ring_size

    @ring_size.setter
    def ring_size(self, value: int) -> None:
        self._recording.ring_size = value

    @property
    def records(self) -> Recording:
        """The rings' reader, for a caller that paces it (the command line's deadlines)."""
        return self._recording

    # -- the family: followed children that exec (following/family.py) ---------------------

    @property
    def root(self) -> Process:
        """The process the user holds, at the top of the family."""
        root = self.family.root
        assert isinstance(root, Process)
        return root

    @property
    def members(self) -> builtins.list[Process]:
        """(on the root) the members of the family still traced."""
        return [m for m in self.family.members if isinstance(m, Process)]

    def _land_at_exec(self, tid: int, *, hold: bool) -> Thread:
        """The main thread ``tid`` stands held at the exit of ``execve``. Spawned (``hold``),
        the image gets its probes now; adopted (family), once it is resumed (pending.py)."""
        tracer = self._tracer
        main = tracer.add_tracee(self.pid, TraceeKind.MAIN)
        thread = tracer.add_thread(main, tid, ThreadState.STOPPED, seized=hold)
        thread.event_stopped = True
        thread.exec_landing = True
        if hold:
            tracer.hold_all = True
            self._following.on_syscall_stop(thread)
        else:
            thread.trace_syscalls(True)
        return thread

    def _adopt(self, tracee: Tracee, t: Thread) -> bool:
        """A followed child of ours has exec'd (``t`` is at its exec event): it becomes a
        member of the family, with a tracer and an image of its own."""
        root = self.root
        self._tracer.drop_tracee(tracee)  # still traced by us; the member takes it over
        member = Process(tracee.pid, follow_forks=True, pending=True, family=self.family)
        member.on_notice = root.on_notice
        member._tracer.placement = root._tracer.placement  # one tool, one CPU for the family
        thread = member._land_at_exec(t.tid, hold=False)
        member._following.first_image_hook = self.family.welcome(member, root.on_notice)
        root._tracer.family.append(member._tracer)
        cleanup.remember(member)
        thread.resume()
        return True

    def _member_gone(self) -> None:
        """A member's probes are gone: it exec'd again (published anew), or it exited."""
        if self._tracer.main is None:
            self._finish()
            self.family.leave(self)
        else:
            self._publish()

    # -- ArchHooks: the core's calls, handed on to arming ---------------------------------

    def resolve(self, probe: Kprobe) -> ProbeLocation:
        return self._arming.resolve(probe)

    def check(self, probe: Kprobe, location: Any) -> None:
        self._arming.check(probe, location)

    def prepare(self, site: ProbeSite) -> None:
        self._arming.prepare(site)

    def remove(self, site: ProbeSite) -> None:
        self._arming.remove(site)

    def arm(self, site: ProbeSite) -> None:
        self._arming.arm(site)

    def disarm(self, site: ProbeSite) -> None:
        self._arming.disarm(site)

    def drop(self, site: ProbeSite) -> None:
        self._arming.drop(site)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Registrations in one stop of the world. Only the outermost batch sweeps (counts
        before, jumps and state after): each nested one did, and N probes cost O(N**2)."""
        tracer = self._tracer
        if self._is_batching or not (self._program.is_attached and tracer.main is not None):
            yield
            return
        tracer.world.stop(land_exec=True)
        self._is_batching = True
        try:
            self._optimizer.collect_counts()
            self._following.watch_loader()
            yield
            self._optimizer.optimize_sites()
        finally:
            self._is_batching = False
            tracer.world.resume()
            self._publish()

    def _publish(self) -> None:
        self._state_file.publish()
