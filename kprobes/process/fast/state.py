"""What the fast tier keeps for one address space: its sites, its memory, its reader.

One ``JumpState`` per ``Process`` (a followed child that execs has its own), shared by the
tier's three parts (``memory.py``'s detour pages and areas, ``recording.py``'s reader,
``optimizer.py``'s sites) and read by the clean end (``survival/``) that gives it all back.
exec forgets it. It is also what the engine knows of the tier (``contracts.FastTier``).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.record import thread_salt
from kprobes.core.optimizer import SiteOpt
from kprobes.process.fast.lease import Lease
from kprobes.process.fast.reader import RingReader
from kprobes.process.fast.returns import ReturnStacks
from kprobes.process.fast.shield import Shield
from kprobes.values import dataclass, field

if TYPE_CHECKING:
    from kprobes.process.engine.threads import Thread
    from kprobes.process.engine.tracee import Tracee

RING_BYTES: Final = 32 << 20  # per area; faulted in once a record goes there (memory.py)


@dataclass(slots=True)
class SharedArea:
    """The program's memfd as the tool maps it, and where the program mapped it."""

    addr: int
    layout: sa.AreaLayout
    mapping: mmap.mmap
    next_counter: int = 0
    is_ring_in: bool = False  # the program's pages of the ring are faulted in (memory.py)

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
class WalkTables:
    """The frame tables of the stack walks in the program (frametables.py): the word that
    holds their directory's address, the directory last published, every mapping made."""

    cell: int = 0  # the word's address (a counter of a shared area); 0: no walk yet
    cell_area: int = 0  # that area (its index) and the word's offset in it
    cell_offset: int = 0
    # (start, end, bias, file) each, then (shadow stacks, trampolines' start and end)
    published: tuple[tuple[int | str, ...], ...] = ()
    regions: list[tuple[int, int]] = field(default_factory=list)  # (start, size), never reused

    def forget(self) -> None:
        self.cell = self.cell_area = self.cell_offset = 0
        self.published = ()
        self.regions.clear()


@dataclass(slots=True)
class JumpState:
    """What the optimizer keeps for one address space (forgotten at exec)."""

    is_enabled: bool = True  # proc.optimization
    ring_bytes: int = RING_BYTES
    waits_when_full: bool = False  # record detours wait for room (recording.py)
    # Areas made from now on hold a table of this many stack ids, each of up to
    # ``stack_returns`` return addresses (stackcount: stackcounts.py); 0: none.
    stack_ids: int = 0
    stack_returns: int = 0
    lease: Lease | None = None  # how long they may wait (lease.py), once one may
    sites: dict[int, SiteOpt] = field(default_factory=dict)
    areas: list[SharedArea] = field(default_factory=list)  # one per ±2 GiB neighbourhood
    pages: list[DetourPage] = field(default_factory=list)
    reader: RingReader | None = None  # the records of record probes (reader.py)
    shield: Shield = field(default_factory=Shield)  # pages kept from the kernel's uprobes
    returns: ReturnStacks = field(default_factory=ReturnStacks)  # return probes (returns.py)
    tables: WalkTables = field(default_factory=WalkTables)  # stack walks (frametables.py)

    def forget(self) -> None:
        """The address space was replaced (exec): nothing of ours is in it any more."""
        self.release_waiters()
        if self.reader is not None:
            self.reader.drain()
            self.reader.forget()
        self.shield.forget()
        self.returns.forget()
        self.tables.forget()
        self.sites.clear()
        self.areas.clear()
        self.pages.clear()

    def release_waiters(self) -> None:
        """No thread waits for room in a ring from now on (lease.py): the reader stops."""
        if self.lease is not None:
            self.lease.release()

    def counts(self) -> Iterator[tuple[int, int]]:
        """(site address, hits counted in the program since the last call) of every site."""
        by_area: dict[int, list[tuple[int, SiteOpt]]] = {}
        for addr, so in self.sites.items():
            if so.counter >= 0:
                by_area.setdefault(so.area, []).append((addr, so))
        for area, sites in by_area.items():
            values = sa.read_counters(self.areas[area].view, [so.counter for _, so in sites])
            for (addr, so), value in zip(sites, values, strict=True):
                if value != so.seen:
                    delta, so.seen = value - so.seen, value
                    yield addr, delta

    def unhook_returns(self, threads: Iterable[Thread]) -> None:
        """Real return addresses back in the frames of ``threads`` our trampolines hooked
        (returns.py): the threads are held, and about to be unwound or let go."""
        self.returns.unhook(threads)

    def rehook_returns(self, t: Thread, sp: int) -> None:
        """A catch block begins in held thread ``t`` at ``sp``: the frames above it that our
        trampolines hooked are hooked again (returns.py)."""
        self.returns.rehook(t, sp)

    def forget_site(self, addr: int) -> None:
        """The site at ``addr`` left the probe table: its counter goes with it."""
        self.sites.pop(addr, None)

    def fork_child(self, child: Tracee) -> None:
        """A followed fork child, held before it runs: its copy of each detour page gets its
        own thread salt, so that its records name its threads apart from its parent's."""
        salt = thread_salt(child.number).to_bytes(8, "little")
        for page in self.pages:
            child.write(page.start, salt)
