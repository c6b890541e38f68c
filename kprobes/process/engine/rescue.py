"""The program carries on when the tool dies: the rescue handler and the tables it reads.

SIGKILL of the tool (or the OOM killer) cannot be caught: the kernel detaches every thread
and leaves our int3 bytes, the return trampoline and the out-of-line copies in place. The
next trap would kill the program with SIGTRAP. So before the first byte is patched, the
program is given a SIGTRAP handler of ours (``arch/x86_64/rescue.c``) in a mapping of its
own, and the tool keeps in that mapping, as it goes, what the handler needs to undo each of
our traps by itself: the original byte of every breakpoint, where each stepped copy returns,
the real return address of every hooked frame, the registers of a thread borrowed by an
injection. While the tool lives the handler never runs (ptrace takes every SIGTRAP first);
its cost is one more pwrite per kretprobe entry (the record) and a few writes per
registration. A clean detach puts the program's own SIGTRAP action back.

Detour code that fetches through pointers (a record probe's ``+0(%di):string``) may fault;
while the tool lives the tracer turns such a fault into ``(fault)`` (``faults.py``), and
when it is dead the rescue must: ``activate_fetch_faults`` makes it the SIGSEGV and SIGBUS
handler as well, lazily, when the first such detour is about to go in (a program that never
gets one never sees its SIGSEGV action change), and a clean detach puts the program's own
actions back. A fault that is not one of ours goes to the program's own action, as the kernel
would have delivered it: its handler is entered, by a jump, in the frame the kernel built for
the rescue with the program's own mask, SA_NODEFER, SA_ONSTACK and SA_RESTART
(``fault_sigaction``), with its return address on the rescue's restorer (glibc's bytes, so
that unwinders go through the signal frame); SA_RESETHAND is done by the rescue; SIG_DFL is
put back and the fault happens again (a sent signal is sent again). What differs from the
program's own delivery: the restorer's address is ours; a handler the program did not mark
SA_SIGINFO finds the siginfo filled in (the kernel hands every handler its pointer on x86-64);
``sigaction()`` in the program reads back the rescue's action, not its own; and a SIGSEGV
or SIGBUS action the program sets after this replaces the rescue (decisions.md).

The rescue itself is mapped by the one injection that cannot be undone by it (an ``mmap``
through a ``syscall`` instruction borrowed from the program's code), which carries its own
way home instead: a signal frame of the thread's state that ``rt_sigreturn`` loads if the
tool dies (``selfrestore.py``). Every later injection runs on the rescue's own stub,
``syscall; int3``, so that a tool killed in the middle leaves a trap the rescue turns back
into the thread's own registers.

Rejected: a watchdog process that re-attaches when the tool dies (threads run, and trap,
between the tool's death and the watchdog's attach), and ``PTRACE_O_EXITKILL`` (kills the
program: the opposite of the promise).
"""

from __future__ import annotations

import errno
import signal
import struct
from collections.abc import Callable, Iterable

from kprobes.arch.x86_64 import rescue as layout
from kprobes.errors import TargetError
from kprobes.linux.syscalls import NR_RT_SIGACTION
from kprobes.process.engine.tracee import Tracee

_SIGSET_SIZE = 8

# run_syscall(nr, *args) -> raw result: an injected syscall in a held thread
Syscall = Callable[..., int]


class Rescue:
    """The rescue of one address space (the program's; followed fork children copy it)."""

    def __init__(self) -> None:
        self.area = 0  # 0 until installed
        self._reset()
        self.unavailable: str | None = None  # why the program could not be given it

    def _reset(self) -> None:
        self.area = 0
        self.unavailable = None
        # address → index in the breakpoint table (every address ever patched: the rescue
        # takes a trap one byte past any of them for that int3's, tracer.py reads it)
        self.noted: dict[int, int] = {}
        self._redirects: dict[int, int] = {}  # slot → index in the redirect table
        self._pages: list[tuple[int, int]] = []
        # (base, capacity, used) of each range of return records; the first is in the area
        self._ranges: list[tuple[int, int, int]] = []
        self._blocks: dict[int, int] = {}  # start → size of the record blocks in use
        self._free_records: dict[int, list[int]] = {}  # block size → free block starts
        self.seq = 0  # the order of return records (the rescue takes a slot's newest)
        self.is_fetch_faults_active = False  # the rescue is the SIGSEGV and SIGBUS handler
        self.is_trap_active = False  # the rescue is the SIGTRAP handler

    @property
    def is_installed(self) -> bool:
        return self.area != 0

    @property
    def is_active(self) -> bool:
        """The rescue is a signal handler of the program: its mapping must stay."""
        return self.is_trap_active or self.is_fetch_faults_active

    def extra_record_ranges(self) -> list[tuple[int, int]]:
        """(start, end) of the mappings of return records made past the area's own."""
        return [(base, base + cap * layout.RECORD_SIZE) for base, cap, _ in self._ranges[1:]]

    # -- install and uninstall -------------------------------------------------------------

    def install(self, spaces: Iterable[Tracee], map_area: Callable[[int], int]) -> None:
        """Map the area (``map_area(size)``) and write the code and an empty header.

        ``activate`` then makes the handler the program's: the two are apart so that the
        handler is installed by an injection that runs on the rescue's own stub.
        """
        area = map_area(layout.AREA_SIZE)
        spaces = list(spaces)
        for space in spaces:
            space.write(area, layout.code())
            space.write(area + layout.HEADER, layout.header(area))
        self.area = area
        for index, (start, end) in enumerate(self._pages):
            self._write_header(spaces, layout.H_PAGES + index * 16, layout.page_entry(start, end))
        self._write_header(spaces, layout.H_NPAGE, layout.word(len(self._pages)))
        self._ranges = [(area + layout.RECORDS, layout.RECORD_MAX, 0)]

    def activate(self, mem: Tracee, syscall: Syscall, scratch: int) -> None:
        """Make the rescue the SIGTRAP handler; the program's own action goes in the header.

        The kernel cannot write the old action into the area (it is not writable by the
        program): it goes to ``scratch``, free stack below the borrowed thread's
        (``inject.scratch_below``), and from there into the header, where the rescue reads it
        (to hand the program's own traps on) and ``deactivate`` finds it.
        """
        new_at = self.area + layout.HEADER + layout.H_NEW_ACTION
        old = sigaction(mem, syscall, scratch, signal.SIGTRAP, new_at)
        mem.write(self.area + layout.HEADER + layout.H_OLD, old)
        self.is_trap_active = True

    def activate_fetch_faults(self, mem: Tracee, syscall: Syscall, scratch: int) -> None:
        """Make the rescue the SIGSEGV and SIGBUS handler too (see the module docstring).

        Each signal in two steps, the world held: read the program's own action (the
        rescue's is made from it, ``fault_sigaction``), then set the rescue's. Both or
        neither: if the second fails, the first is put back.
        """
        if not self.area or self.is_fetch_faults_active:
            return
        base = self.area + layout.HEADER
        taken: list[int] = []
        try:
            for index, sig in enumerate(layout.FAULT_SIGNALS):
                own = sigaction(mem, syscall, scratch, sig, 0)
                mem.write(base + layout.H_OLD_FAULT + index * layout.SIGACTION_SIZE, own)
                new_at = base + layout.H_NEW_FAULT + index * layout.SIGACTION_SIZE
                mem.write(new_at, layout.fault_sigaction(self.area, own))
                sigaction(mem, syscall, scratch, sig, new_at)
                taken.append(index)
        except TargetError:
            for index in reversed(taken):
                own_at = base + layout.H_OLD_FAULT + index * layout.SIGACTION_SIZE
                syscall(NR_RT_SIGACTION, layout.FAULT_SIGNALS[index], own_at, 0, _SIGSET_SIZE)
            raise
        self.is_fetch_faults_active = True

    def retake_fetch_fault(self, mem: Tracee, syscall: Syscall, scratch: int, sig: int) -> bool:
        """After a fetch fault of ours in a thread that blocked ``sig``: was the rescue's
        action reset to SIG_DFL by the kernel? Then it is set again (True).

        A fault cannot be blocked: the kernel delivers it anyway, with the action made
        SIG_DFL and the signal unblocked (``force_sig_info_to_task``). It changes the
        handler only: an action whose restorer is still the rescue's is ours, reset; one
        the program set itself has its own.
        """
        if not self.is_fetch_faults_active:
            return False
        handler, _, restorer, _ = struct.unpack("<QQQQ", sigaction(mem, syscall, scratch, sig, 0))
        if handler != 0 or restorer != layout.restorer(self.area):
            return False
        index = layout.FAULT_SIGNALS.index(sig)
        new_at = self.area + layout.HEADER + layout.H_NEW_FAULT + index * layout.SIGACTION_SIZE
        sigaction(mem, syscall, scratch, sig, new_at)
        return True

    def deactivate(self, syscall: Syscall, *, keep_fetch_faults: bool = False) -> None:
        """Put the program's own actions back (a clean detach), in the reverse order.

        With ``keep_fetch_faults`` (a thread left inside detour code that may still fault)
        the rescue stays the SIGSEGV and SIGBUS handler, set again in case the kernel reset
        it; it hands every other fault to the program's own action.
        """
        if not self.area:
            return
        base = self.area + layout.HEADER
        if self.is_fetch_faults_active:
            at = layout.H_NEW_FAULT if keep_fetch_faults else layout.H_OLD_FAULT
            for index, sig in reversed(list(enumerate(layout.FAULT_SIGNALS))):
                action_at = base + at + index * layout.SIGACTION_SIZE
                syscall(NR_RT_SIGACTION, sig, action_at, 0, _SIGSET_SIZE)
            self.is_fetch_faults_active = keep_fetch_faults
        if syscall(NR_RT_SIGACTION, signal.SIGTRAP, base + layout.H_OLD, 0, _SIGSET_SIZE) == 0:
            self.is_trap_active = False

    def forget(self) -> None:
        """The address space was replaced (exec): the area and the handler went with it."""
        self._reset()

    # -- what the rescue reads -------------------------------------------------------------

    def note_breakpoint(self, spaces: Iterable[Tracee], addr: int, original: int) -> None:
        """Before an int3 is written at ``addr``: its original byte, for the rescue."""
        if not self.area or addr in self.noted:
            return
        index = len(self.noted)
        if index >= layout.BP_MAX:
            raise TargetError(
                f"more than {layout.BP_MAX} probed addresses: no room in the rescue table",
                errno=errno.ENOSPC,
            )
        entry = layout.bp_entry(addr, original)
        count = layout.word(index + 1)
        at = self.area + layout.BP_TABLE + index * layout.BP_ENTRY
        for space in spaces:
            space.write(at, entry)
            space.write(self.area + layout.HEADER + layout.H_NBP, count)
        self.noted[addr] = index

    def note_jump(self, spaces: Iterable[Tracee], addr: int, original: int, jmp: bytes) -> None:
        """Before a jump is written over the int3 at ``addr`` (or when it is gone, with
        ``jmp`` empty): an int3 followed by its four other bytes is one the rescue finishes
        into that jump (breakpoints.py writes a jump in three steps; rescue.c)."""
        index = self.noted.get(addr)
        if not self.area or index is None:
            return
        word = layout.bp_entry(addr, original, jmp)[8:]  # the address stays
        at = self.area + layout.BP_TABLE + index * layout.BP_ENTRY + 8
        for space in spaces:
            space.write(at, word)

    def note_slot(self, spaces: Iterable[Tracee], slot: int, length: int, addr: int) -> None:
        """A stepped copy of the instruction at ``addr`` now lives at ``slot``."""
        if not self.area:
            return
        index = self._redirects.get(slot)
        if index is None:
            index = len(self._redirects)
            if index >= layout.REDIRECT_MAX:
                raise TargetError("no room left in the rescue's table of stepped copies")
            self._redirects[slot] = index
        entry = layout.redirect_entry(slot, length, addr)
        at = self.area + layout.REDIRECT_TABLE + index * layout.REDIRECT_ENTRY
        count = layout.word(len(self._redirects))
        for space in spaces:
            space.write(at, entry)
            space.write(self.area + layout.HEADER + layout.H_NREDIRECT, count)

    def note_trampoline(self, spaces: Iterable[Tracee], addr: int) -> None:
        self._write_header(spaces, layout.H_TRAMP, layout.word(addr))

    def note_page(self, spaces: Iterable[Tracee], start: int, end: int) -> None:
        """An executable page of ours (out-of-line slots, detours): a trap in it was sent
        there by the tool, on its way home; a fetch fault in it is ours.

        A page that adjoins one already noted extends that entry (the table holds 64). One
        noted before the rescue is installed is written by ``install``.
        """
        spaces = list(spaces)
        for index, (lo, hi) in enumerate(self._pages):
            if hi == start or end == lo:
                lo, hi = min(lo, start), max(hi, end)
                self._pages[index] = (lo, hi)
                self._write_header(spaces, layout.H_PAGES + index * 16, layout.page_entry(lo, hi))
                return
        if len(self._pages) >= layout.MAX_PAGES:
            return
        index = len(self._pages)
        self._pages.append((start, end))
        self._write_header(spaces, layout.H_PAGES + index * 16, layout.page_entry(start, end))
        self._write_header(spaces, layout.H_NPAGE, layout.word(index + 1))

    def _write_header(self, spaces: Iterable[Tracee], offset: int, data: bytes) -> None:
        if not self.area:
            return
        for space in spaces:
            space.write(self.area + layout.HEADER + offset, data)

    # -- return records --------------------------------------------------------------------

    def alloc_records(
        self, spaces: Iterable[Tracee], count: int, map_more: Callable[[int], int]
    ) -> int:
        """Room for ``count`` return records (one per kretprobe instance); 0 if none is left.

        The area holds about 158,000; past that, ``map_more(size)`` maps another range
        (the rescue reads up to 64).
        """
        if not self.area or count <= 0:
            return 0
        free = self._free_records.get(count)
        if free:
            start = free.pop()
            self._blocks[start] = count
            return start
        spaces = list(spaces)
        fits = [i for i, (_, capacity, used) in enumerate(self._ranges) if used + count <= capacity]
        if fits:
            index = fits[0]
        elif len(self._ranges) < layout.MAX_RANGES:
            capacity = max(count, layout.RECORD_MAX)
            self._ranges.append((map_more(capacity * layout.RECORD_SIZE), capacity, 0))
            index = len(self._ranges) - 1
            self._write_header(spaces, layout.H_NRANGE, layout.word(len(self._ranges)))
        else:
            return 0
        base, capacity, used = self._ranges[index]
        start = base + used * layout.RECORD_SIZE
        self._ranges[index] = (base, capacity, used + count)
        self._write_header(
            spaces, layout.H_RANGES + 16 * index, layout.range_entry(base, used + count)
        )
        self._blocks[start] = count
        return start

    def free_records(self, start: int) -> None:
        """The pool is gone and its frames unhooked: its records may serve another pool.

        A block of an area that is gone (exec) is not ours any more and is ignored.
        """
        count = self._blocks.pop(start, None)
        if count is not None:
            self._free_records.setdefault(count, []).append(start)

    # -- injections ------------------------------------------------------------------------

    def begin_injection(self, mem: Tracee, saved_regs: bytes) -> None:
        """The thread's own registers, and the trap that means "put them back"."""
        base = self.area + layout.HEADER
        mem.write(base + layout.H_SAVED, saved_regs[: 27 * 8])
        mem.write(base + layout.H_INJECT_TRAP, layout.word(layout.stub_trap(self.area)))

    def end_injection(self, mem: Tracee) -> None:
        mem.write(self.area + layout.HEADER + layout.H_INJECT_TRAP, layout.word(0))


def sigaction(mem: Tracee, syscall: Syscall, scratch: int, sig: int, new_at: int) -> bytes:
    """``rt_sigaction(sig, new_at, scratch)`` in the program, through ``syscall``: its action
    before (``new_at`` 0: only read it). The one signal-action injection (the rescue's and
    the trap guard's)."""
    result = syscall(NR_RT_SIGACTION, sig, new_at, scratch, _SIGSET_SIZE)
    if result < 0:
        name = signal.Signals(sig).name
        raise TargetError(f"rt_sigaction({name}) failed in the program: errno {-result}")
    return mem.read(scratch, layout.SIGACTION_SIZE)
