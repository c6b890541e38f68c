"""A clean end gives the program back every page of ours that no thread can be in.

A session maps pages in the program: out-of-line slots (with the return trampoline), detour
pages, one shared area per neighbourhood of optimized probes (its counters and ring, 32 MiB
of address space), the rescue's 4 MiB and the rescue's extra return records. While the tool
lives none of them may go: a thread may be inside any of them. At a clean detach
(``detach.py``) every int3 and jump is already gone and every hooked frame has its real
return address back, so nothing in the program's code leads into our pages any more; what
can still lead there is a thread itself:

- its ``rip`` inside a page (a thread let go in the middle of a detour, or of the rescue's
  hand-over of the program's own signal to its handler);
- a word above its stack pointer, to the end of the stack's mapping, inside a page: a signal
  frame whose handler has not returned (interrupted in a slot or a detour), or a return
  address on the rescue's restorer (a program's handler the rescue entered).

Each thread is looked at with its registers sent home (``look_at``), just before it is let
go, while the threads not yet let go are held. A page any thread touches is kept, with what
it needs: a detour page keeps the shared areas (its code stores into them); the rescue keeps
its records. The rest is unmapped by injected ``munmap`` calls through the last held thread
(``give_back``), before the rescue stops being the program's signal handler, so that a tool
killed during one of them leaves a thread the rescue brings home. The rescue's own mapping
goes last, once it handles no signal any more (``give_back_rescue``), by injections that go
home without it (``selfrestore.py``): its records on its own ``syscall; ret``, itself on the
program's (its stub cannot unmap the page it runs in).

Pages kept are the minimum: only the ones a thread was seen in (decisions.md, "A clean end
unmaps our pages"). Rejected: unmapping in ``Process.detach`` after the threads are gone (a
released thread can no longer be looked at, nor lent), and keeping a pool of pages for the
next session (a 4 MiB rescue and a 32 MiB area per session is what issue 17 measured).
"""

from __future__ import annotations

import contextlib
import enum
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import rescue as rescue_layout
from kprobes.errors import InternalError, TargetError
from kprobes.linux.syscalls import NR_MUNMAP
from kprobes.process.engine.threads import ThreadState
from kprobes.process.engine.tracee import TraceeKind
from kprobes.process.engine.xol import MARK_SIZE
from kprobes.process.fast.memory import AREA_NAME, PAGES_SIZE
from kprobes.process.inject import calls, selfrestore
from kprobes.symbols.maps import Mapping, read_maps
from kprobes.values import dataclass

if TYPE_CHECKING:
    from kprobes.process.engine.threads import Thread
    from kprobes.process.engine.tracer import Tracer
    from kprobes.process.fast.state import JumpState

STACK_SCAN: Final = 0x800000  # at most, bytes above a thread's stack pointer searched
AREA_PATH: Final = "/memfd:" + AREA_NAME.rstrip(b"\0").decode()
_TAG: Final = b"kprobes: left behind\0\0\0\0"  # 24 bytes, then the page's size
_STEP_MAX: Final = 20_000  # instructions stepped to leave a detour, at most


class PageKind(enum.Enum):
    SLOTS = "out-of-line slots"
    DETOURS = "detours"
    AREA = "shared area"
    TABLES = "frame tables"
    RESCUE = "rescue"
    RECORDS = "rescue records"
    LEFT_PAGES = "pages an earlier clean end left behind"
    LEFT_AREA = "a shared area an earlier session left behind"


@dataclass(frozen=True, slots=True)
class OwnPages:
    """One mapping of ours in the program."""

    start: int
    end: int
    kind: PageKind

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end


def own_pages(tracer: Tracer, jumps: JumpState) -> list[OwnPages]:
    """Every mapping this session made in the program's address space."""
    pages: list[OwnPages] = []
    if tracer.xol is not None:
        pages += [OwnPages(p.start, p.end, PageKind.SLOTS) for p in tracer.xol.pages]
    pages += [OwnPages(p.start, p.start + PAGES_SIZE, PageKind.DETOURS) for p in jumps.pages]
    pages += [OwnPages(a.addr, a.addr + a.layout.map_size, PageKind.AREA) for a in jumps.areas]
    pages += [OwnPages(s, s + n, PageKind.TABLES) for s, n in jumps.tables.regions]
    rescue = tracer.rescue
    if rescue.is_installed:
        area = rescue.area
        pages.append(OwnPages(area, area + rescue_layout.AREA_SIZE, PageKind.RESCUE))
        pages += [OwnPages(s, e, PageKind.RECORDS) for s, e in rescue.extra_record_ranges()]
    return pages


def leave_detours(tracer: Tracer, jumps: JumpState) -> None:
    """Step every held thread that is inside a detour out of it (every jump is gone: no
    thread goes in again), so that its page, and the areas, can go.

    A detour is straight code that ends in a jump back to the program's code, a few dozen
    instructions (a string capture's copy loop, a few hundred). A program in a tight loop
    through an optimized probe has a thread in one at about one stop in five here. Stepped
    one instruction at a time (``calls.step`` holds a signal that comes meanwhile
    for the detach to deliver); a fault stops the stepping, the thread stays inside and
    keeps its pages. Rejected: letting the world run a moment and stopping it again (an
    interrupt asked for at once is taken before the thread runs a single instruction).
    """
    detours = [p for p in own_pages(tracer, jumps) if p.kind is PageKind.DETOURS]
    if not detours:
        return
    for t in list(tracer.threads.values()):
        if t.state is not ThreadState.STOPPED or t.pending is not None or t.busy:
            continue
        with contextlib.suppress(TargetError, ProcessLookupError, ChildProcessError):
            for _ in range(_STEP_MAX):
                rip = t.load_regs().rip
                if not any(p.contains(rip) for p in detours):
                    break
                calls.step(t)


def mark(size: int) -> bytes:
    """The last ``MARK_SIZE`` bytes of a page of ``size`` bytes a clean end left behind."""
    return _TAG + size.to_bytes(8, "little")


def leftovers(tracer: Tracer, ours: list[OwnPages]) -> list[OwnPages]:
    """Pages earlier sessions' clean ends left behind in the program, to give back now.

    A page a clean end keeps is marked in its last bytes (``mark``; no slot and no detour
    goes there, xol.py). Adjacent anonymous mappings merge into one line of the maps, so a
    line is read from its end, page by page, as long as each ends with a mark. A shared
    area is given back only when every executable page of no file that is not ours is such
    a page: a SIGKILLed kprobes leaves unmarked detours, whose jumps may still count into
    an area (and a program's own JIT code leaves them alone too: areas stay).
    """
    main = tracer.main
    if main is None:
        return []
    found: list[OwnPages] = []
    unmarked = False
    maps = read_maps(main.pid)
    for m in maps:
        if "x" not in m.perms or m.path != "":
            continue
        for lo, hi in _outside(m.start, m.end, ours):
            while hi > lo:
                try:
                    tail = main.read(hi - MARK_SIZE, MARK_SIZE)
                except TargetError:
                    tail = b""
                size = int.from_bytes(tail[len(_TAG) :], "little") if len(tail) == 32 else 0
                if not size or tail != mark(size) or hi - size < lo:
                    unmarked = True
                    break
                found.append(OwnPages(hi - size, hi, PageKind.LEFT_PAGES))
                hi -= size
    if not unmarked:
        found += [
            OwnPages(lo, hi, PageKind.LEFT_AREA)
            for m in maps
            if m.path.startswith(AREA_PATH)
            for lo, hi in _outside(m.start, m.end, ours)
        ]
    return found


def _outside(start: int, end: int, ours: list[OwnPages]) -> list[tuple[int, int]]:
    """[start, end) less our own pages."""
    parts = [(start, end)]
    for p in ours:
        parts = [
            piece
            for lo, hi in parts
            for piece in ((lo, min(hi, p.start)), (max(lo, p.end), hi))
            if piece[0] < piece[1]
        ]
    return parts


class Unmapping:
    """What one clean end gives back: our pages, less those a thread was let go in."""

    def __init__(self, tracer: Tracer, jumps: JumpState) -> None:
        self._tracer = tracer
        self.pages = own_pages(tracer, jumps)
        with contextlib.suppress(OSError, TargetError):
            self.pages += leftovers(tracer, self.pages)
        self.kept: set[OwnPages] = set()
        self.why_kept: list[str] = []  # what kept each page: said at the end (Process.kept)
        self.unmapped: list[OwnPages] = []
        self._maps: list[Mapping] | None = None  # read once, at the first thread's look

    def look_at(self, t: Thread) -> None:
        """``t`` is held, sent home (its registers in the view), about to be let go: keep
        every page of ours its ``rip`` or a word above its stack pointer lies in.

        Threads of a followed fork child have an address space of their own (their copy of
        our pages is theirs); a vfork child runs in ours and is looked at.
        """
        if not self.pages or t.tracee.kind in (TraceeKind.FORK, TraceeKind.RELEASE):
            return
        regs = t.regs
        words = [regs.rip]
        with contextlib.suppress(TargetError, ProcessLookupError):
            top = min(self._stack_top(t, regs.rsp), regs.rsp + STACK_SCAN)
            words += t.stack_words(regs.rsp, top - (regs.rsp & ~7)).tolist()
        lo = min(p.start for p in self.pages)
        hi = max(p.end for p in self.pages)
        for k, word in enumerate(words):
            if not lo <= word < hi:
                continue
            for pages in self.pages:
                if pages.contains(word) and pages not in self.kept:
                    self.kept.add(pages)
                    where = "rip" if k == 0 else f"stack word at {(regs.rsp & ~7) + 8 * (k - 1):#x}"
                    self.why_kept.append(
                        f"{pages.kind.value} at {pages.start:#x}: thread {t.tid}'s {where} "
                        f"is {word:#x}"
                    )

    def _stack_top(self, t: Thread, sp: int) -> int:
        """The end of the mapping ``sp`` lies in: everything above ``sp`` in it is the live
        stack (signal frames, on an alternate stack too, lie there). Whole, not the
        optimizer's 64 KiB: a page unmapped under a deeper frame would be a fault."""
        if self._maps is None:
            self._maps = read_maps(t.tracee.pid)
        for m in self._maps:
            if m.start <= sp < m.end:
                return m.end
        return sp + 0x10000

    def _closure(self) -> set[OwnPages]:
        """The pages kept, with what they need: detours their areas and frame tables, the
        rescue its records (and itself while it is a signal handler of the program)."""
        kept = set(self.kept)
        kinds = {p.kind for p in kept}
        if kinds & {PageKind.DETOURS, PageKind.LEFT_PAGES}:
            needed = (PageKind.AREA, PageKind.LEFT_AREA, PageKind.TABLES)
            kept.update(p for p in self.pages if p.kind in needed)
        if self._tracer.rescue.is_active or PageKind.RESCUE in kinds:
            kept.update(p for p in self.pages if p.kind in (PageKind.RESCUE, PageKind.RECORDS))
        return kept

    def give_back(self, thread: Thread) -> None:
        """Unmap every page but the rescue's and those kept, through ``thread`` (held, sent
        home, the last one), while the rescue is still the program's SIGTRAP handler."""
        if thread.tracee is not self._tracer.main:
            return
        kept = self._closure()
        rescue = self._tracer.rescue
        for pages in self.pages:
            if pages.kind in (PageKind.SLOTS, PageKind.DETOURS) and pages in kept:
                # Step 6a: a page left behind is marked for the next session.
                thread.tracee.write(pages.end - MARK_SIZE, mark(pages.end - pages.start))
            if pages in kept or pages.kind in (PageKind.RESCUE, PageKind.RECORDS):
                continue
            self._munmap(thread, pages, on_stub=rescue.is_installed)

    def give_back_rescue(self, thread: Thread) -> None:
        """Unmap the rescue and its records once it is no signal handler of the program."""
        if thread.tracee is not self._tracer.main:
            return
        rescue = self._tracer.rescue
        if rescue.is_active and rescue.is_installed:
            self.why_kept.append(
                "the rescue: still a signal handler of the program (a thread was let go "
                "where a fetch of ours may still fault)"
            )
        if rescue.is_active or not rescue.is_installed:
            return
        kept = self._closure()
        ours = [p for p in self.pages if p.kind in (PageKind.RECORDS, PageKind.RESCUE)]
        ours.sort(key=lambda p: p.kind is PageKind.RESCUE)  # its stub serves the records
        for pages in ours:
            if pages in kept:
                return
            home = rescue.area if pages.kind is PageKind.RECORDS else 0
            self._munmap(thread, pages, on_stub=False, rescue_area=home)
        if any(p.kind is PageKind.RESCUE for p in self.unmapped):
            rescue.forget()

    def _munmap(
        self, thread: Thread, pages: OwnPages, *, on_stub: bool, rescue_area: int = 0
    ) -> None:
        """``munmap`` of ``pages`` in the program, injected on the rescue's stub, else on a
        way home (``selfrestore.py``) of the rescue's code at ``rescue_area`` or of the
        program's own, else not at all."""
        size = pages.end - pages.start
        if on_stub:
            rescue = self._tracer.rescue
            result = calls.run_syscall(thread, 0, NR_MUNMAP, pages.start, size, rescue=rescue)
        else:
            way = selfrestore.find_way_home(thread, rescue_area=rescue_area)
            if way is None:
                return
            try:
                result = selfrestore.run_syscall(thread, way, NR_MUNMAP, pages.start, size)
            except (TargetError, InternalError):
                return
        if result == 0:
            self.unmapped.append(pages)
