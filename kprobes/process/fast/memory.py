"""The optimizer's memory in the program: detour pages and the shared areas.

**Shared area.** One memfd per ±2 GiB neighbourhood of probes, created *by the program* (an
injected ``memfd_create``, ``ftruncate``, ``mmap(MAP_SHARED)``, the ring's first pages
mapped again after its end, then ``close``: no fd of ours is left in it), mapped by the tool
through ``/proc/PID/fd/N`` before the close. The program keeps its mapping when the tool
dies, so a SIGKILLed tool leaves jumps that go on counting into memory nobody reads, and
records into a ring that fills and then only counts drops: harmless. Rejected: an anonymous
mapping read through ``/proc/PID/mem`` (a syscall per read, and the ring needs a real shared
mapping).

**Detours** are cut from pages the program maps for us (``map_xol_page``, the out-of-line
pages' mapper), bump-allocated and never freed or reused while the tool is attached: a thread
may be inside one long after its probe went back to an int3. A page's first 16 bytes hold the
thread salt of its address space (record.py), rewritten in a followed fork child's copy. A
clean end unmaps them, and the areas, where no thread can be (``unmapping.py``). The area and
the detours must lie within ±2 GiB of the probe; a probe out of the area's reach stays on traps
and says so.

**The ring is faulted in before the first record goes there** (``fault_in_ring``: an
injected ``madvise(MADV_POPULATE_WRITE)``, once per area). Else the ring's first lap makes
the program fault in each page as its records reach it, about 3 µs a page here: 50 ns on
every 64-byte record, five times what the record costs once the page is in. An area that
only counts never gets its ring's 32 MiB. A kernel older than 5.14 refuses the advice; its
records fault their pages in as before. Rejected: ``MAP_POPULATE`` when the area is mapped
(every counting program would pay the ring's memory), and the tool touching the pages
through its own mapping (the program would still take a fault for each page it maps).
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.detour import DETOUR_MAX
from kprobes.arch.x86_64.record import SALT_SIZE, thread_salt
from kprobes.arch.x86_64.stackids import stride_for
from kprobes.errors import InternalError, NotRelocatable, TargetError
from kprobes.linux.syscalls import NR_CLOSE, NR_FTRUNCATE, NR_MADVISE, NR_MEMFD_CREATE, NR_MMAP
from kprobes.process.engine.xol import MARK_SIZE, REACH, candidate_addresses
from kprobes.process.fast.state import DetourPage, JumpState, SharedArea
from kprobes.process.inject import calls
from kprobes.symbols.maps import read_maps

if TYPE_CHECKING:
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.inject.program import ProgramCalls

NCOUNTERS: Final = 1024
PAGES_SIZE: Final = 0x10000  # detour pages are mapped 64 KiB at a time
AREA_NAME: Final = b"kprobes-area\0"
_MFD_CLOEXEC: Final = 1
_MAP_FIXED_NOREPLACE: Final = 0x100000
_MAP_FIXED: Final = 0x10
_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14


class DetourMemory:
    """Detour pages and shared areas in the program, for the optimizer."""

    def __init__(self, program: Attachment, injector: ProgramCalls, state: JumpState) -> None:
        self.pid = program.pid
        self._tracer = program.tracer
        self._injector = injector
        self._state = state

    def detour_page(self, near: int) -> DetourPage:
        """A page of ours within reach of ``near`` with room for the largest detour."""
        pages = self._state.pages
        for page in pages:
            if abs(page.start - near) <= REACH and page.used + DETOUR_MAX <= PAGES_SIZE - MARK_SIZE:
                return page
        pages.append(self._new_page(near, SALT_SIZE))
        return pages[-1]

    def alloc_detour(self, near: int, size: int = DETOUR_MAX) -> int:
        """A never-reused piece of an executable page of ours within reach of ``near``."""
        pages = self._state.pages
        for page in pages:
            if abs(page.start - near) <= REACH and page.used + size <= PAGES_SIZE - MARK_SIZE:
                at = page.start + page.used
                page.used += size
                return at
        pages.append(self._new_page(near, SALT_SIZE + size))
        return pages[-1].start + SALT_SIZE

    def _new_page(self, near: int, used: int) -> DetourPage:
        """Detour pages mapped by the program (and its followed fork children), with each
        address space's thread salt (record.py) in place of the page's first int3s."""
        start = self._injector.map_xol_page(near, PAGES_SIZE)
        for space in self._tracer.own_memories():
            space.write(start, thread_salt(space.number).to_bytes(SALT_SIZE, "little"))
        return DetourPage(start, used)

    def salt_of(self, addr: int) -> int:
        """The thread salt's word of the detour page ``addr`` is in."""
        for page in self._state.pages:
            if page.start <= addr < page.start + PAGES_SIZE:
                return page.start
        raise InternalError(f"{addr:#x} is in no detour page")

    def area(self, near: int, need: int = 1) -> int:
        """A shared area with ``need`` free counters within reach of ``near`` (its index),
        made by the program when there is none."""
        areas = self._state.areas
        for i, area in enumerate(areas):
            free = area.layout.ncounters - area.next_counter
            if abs(area.addr - near) <= REACH and free >= need:
                return i
        areas.append(self.make_area(near))
        return len(areas) - 1

    def fault_in_ring(self, index: int) -> None:
        """The program's pages of area ``index``'s ring (and its mirror) in, before its first
        record: once, whatever the kernel answers (an old one refuses: the records fault the
        pages in as they come)."""
        area = self._state.areas[index]
        if area.is_ring_in:
            return
        area.is_ring_in = True
        start = area.addr + area.layout.ring_offset
        size = area.layout.ring_bytes + sa.MIRROR
        with self._injector.injection_thread() as thread:
            calls.run_syscall(
                thread, 0, NR_MADVISE, start, size, _MADV_POPULATE_WRITE, rescue=self._tracer.rescue
            )

    def make_area(self, near: int) -> SharedArea:
        state = self._state
        layout = sa.AreaLayout(
            NCOUNTERS,
            state.ring_bytes // sa.SLOT,
            state.stack_ids,
            stride_for(state.stack_returns) if state.stack_ids else 0,
        )
        name = self.alloc_detour(near, 64)
        for space in self._tracer.own_memories():
            space.write(name, AREA_NAME)
        rescue = self._tracer.rescue
        with self._injector.injection_thread() as thread:
            maps = read_maps(self.pid)
            insn = self._injector.find_syscall(maps)

            def call(nr: int, *args: int) -> int:
                return calls.run_syscall(thread, insn, nr, *args, rescue=rescue)

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
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                for cand in candidate_addresses(maps, near, layout.map_size):
                    flags = mmap.MAP_SHARED | _MAP_FIXED_NOREPLACE
                    result = call(NR_MMAP, cand, layout.map_size, prot, flags, fd, 0)
                    if result == cand:
                        addr = cand
                        break
                    if result != -errno.EEXIST:  # taken meanwhile: try the next gap
                        raise TargetError(f"mmap of the shared area gave {result:#x}")
                if not addr:
                    raise NotRelocatable(f"no free address within ±2 GiB of {near:#x}")
                # The ring's first pages again after its end (shared_area.py), over the
                # part of our own mapping that lies past the end of the file.
                mirror = addr + layout.size
                flags = mmap.MAP_SHARED | _MAP_FIXED
                result = call(NR_MMAP, mirror, sa.MIRROR, prot, flags, fd, layout.ring_offset)
                if result != mirror:
                    raise TargetError(f"mmap of the ring's mirror gave {result:#x}")
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
