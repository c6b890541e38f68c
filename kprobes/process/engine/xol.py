"""The out-of-line area: executable pages the program maps for us, cut into slots.

Each probed instruction gets a slot holding its relocated copy (and a jump back or an int3).
Slots must lie within ±2 GiB of the code they stand in for, so that rip-relative operands and
the ``jmp rel32`` back can be rewritten; the executable and the libraries are usually much
further apart than that, so the area is a set of pages, each mapped in a free gap next to the
code that needed it. Pages are mapped read+execute only: we write them through
/proc/PID/mem, which the program cannot do by accident.

Pages are never unmapped while the tool is attached (a thread may be inside a slot, or
return into one from a signal handler; a clean end unmaps them, ``unmapping.py``), and a
freed slot is only reused after a full stop in which no thread's ``rip`` lies in it. The
first bytes of each page are int3 instructions: the return address of calls we inject into
the program. The last ``MARK_SIZE`` bytes hold no slot: a page a clean end must leave
behind is marked there, for the next session to give back (``unmapping.py``).
"""

from __future__ import annotations

import mmap as _mmap
from collections.abc import Callable, Iterable

from kprobes.arch.x86_64.plan import SLOT_SIZE
from kprobes.errors import NotRelocatable
from kprobes.symbols.maps import Mapping
from kprobes.values import dataclass

AREA_SIZE = 0x10000
REACH = (1 << 31) - AREA_SIZE - 0x1000  # keep every slot of a page within rel32 of `near`
MMAP_MIN_ADDR = 0x10000
USER_TOP = 0x7FFFFFFFF000
TRAP_BYTES = SLOT_SIZE  # the first slot holds int3s
MARK_SIZE = 32  # a page's last bytes: no slot, room for the mark of a page left behind

PROT = _mmap.PROT_READ | _mmap.PROT_EXEC
FLAGS = _mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS | 0x100000  # MAP_FIXED_NOREPLACE


@dataclass(slots=True)
class XolPage:
    start: int
    size: int
    next_free: int  # offset of the first never-used slot

    @property
    def end(self) -> int:
        return self.start + self.size


def candidate_addresses(maps: Iterable[Mapping], near: int, size: int) -> list[int]:
    """Page-aligned starts of free gaps within reach of ``near``, nearest first."""
    spans = sorted((m.start, m.end) for m in maps)
    gaps: list[tuple[int, int]] = []
    prev_end = MMAP_MIN_ADDR
    for start, end in spans:
        if start - prev_end >= size + 0x2000:
            gaps.append((prev_end + 0x1000, start - 0x1000))
        prev_end = max(prev_end, end)
    if USER_TOP - prev_end >= size + 0x2000:
        gaps.append((prev_end + 0x1000, USER_TOP))
    out: list[int] = []
    for lo, hi in gaps:
        # the highest start below `near` and the lowest start above it, inside the gap
        below = min(hi - size, near) & ~0xFFF
        above = max(lo, near) + 0xFFF & ~0xFFF
        for cand in (below, above):
            if lo <= cand and cand + size <= hi and abs(cand - near) <= REACH:
                out.append(cand)
    return sorted(set(out), key=lambda a: abs(a - near))


class XolArea:
    """Slots in injected pages; ``mapper(hint, size)`` maps a page in the program."""

    def __init__(self, mapper: Callable[[int, int], int]) -> None:
        self._mapper = mapper
        self.pages: list[XolPage] = []
        self._quarantine: list[int] = []  # freed, not yet proven unused
        self._free: list[int] = []  # freed and proven unused
        self.lo = 0  # bounds of all pages, for a quick "is rip ours?" test
        self.hi = 0

    def contains(self, addr: int) -> bool:
        if not self.lo <= addr < self.hi:
            return False
        return any(p.start <= addr < p.end for p in self.pages)

    def page_of(self, addr: int) -> XolPage | None:
        for page in self.pages:
            if page.start <= addr < page.end:
                return page
        return None

    def trap_address(self) -> int:
        """An int3 of ours (the return address of injected calls)."""
        if not self.pages:
            raise NotRelocatable("no out-of-line page is mapped yet")
        return self.pages[0].start

    def alloc(self, near: int) -> int:
        for i, slot in enumerate(self._free):
            if abs(slot - near) <= REACH:
                return self._free.pop(i)
        for page in self.pages:
            if (
                page.next_free + SLOT_SIZE <= page.size - MARK_SIZE
                and abs(page.start - near) <= REACH
            ):
                slot = page.start + page.next_free
                page.next_free += SLOT_SIZE
                return slot
        page = self._map_page(near)
        slot = page.start + page.next_free
        page.next_free += SLOT_SIZE
        return slot

    def ensure_page(self, near: int) -> XolPage:
        for page in self.pages:
            if abs(page.start - near) <= REACH:
                return page
        return self._map_page(near)

    def release(self, slot: int) -> None:
        self._quarantine.append(slot)

    def recycle(self, rips: Iterable[int]) -> None:
        """Every thread is stopped at one of ``rips``: quarantined slots not in use are free."""
        busy = {r for r in rips if self.contains(r)}
        keep: list[int] = []
        for slot in self._quarantine:
            if any(slot <= r < slot + SLOT_SIZE for r in busy):
                keep.append(slot)
            else:
                self._free.append(slot)
        self._quarantine = keep

    @property
    def has_quarantine(self) -> bool:
        return bool(self._quarantine)

    def forget(self) -> None:
        """The address space was replaced (exec): the pages are gone with it."""
        self.pages.clear()
        self._quarantine.clear()
        self._free.clear()
        self.lo = self.hi = 0

    def _map_page(self, near: int) -> XolPage:
        start = self._mapper(near, AREA_SIZE)
        page = XolPage(start, AREA_SIZE, TRAP_BYTES)
        self.pages.append(page)
        self.lo = min(p.start for p in self.pages)
        self.hi = max(p.end for p in self.pages)
        return page
