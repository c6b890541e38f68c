"""Jump optimization in a live process: the int3 of a count probe becomes a ``jmp`` to a detour.

A probe registered with ``optimize=True`` and no handler is a *count*. It is placed as every
probe is, with an int3; then, with the world stopped (at the end of every ``batch()``), the
optimizer replaces the int3 by a 5-byte ``jmp`` to a detour (arch/x86_64/detour.py) that
increments the probe's counter in a shared area and runs the displaced instructions: no trap,
no tracer round trip. ``nhit`` is the trap hits plus the counter, read when the user can see
it (``run()`` returns, ``list()``, each ``batch()``). This is the kernel's optimizer
(kernel/kprobes.c, ``optimize_kprobe``/``unoptimize_kprobe``, arch/x86/kernel/kprobes/opt.c)
without its delayed work: our "synchronize" is the stopped world, in which we see every
thread's ``rip`` and can simply wait for the next stop when one is in the way.

**Shared area.** One memfd per program, created *by the program* (an injected
``memfd_create``, ``ftruncate``, ``mmap(MAP_SHARED)``, then ``close``: no fd of ours is left
in it), mapped by the tool through ``/proc/PID/fd/N`` before the close. The program keeps its
mapping when the tool dies, so a SIGKILLed tool leaves jumps that go on counting into memory
nobody reads: harmless. Rejected: an anonymous mapping read through ``/proc/PID/mem`` (a
syscall per read, and the ring of record probes needs a real shared mapping).

**Detours** are cut from pages the program maps for us (``_map_xol_page``, the out-of-line
pages' mapper), bump-allocated and never freed or reused: a thread may be inside one long
after its probe went back to an int3. The area and the detours must lie within ±2 GiB of the
probe; a probe out of the area's reach stays on traps and says so.

**Safety** (the kernel's rules, DESIGN.md §3): patched only while every thread is held, none
with ``rip`` strictly inside ``(A, A+len)``, none in the site's out-of-line slot (its jump back
lands inside the region) or stepping it, no other probe inside the region, and no word in the
64 KiB above any thread's stack pointer inside the region. A region holds no call, so no
return address points inside it; that word would be the ``rip`` a signal frame saved, the
handler still running, which ``rt_sigreturn`` would resume mid-jump. Rejected: unwinding
every stack (slow, and frames without unwind tables are exactly where it fails); a word that
only looks like such an address delays the jump to a later stop, no worse. A thread at ``A``
itself runs the jmp. A refused *site* (``find_region``'s ``Refusal``, a detour out of reach)
stays an int3 probe for good and ``list()`` says why; a site waiting on a thread is tried again
at the next stop of the world. Unoptimizing writes the original bytes back (then the int3 if the
probe stays a trap probe); a thread still in the detour finishes it and jumps back to
``A+len``, an instruction boundary of the original code.
"""

from __future__ import annotations

import bisect
import enum
import errno
import mmap
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.detour import DETOUR_MAX, CountAction, build_detour
from kprobes.arch.x86_64.jumpopt import Refusal, find_region
from kprobes.arch.x86_64.plan import SLOT_SIZE
from kprobes.errors import InternalError, NotRelocatable, TargetError
from kprobes.linux.syscalls import NR_CLOSE, NR_FTRUNCATE, NR_MEMFD_CREATE, NR_MMAP
from kprobes.process import inject
from kprobes.process.threads import ThreadState
from kprobes.process.xol import REACH, candidate_addresses
from kprobes.symbols.maps import read_maps

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kprobes.core.manager import ProbeManager
    from kprobes.core.table import ProbeSite
    from kprobes.process.placing import ProbeLocation
    from kprobes.process.threads import Thread
    from kprobes.process.tracer import Prepared, Tracer
    from kprobes.symbols.maps import Mapping
    from kprobes.symbols.resolve import SymbolResolver

NCOUNTERS: Final = 1024
PAGES_SIZE: Final = 0x10000  # detour pages are mapped 64 KiB at a time
STACK_SCAN: Final = 0x10000  # bytes above each thread's rsp searched for a saved rip
AREA_NAME: Final = b"kprobes-area\0"
_MFD_CLOEXEC: Final = 1
_MAP_FIXED_NOREPLACE: Final = 0x100000
_NO_FD: Final = (1 << 64) - 1


class _Threads:
    """Each held thread's rip and the sorted words above its stack pointer, read once per
    sweep and only if a site gets that far."""

    def __init__(self) -> None:
        self._seen: list[tuple[int, int, list[int]]] | None = None

    def get(self, tracer: Tracer) -> list[tuple[int, int, list[int]]]:
        if self._seen is None:
            self._seen = []
            for t in tracer.threads.values():
                if t.busy or t.state not in (ThreadState.STOPPED, ThreadState.GROUP_STOPPED):
                    continue  # in a handler (see _in_the_way), or new: not run yet
                regs = t.load_regs()
                stack = t.tracee.read_some(regs.rsp & ~7, STACK_SCAN)
                words = sorted(set(memoryview(stack[: len(stack) & ~7]).cast("Q")))
                self._seen.append((t.tid, regs.rip, words))
        return self._seen


class OptState(enum.Enum):
    """Where a site stands with jump optimization (changed only by ``SiteOpt.to``)."""

    TRAP = "trap"  # an int3 probe: not asked for, or asked and not possible now
    OPTIMIZED = "optimized"  # a jmp to a detour
    REFUSED = "refused"  # the site can never be optimized (the reason says why)


_ALLOWED: Final[dict[OptState, frozenset[OptState]]] = {
    OptState.TRAP: frozenset({OptState.TRAP, OptState.OPTIMIZED, OptState.REFUSED}),
    OptState.OPTIMIZED: frozenset({OptState.TRAP}),
    OptState.REFUSED: frozenset({OptState.REFUSED}),
}


@dataclass(slots=True)
class SiteOpt:
    """One site's optimization: its state, why it is not optimized, its counter."""

    state: OptState = OptState.TRAP
    reason: str = ""
    area: int = 0  # which shared area (JumpState.areas) holds its counter
    counter: int = -1  # index in that area, kept across unoptimize/optimize
    seen: int = 0  # the counter's value already added to the probes' nhit
    detour: int = 0  # where the current detour is (0 when not optimized)
    region_len: int = 0

    def to(self, state: OptState, reason: str = "") -> None:
        if state not in _ALLOWED[self.state]:
            raise InternalError(f"optimization: {self.state.value} -> {state.value}")
        self.state = state
        self.reason = reason


@dataclass(slots=True)
class SharedArea:
    """The program's memfd as the tool maps it, and where the program mapped it."""

    addr: int
    layout: sa.AreaLayout
    mapping: mmap.mmap
    next_counter: int = 0

    @property
    def view(self) -> memoryview:
        return memoryview(self.mapping)

    def counter_addr(self, index: int) -> int:
        return self.addr + self.layout.counter_offset(index)


@dataclass(slots=True)
class DetourPage:
    start: int
    used: int


@dataclass(slots=True)
class JumpState:
    """What the optimizer keeps for one address space (forgotten at exec)."""

    is_enabled: bool = True  # proc.optimization
    sites: dict[int, SiteOpt] = field(default_factory=dict)
    areas: list[SharedArea] = field(default_factory=list)  # one per ±2 GiB neighbourhood
    pages: list[DetourPage] = field(default_factory=list)

    def forget(self) -> None:
        """The address space was replaced (exec): nothing of ours is in it any more."""
        self.sites.clear()
        self.areas.clear()
        self.pages.clear()

    def counts(self) -> Iterator[tuple[int, int]]:
        """(site address, hits counted in the program since the last call) of every site."""
        for addr, so in self.sites.items():
            if so.counter < 0:
                continue
            value = sa.read_counter(self.areas[so.area].view, so.counter)
            if value != so.seen:
                delta, so.seen = value - so.seen, value
                yield addr, delta


def why_no_jump(site: ProbeSite, is_enabled: bool) -> str | None:
    """Why ``site`` keeps its int3 whatever its code ("" when no probe asked); None when it
    should be optimized."""
    if not any(p.optimize for p in site.probes):
        return ""
    for p in site.probes:
        if not p.optimize:
            return "another probe here did not ask for a jump"
        if p.owner is not None or p.pre_handler or p.post_handler or p.fault_handler:
            return "a probe here has a handler, which runs at a trap"
    if not site.is_armed:
        return "disabled"
    if not is_enabled:
        return "optimization is off (proc.optimization)"
    return None


class Optimizing:
    """The optimizer, for ``Process``: optimize, unoptimize, and the counts."""

    pid: int
    _tracer: Tracer
    _manager: ProbeManager

    if TYPE_CHECKING:
        from contextlib import AbstractContextManager

        def _original(self, addr: int, size: int) -> bytes: ...
        def _symbols(self) -> SymbolResolver: ...
        def _map_xol_page(self, near: int, size: int) -> int: ...
        def _find_syscall(self, maps: list[Mapping]) -> int: ...
        def _injection_thread(self) -> AbstractContextManager[Thread]: ...
        def batch(self) -> AbstractContextManager[None]: ...

    @property
    def optimization(self) -> bool:
        """The document's ``debug.kprobes-optimization`` sysctl: False puts every optimized
        probe back on its int3, True optimizes them again."""
        return self._tracer.optimizer.is_enabled

    @optimization.setter
    def optimization(self, value: bool) -> None:
        with self.batch():  # its end optimizes or unoptimizes every site
            self._tracer.optimizer.is_enabled = bool(value)

    # -- counts ----------------------------------------------------------------------------

    def _collect_counts(self) -> None:
        """Add the hits counted in the program to the probes' ``nhit``."""
        table = self._manager.table
        for addr, delta in self._tracer.optimizer.counts():
            site = table.get(addr)
            for probe in site.probes if site is not None else ():
                probe.nhit += delta

    # -- the sweep, at the end of every stop of the world --------------------------------

    def _retry_optimizing(self) -> None:
        """Stop the world once more if a site waits for a thread that was in its way (the
        kernel's optimizer retries from its delayed work; we retry when ``run()`` returns)."""
        state = self._tracer.optimizer
        for site in self._manager.table:
            so = state.sites.get(site.addr)
            is_waiting = so is not None and so.state is OptState.TRAP
            if is_waiting and why_no_jump(site, state.is_enabled) is None:
                with self.batch():
                    pass
                return

    def _optimize_sites(self) -> None:
        """Bring every site to what it should be: a jump where asked and possible, else the
        int3. The world is held here."""
        state = self._tracer.optimizer
        threads = _Threads()
        for site in list(self._manager.table):
            so = state.sites.get(site.addr)
            why = why_no_jump(site, state.is_enabled)
            if why is not None:
                if so is not None and so.state is OptState.OPTIMIZED:
                    self._unoptimize(site, rearm=site.is_armed)
                if so is not None and so.state is OptState.TRAP:
                    so.reason = why
                continue
            if so is None:
                so = state.sites[site.addr] = SiteOpt()
            if so.state is OptState.TRAP:
                self._optimize(site, so, threads)

    def _optimize(self, site: ProbeSite, so: SiteOpt, threads: _Threads) -> None:
        """Replace the site's int3 by a jump to a new count detour, or say why not."""
        assert self._tracer._stop_depth > 0, "optimizing needs the world stopped"
        addr = site.addr
        if addr not in self._tracer.breakpoints.armed:
            so.reason = "no int3 to replace"
            return
        # Step 1: the region the jump displaces, from the original code only.
        loc: ProbeLocation = site.location  # type: ignore[assignment]
        code = self._original(loc.func_start, loc.func_size) if loc.func_size > 0 else b""
        fragments = self._fragments(loc)
        region = find_region(code, loc.func_start, addr, loc.func_size, fragments=fragments)
        if isinstance(region, Refusal):
            so.to(OptState.REFUSED, region.reason)
            return
        # Step 2: what may not be there while we patch.
        why = self._in_the_way(site, region.end, threads)
        if why is not None:
            so.reason = why  # tried again at the next stop of the world
            return
        # Step 3: the counter, then the detour, written before the jump that leads to it.
        try:
            if so.counter < 0:
                so.area = self._area(addr)
                area = self._tracer.optimizer.areas[so.area]
                so.counter, area.next_counter = area.next_counter, area.next_counter + 1
                so.seen = sa.read_counter(area.view, so.counter)
            area = self._tracer.optimizer.areas[so.area]
            at = self._alloc_detour(addr)
            detour = build_detour(at, region, CountAction(area.counter_addr(so.counter)))
        except NotRelocatable as exc:
            so.to(OptState.REFUSED, f"out of reach: {exc}")
            return
        except TargetError as exc:
            so.reason = f"the program could not map the detour or the area: {exc}"
            return
        spaces = list(self._tracer.own_memories())
        for space in spaces:
            space.write(at, detour.code)
        # Step 4: the jump over the int3 and the 4 bytes after it.
        self._tracer.breakpoints.patch_jump(spaces, addr, detour.patch, region.original[:5])
        so.detour, so.region_len = at, region.length
        so.to(OptState.OPTIMIZED)

    def _fragments(self, loc: ProbeLocation) -> list[tuple[int, bytes]]:
        """The other parts of the probed function (gcc's ``foo.cold``; for a probe in a
        ``foo.cold``, ``foo``), whose jumps may enter the region from outside it."""
        module = self._symbols().get_module_at(loc.addr)
        found = None if module is None else module.image.function_at(loc.addr - module.bias)
        if module is None or found is None:
            return []
        name = found[0].name
        other = name.removesuffix(".cold") if name.endswith(".cold") else f"{name}.cold"
        out = []
        for sym in module.image.lookup_all(other):
            if sym.kind.is_function and sym.size > 0:
                start = module.bias + sym.value
                out.append((start, self._original(start, sym.size)))
        return out

    def _unoptimize(self, site: ProbeSite, *, rearm: bool) -> None:
        """Put the original bytes back, then the int3 if ``rearm``. The world is held."""
        assert self._tracer._stop_depth > 0, "unoptimizing needs the world stopped"
        so = self._tracer.optimizer.sites[site.addr]
        self._collect_counts()
        self._tracer.breakpoints.unpatch_jump(self._tracer.own_memories(), site.addr, rearm=rearm)
        so.detour = 0
        so.to(OptState.TRAP)

    def _unoptimize_around(self, addr: int) -> None:
        """A probe is being armed at ``addr``: an optimized region that covers it goes back to
        its int3 first (the kernel unoptimizes a probe whose region another probe enters)."""
        for start, so in self._tracer.optimizer.sites.items():
            if so.state is OptState.OPTIMIZED and start < addr < start + so.region_len:
                site = self._manager.table.get(start)
                if site is not None:
                    self._unoptimize(site, rearm=True)
                    so.reason = f"another probe at {addr:#x} is inside the region"

    def _in_the_way(self, site: ProbeSite, end: int, threads: _Threads) -> str | None:
        """Why the region [site.addr, end) cannot be patched now, or None."""
        addr = site.addr
        for other in self._manager.table:
            if addr < other.addr < end:
                return f"another probe at {other.addr:#x} is inside the region"
        x: Prepared | None = site.ainsn
        slot = x.slot if x is not None else 0
        for t in self._tracer.threads.values():
            # A thread in a handler: its view keeps rip at the probe it is hitting.
            if t.step_site is site or (t.busy and t.regs.rip == addr):
                return "a thread was running this probe's trap (tried again at the next stop)"
        for tid, rip, words in threads.get(self._tracer):
            if addr < rip < end or (slot and slot <= rip < slot + SLOT_SIZE):
                return f"thread {tid} was inside the region (tried again at the next stop)"
            i = bisect.bisect_right(words, addr)
            if i < len(words) and words[i] < end:
                return (
                    f"thread {tid}'s stack holds {words[i]:#x}, inside the region (a signal "
                    "frame's rip?); tried again at the next stop"
                )
        return None

    # -- memory in the program -------------------------------------------------------------

    def _alloc_detour(self, near: int, size: int = DETOUR_MAX) -> int:
        """A never-reused piece of an executable page of ours within reach of ``near``."""
        pages = self._tracer.optimizer.pages
        for page in pages:
            if abs(page.start - near) <= REACH and page.used + size <= PAGES_SIZE:
                at = page.start + page.used
                page.used += size
                return at
        start = self._map_xol_page(near, PAGES_SIZE)
        pages.append(DetourPage(start, size))
        return start

    def _area(self, near: int) -> int:
        """A shared area with a free counter within reach of ``near`` (its index), made by
        the program when there is none."""
        areas = self._tracer.optimizer.areas
        for i, area in enumerate(areas):
            if abs(area.addr - near) <= REACH and area.next_counter < area.layout.ncounters:
                return i
        areas.append(self._make_area(near))
        return len(areas) - 1

    def _make_area(self, near: int) -> SharedArea:
        layout = sa.AreaLayout(NCOUNTERS, capacity=1)
        name = self._alloc_detour(near, 64)
        for space in self._tracer.own_memories():
            space.write(name, AREA_NAME)
        rescue = self._tracer.rescue
        with self._injection_thread() as thread:
            maps = read_maps(self.pid)
            insn = self._find_syscall(maps)

            def call(nr: int, *args: int) -> int:
                return inject.run_syscall(thread, insn, nr, *args, rescue=rescue)

            # Step 1: the program makes the memfd and sizes it.
            fd = call(NR_MEMFD_CREATE, name, _MFD_CLOEXEC)
            if fd < 0:
                raise TargetError(f"memfd_create in the program failed: {os.strerror(-fd)}")
            try:
                result = call(NR_FTRUNCATE, fd, layout.size)
                if result < 0:
                    raise TargetError(f"ftruncate failed: {os.strerror(-result)}")
                # Step 2: the program maps it within reach of the probe.
                addr = 0
                for cand in candidate_addresses(maps, near, layout.size):
                    prot = mmap.PROT_READ | mmap.PROT_WRITE
                    flags = mmap.MAP_SHARED | _MAP_FIXED_NOREPLACE
                    result = call(NR_MMAP, cand, layout.size, prot, flags, fd, 0)
                    if result == cand:
                        addr = cand
                        break
                    if result != -errno.EEXIST:  # taken meanwhile: try the next gap
                        raise TargetError(f"mmap of the shared area gave {result:#x}")
                if not addr:
                    raise NotRelocatable(f"no free address within ±2 GiB of {near:#x}")
                # Step 3: the tool maps the same file, through the program's fd.
                tool_fd = os.open(f"/proc/{self.pid}/fd/{fd}", os.O_RDWR)
                try:
                    mapping = mmap.mmap(tool_fd, layout.size, mmap.MAP_SHARED)
                finally:
                    os.close(tool_fd)
            finally:
                # Step 4: nothing of ours stays in the program's fd table.
                call(NR_CLOSE, fd)
        sa.init_area(memoryview(mapping), layout)
        return SharedArea(addr, layout, mapping)

    # -- listing ---------------------------------------------------------------------------

    def _plan_of(self, site: ProbeSite) -> tuple[str, str]:
        """(plan, why not optimized) for ``list()``."""
        x: Prepared | None = site.ainsn
        plan = x.kind.value if x is not None else ""
        so = self._tracer.optimizer.sites.get(site.addr)
        if so is not None and so.state is OptState.OPTIMIZED:
            return "OPTIMIZED", ""
        why = why_no_jump(site, self._tracer.optimizer.is_enabled)
        if why is None:
            why = so.reason if so is not None and so.reason else "not yet tried"
        return plan, why
