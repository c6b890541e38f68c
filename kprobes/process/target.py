"""The Process target: Kprobes on a live process, with the mechanism run by us over ptrace.

``Process`` is what users hold. It implements the core's ``ArchHooks`` (resolve, check,
prepare, remove, arm, disarm, batch) on top of the event loop in ``tracer.py``, and the
public API of the Kprobes document: register/unregister (single and batch), enable/disable,
the ``enabled`` knob, ``list()`` in Appendix A's format, and ``blacklist()``.

``launch.py`` starts (``spawn``) or seizes (``attach``) the program and hands over a Process.
"""

from __future__ import annotations

import builtins
import errno
import functools
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from kprobes.arch.x86_64.rescue import AREA_SIZE as RESCUE_SIZE
from kprobes.arch.x86_64.rescue import RECORD_SIZE
from kprobes.core.manager import ProbeManager
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import (
    InstancePool,
    Jprobe,
    Kretprobe,
    KretprobeInstance,
    default_maxactive,
)
from kprobes.errors import (
    ProbeRejected,
    TargetError,
)
from kprobes.lifetime import uninterrupted
from kprobes.linux import procfs
from kprobes.model import BlacklistEntry, ProbeListing
from kprobes.process.engine import jprobes
from kprobes.process.engine.arming import Placing, ProbeLocation
from kprobes.process.engine.tracee import Tracee
from kprobes.process.engine.tracer import Tracer
from kprobes.process.engine.trampoline import UNWIND_DONE, UNWIND_ENTRIES, UnwindGuard
from kprobes.process.fast.memory import ProgramMemory
from kprobes.process.fast.optimizer import Optimizing
from kprobes.process.fast.recording import Recording
from kprobes.process.following.family import Family
from kprobes.process.following.pending import Following, LoaderWatch
from kprobes.process.inject.program import ProgramCalls
from kprobes.process.stacks import Backtraces
from kprobes.process.survival import cleanup
from kprobes.process.survival.detach import detach_all
from kprobes.process.survival.trapguard import TrapGuard
from kprobes.symbols.maps import read_maps
from kprobes.symbols.resolve import SymbolResolver

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _says_when_gone(
    method: Callable[Concatenate[Process, _P], _R],
) -> Callable[Concatenate[Process, _P], _R]:
    """A registration that fails because the program exited meanwhile (before it, or in
    the middle, whatever step noticed) says that, in one line, as a ``TargetError``."""

    @functools.wraps(method)
    def registering(self: Process, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except (TargetError, ProcessLookupError, ChildProcessError) as exc:
            gone = self._gone()
            if gone is None or (isinstance(exc, TargetError) and str(exc) == str(gone)):
                raise
            raise gone from exc

    return registering


class Process(
    Placing, ProgramCalls, Following, Family, Optimizing, Recording, ProgramMemory, Backtraces
):
    """A traced program. Use ``spawn()`` or ``attach()`` to get one."""

    def __init__(
        self,
        pid: int,
        *,
        follow_forks: bool = False,
        pending: bool = False,
        pin_hot_threads: bool = True,
    ) -> None:
        self.pid = pid
        self.follow_forks = follow_forks
        self._manager = ProbeManager(self)
        self._tracer = Tracer(self._manager, follow_forks=follow_forks)
        self._tracer.placement.is_on = pin_hot_threads
        self._tracer.on_gone = self._publish
        self._tracer.trap_guard = TrapGuard(
            pid, lambda: self._find_syscall(read_maps(pid)), self._tracer.rescue
        )
        self._resolver: SymbolResolver | None = None
        self._user_blacklist: list[BlacklistEntry] = []
        self._boundaries: dict[int, frozenset[int]] = {}
        self._dead_int3s: dict[int, int] | None = None  # placing._left_int3s
        self._ifuncs: dict[int, int] = {}
        self._syscall_insn: int | None = None
        self._unwind_guarded: set[int] = set()
        # id(kretprobe) → where each block of its instances' rescue records starts
        self._records: dict[int, list[int]] = {}
        self._attached = True
        # After close(): what kept pages of ours in the program (a thread may still return
        # into them; the next clean end gives them back), one line each. Empty: none left.
        self.kept: list[str] = []
        self._init_following(pending=pending)
        self._init_family()

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def exit_code(self) -> int | None:
        """Exit status once the program exited; minus the signal number if a signal killed it."""
        return self._tracer.exit_code

    @property
    def is_alive(self) -> bool:
        return self._attached and self._tracer.is_alive

    @property
    def threads(self) -> list[int]:
        main = self._tracer.main
        return sorted(main.threads) if main else []

    def run(self, timeout: float | None = None) -> bool:
        """Dispatch hits until the program exits (True) or ``timeout`` seconds pass (False)."""
        if not self._attached:
            raise TargetError(f"process {self.pid} is detached")
        try:
            done = self._tracer.run(timeout)
            self._drain_rings()  # the handlers have seen every hit before run() returns
            exc = self._manager.table.take_error()  # one an asynchronous handler raised
            if exc is not None:
                raise exc
        finally:
            self._collect_counts()
        if not done:
            self._retry_optimizing()
        if done:
            self._finish()
        return done

    def end_run(self, exc: BaseException) -> None:
        """Make ``run()`` raise ``exc`` once it has finished the stop it is handling (or, if
        it is waiting, the next one): a way out of ``run()`` that never leaves a thread
        half-way through a hit, as an exception raised at a random point (by a signal
        handler, say) can. Callable from a signal handler; the first request counts."""
        self._manager.table.park(exc)

    def take_pending_error(self) -> BaseException | None:
        """The exception ``run()`` was to raise next (``end_run``'s, or a handler's) and
        has not: taken, so that it is raised nowhere. A caller that left ``run()`` another
        way (a signal) and reads the rest with ``read_records`` forgets it so."""
        return self._manager.table.take_error()

    def close(self) -> None:
        """Restore every patched byte and release every thread; the program carries on.

        The ending of every target (``Uprobes`` and ``Kernel`` close their sessions so);
        idempotent, and run by ``with`` on the way out. ``detach()`` is the same call."""
        if not self._attached:
            return
        # Whole, whatever signal comes (lifetime.py): cut in two by the exception of one, it
        # left our bytes in the program with nobody to answer them.
        with uninterrupted():
            try:
                self._detach_members()
                self._drain_rings()
                self._collect_counts()
                if self._tracer.is_alive:
                    self._tracer.placement.release(list(self._tracer.threads))
                    self.kept = detach_all(self._tracer)
            finally:
                self._finish()

    def detach(self) -> None:
        """``close()``, by the name ptrace gives it: the same call, kept for callers of it."""
        self.close()

    def colocate(self, cpu: int | None = None) -> int:
        """Run this tool and every thread of the program on one CPU; returns that CPU.

        Every hit is two context switches between the program and the tracer. On one CPU they
        are plain switches; on two CPUs each is a cross-CPU wake-up, which costs 4-10x more on
        these machines (see docs/performance.md). By default only the threads that stop often
        are moved to the tool's CPU (``pin_hot_threads``); this moves every thread, and the
        threads created from now on, whatever their pace. The program's own affinity is
        restored by ``close()``. It does narrow a multi-threaded program to one CPU.
        """
        return self._tracer.placement.colocate(self._tracer.threads, cpu)

    @property
    def pin_hot_threads(self) -> bool:
        """Move a thread whose stops come faster than one every 100 µs onto the tool's CPU,
        and the tool onto one CPU (cpus.py): on by default. Each thread gets its own CPU
        mask back when its stops slow down, when this is turned off, and at detach."""
        return self._tracer.placement.is_on

    @pin_hot_threads.setter
    def pin_hot_threads(self, value: bool) -> None:
        placement = self._tracer.placement
        placement.is_on = bool(value)
        if not value and not placement.is_colocated:
            placement.release(list(self._tracer.threads))

    def _finish(self) -> None:
        if self._root is None:
            self._tracer.placement.close()
        if self._attached:
            # What the program counted and recorded by itself, to the probes first (a
            # member of a family ends here without a run() of its own).
            self._drain_rings()
            self._collect_counts()
            self._attached = False
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

    def _memory(self) -> Tracee:
        main = self._tracer.main
        if main is None or not self._attached:
            raise TargetError(f"process {self.pid} is not traced any more")
        return main

    def read(self, addr: int, size: int) -> bytes:
        return self._memory().read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        self._memory().write(addr, bytes(data))

    def read_string(self, addr: int, max_len: int = 4096) -> bytes:
        return self._memory().read_string(addr, max_len)

    def fetch(self, addr: int, size: int) -> bytes:
        """``read`` as the program itself could read: a page it may not read (PROT_NONE)
        is a fault here, as in the kernel's fetch-args (``read`` sees through it)."""
        return self._memory().read_as_program(addr, size)

    def fetch_string(self, addr: int, max_len: int = 4096) -> bytes:
        return self._memory().read_string(addr, max_len, as_program=True)

    # -- the Kprobes API -------------------------------------------------------------------

    @_says_when_gone
    def register_kprobe(self, kp: Kprobe) -> None:
        self._require_attached()
        self._equip_async([kp])
        self._manager.register(kp)

    @_says_when_gone
    def register_kprobes(self, kps: Sequence[Kprobe]) -> None:
        self._require_attached()
        self._equip_async(kps)
        self._manager.register_many(kps)

    def unregister_kprobe(self, kp: Kprobe) -> None:
        self._manager.unregister(kp)

    def unregister_kprobes(self, kps: Sequence[Kprobe]) -> None:
        self._manager.unregister_many(kps)
        self._unregister_copies(list(kps))

    def enable_kprobe(self, kp: Kprobe) -> None:
        self._manager.enable(kp)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self._manager.disable(kp)

    # -- return probes ---------------------------------------------------------------------

    def register_kretprobe(self, rp: Kretprobe) -> None:
        self.register_kretprobes([rp])

    @_says_when_gone
    def register_kretprobes(self, rps: Sequence[Kretprobe]) -> None:
        """Register return probes; a failure rolls back the ones already registered."""
        self._require_attached()
        for rp in rps:
            if rp.data_size < 0:
                raise ProbeRejected(f"data_size {rp.data_size} is negative", errno=errno.EINVAL)
            if rp.is_registered:
                raise ProbeRejected(f"{rp!r} is already registered", errno=errno.EINVAL)
        with self.batch():
            self._ensure_trampoline()
            done: list[Kretprobe] = []
            try:
                for rp in rps:
                    size = (
                        rp.maxactive if rp.maxactive > 0 else default_maxactive(len(self.threads))
                    )
                    rp.pool = InstancePool(rp, size)
                    self._give_records(rp, rp.pool.free)
                    rp.kp.pre_handler = self._tracer.trampoline.entry_handler_for(rp)
                    try:
                        self._manager.register(rp.kp)
                    except BaseException:
                        rp.pool = None
                        raise
                    rp.nmissed = rp.nabandoned = rp.nhit = 0
                    done.append(rp)
                self._ensure_unwind_guard()
            except BaseException:
                for rp in reversed(done):
                    self._unregister_kretprobe(rp)
                raise

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        self.unregister_kretprobes([rp])

    def unregister_kretprobes(self, rps: Sequence[Kretprobe]) -> None:
        """Unregister; every frame still hooked for them gets its real return address back."""
        with self.batch():
            for rp in rps:
                self._unregister_kretprobe(rp)
        self._unregister_copies(list(rps))

    def _unregister_kretprobe(self, rp: Kretprobe) -> None:
        self._manager.unregister(rp.kp)
        if self._attached and self._tracer.main is not None:
            self._tracer.trampoline.unhook(list(self._tracer.threads.values()), rp)
        for start in self._records.pop(id(rp), ()):
            self._tracer.rescue.free_records(start)
        rp.pool = None

    def equip_kretprobe_instances(
        self, rp: Kretprobe, instances: Sequence[KretprobeInstance]
    ) -> None:
        """Instances that the pool of the registered ``rp`` made after its registration (the
        command line's pools grow on demand) get what the target keeps for each: their
        place in the rescue's return records, so that the frames they hook survive the
        tool's death as the others do. Callable from a handler."""
        if rp.pool is None:
            raise ProbeRejected(f"{rp!r} is not registered", errno=errno.EINVAL)
        self._give_records(rp, instances)

    def _give_records(self, rp: Kretprobe, instances: Sequence[KretprobeInstance]) -> None:
        """Each instance's place in the rescue's return records (``rescue.py``)."""
        start = self._tracer.rescue.alloc_records(
            self._tracer.own_memories(), len(instances), self._map_records
        )
        if not start:
            return
        self._records.setdefault(id(rp), []).append(start)
        for i, ri in enumerate(instances):
            ri.record = start + i * RECORD_SIZE

    def enable_kretprobe(self, rp: Kretprobe) -> None:
        self._manager.enable(rp.kp)

    def disable_kretprobe(self, rp: Kretprobe) -> None:
        self._manager.disable(rp.kp)

    def _ensure_trampoline(self) -> None:
        tramp = self._tracer.trampoline
        if tramp.addr:
            return
        with self._world_held():  # the slot may need a new page, mapped by the program
            self._ensure_rescue()
            xol = self._xol()
            near = xol.pages[0].start if xol.pages else self._symbols().main_module().start
            slot = xol.alloc(near)
            self._tracer.rescue.note_trampoline(self._tracer.own_memories(), slot)
            for space in self._tracer.own_memories():
                space.write(slot, b"\xcc")
            tramp.addr = slot

    def _ensure_unwind_guard(self) -> None:
        """Probe the unwinder's entry points in every module that has them (see trampoline.py)."""
        tramp = self._tracer.trampoline
        resolver = self._symbols()
        resolver.refresh()
        for module in resolver.modules():
            for name in UNWIND_ENTRIES + UNWIND_DONE:
                sym = module.image.lookup(name)
                if sym is None or not sym.kind.is_function:
                    continue
                addr = module.bias + sym.value
                if addr in self._unwind_guarded:
                    continue
                on = tramp.on_unwound if name in UNWIND_DONE else tramp.on_unwind
                kp = Kprobe(addr=addr, pre_handler=_guard_handler(on))
                kp.owner = tramp.guard
                try:
                    self._manager.register(kp)
                except ProbeRejected:
                    continue  # an instruction we cannot run out of line: no guard there
                self._unwind_guarded.add(addr)
                tramp.guard_probes.append(kp)

    # -- jprobes ---------------------------------------------------------------------------

    def register_jprobe(self, jp: Jprobe) -> None:
        self.register_jprobes([jp])

    @_says_when_gone
    def register_jprobes(self, jps: Sequence[Jprobe]) -> None:
        """Register jprobes; a failure rolls back the ones already registered."""
        self._require_attached()
        with self.batch():
            done: list[Jprobe] = []
            try:
                for jp in jps:
                    if jp.is_registered:
                        raise ProbeRejected(f"{jp!r} is already registered", errno=errno.EINVAL)
                    loc = self.resolve(jp.kp)
                    plan = jprobes.plan_jprobe(
                        jp, loc.module_path, loc.addr - loc.bias, loc.display
                    )
                    jp.kp.pre_handler = jprobes.pre_handler_for(jp, plan, self._thread_memory)
                    jp.plan = plan
                    self._manager.register(jp.kp)
                    done.append(jp)
            except BaseException:
                for jp in reversed(done):
                    self._manager.unregister(jp.kp)
                raise

    def unregister_jprobe(self, jp: Jprobe) -> None:
        self._manager.unregister(jp.kp)

    def unregister_jprobes(self, jps: Sequence[Jprobe]) -> None:
        self._manager.unregister_many([jp.kp for jp in jps])

    def enable_jprobe(self, jp: Jprobe) -> None:
        self._manager.enable(jp.kp)

    def disable_jprobe(self, jp: Jprobe) -> None:
        self._manager.disable(jp.kp)

    def _thread_memory(self, tid: int) -> Tracee:
        return self._tracer.threads[tid].tracee

    @property
    def enabled(self) -> bool:
        """Appendix A's ``enabled`` knob: False disarms every probe, keeping each one's state."""
        return self._manager.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._manager.set_enabled(value)

    def list(self) -> builtins.list[ProbeListing]:
        self._collect_counts()
        out = []
        for site in self._manager.table:
            loc: ProbeLocation = site.location  # type: ignore[assignment]
            plan, why = self._plan_of(site)
            for probe in site.probes:
                if isinstance(probe.owner, (UnwindGuard, LoaderWatch)):
                    continue
                out.append(
                    ProbeListing(
                        addr=site.addr,
                        kind=probe.kind,
                        where=loc.display,
                        module=loc.module_name,
                        is_gone=probe.is_gone,
                        is_disabled=probe.is_disabled,
                        plan=plan,
                        why_not_optimized=why,
                    )
                )
        for probe in self.iter_pending():
            if isinstance(probe.owner, UnwindGuard):
                continue
            out.append(
                ProbeListing(
                    addr=0,
                    kind=probe.kind,
                    where=probe.symbol or f"{self._manager.requested_addr(probe) or 0:#x}",
                    module="",
                    is_gone=probe.is_gone,
                    is_disabled=probe.is_disabled,
                    plan="",
                    is_pending=True,
                )
            )
        return sorted(out, key=lambda e: e.addr)

    def blacklist(self) -> builtins.list[BlacklistEntry]:
        out = list(self._user_blacklist)
        xol = self._tracer.xol
        if xol is not None:
            for page in xol.pages:
                out.append(BlacklistEntry(page.start, page.end, "kprobes out-of-line area"))
        area = self._tracer.rescue.area
        if area:
            out.append(BlacklistEntry(area, area + RESCUE_SIZE, "kprobes rescue area"))
        return out

    def add_blacklist(self, start: int, end: int | None = None, reason: str = "user") -> None:
        self._user_blacklist.append(BlacklistEntry(start, end or start + 1, reason))

    def _require_attached(self) -> None:
        if self._attached and self._tracer.main is not None:
            return
        if not self._attached and self._tracer.exit_code is None:
            raise TargetError(f"process {self.pid} was detached", errno=errno.ESRCH)
        raise self._exited()

    def _gone(self) -> TargetError | None:
        """The error for a registration the program did not wait for: it has exited
        (None while it lives, or once it was detached: that error is said as it is)."""
        if not self._attached:
            return None
        if (
            self._tracer.main is not None
            and self._tracer.exit_code is None
            and procfs.task_state(self.pid, self.pid) not in ("", "Z", "X")
        ):
            return None
        return self._exited()

    def _exited(self) -> TargetError:
        code = self._tracer.exit_code
        how = ""
        if code is not None and code >= 0:
            how = f" (exit status {code})"
        elif code is not None:
            try:
                how = f" (killed by {signal.Signals(-code).name})"
            except ValueError:
                how = f" (killed by signal {-code})"
        return TargetError(f"process {self.pid} has exited{how}", errno=errno.ESRCH)

    # -- ArchHooks (the others in arming.py) ---------------------------------------------

    @contextmanager
    def batch(self) -> Iterator[None]:
        tracer = self._tracer
        if self._attached and tracer.main is not None:
            tracer.stop_world()
            try:
                self._collect_counts()
                self._watch_loader()
                yield
                self._optimize_sites()
            finally:
                tracer.resume_world()
                self._publish()
        else:
            yield

    def _symbols(self) -> SymbolResolver:
        if self._resolver is None:
            self._resolver = SymbolResolver(self.pid)
        return self._resolver

    def _publish(self) -> None:
        cleanup.publish(self, self.list() if self._tracer.main is not None else [])


def _guard_handler(on: Callable[[Any], None]) -> Callable[[Kprobe, Any], None]:
    def pre_handler(_kp: Kprobe, regs: Any) -> None:
        on(regs)

    return pre_handler
