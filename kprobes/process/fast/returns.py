"""Optimized return probes on a process: their shadow stacks, trampolines and counters.

A ``Kretprobe(optimize=True)`` whose handlers need no trap (core/retprobes.py,
``Kretprobe.why_on_traps``) is placed as every return probe is, with the trap tier's entry
probe; the optimizer then gives its entry site a ``RetEntryAction`` (arch/x86_64/retstack.py)
in place of a count, and the probe a trampoline of its own in the program. Entries and returns
then take no trap: the program times each call and adds it to the probe's log2 histogram in
the shared area, which the tool reads when it reports (``collect``).

What must stay valid after the tool's death stays mapped: the shadow stacks (one private
anonymous mapping, made by the program), the trampolines (one executable page of ours, never
reused) and the counters (the shared area). A clean end puts the real return address back in
every live frame first (``unhook``, with every thread held), so that nothing returns into a
page it then unmaps. So does the unwinder's guard (engine/trampoline.py) for the thread that
throws: the C++ unwinder finds no unwind entry for a trampoline, and needs the real addresses.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import retstack as rs
from kprobes.arch.x86_64 import rettramp as rt
from kprobes.arch.x86_64 import shadow as sh
from kprobes.arch.x86_64.detour import Action
from kprobes.arch.x86_64.record import SALT_SIZE, RecordAction, ThreadId
from kprobes.arch.x86_64.shadow import LOST, SHADOW_SIZE
from kprobes.arch.x86_64.unhook import UnhookAction
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import TargetError
from kprobes.linux.syscalls import NR_MMAP
from kprobes.linux.tsc import read_tsc
from kprobes.process.engine.xol import MARK_SIZE
from kprobes.process.inject import calls
from kprobes.symbols.maps import read_maps
from kprobes.values import dataclass, field

if TYPE_CHECKING:
    from kprobes.core.optimizer import SiteOpt
    from kprobes.core.probes import Kprobe
    from kprobes.core.table import ProbeSite
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.threads import Thread
    from kprobes.process.engine.tracee import Tracee
    from kprobes.process.fast.memory import DetourMemory
    from kprobes.process.fast.state import SharedArea
    from kprobes.process.inject.program import ProgramCalls

# Counters a return site takes in its area (64 bytes apart): the block ``rs.COUNTERS_SIZE``.
NCOUNTERS: Final = -(-rs.COUNTERS_SIZE // 64)


def counters_needed(rp: Kretprobe) -> int:
    """Counters (64 bytes) ``rp``'s return site takes: its block, and its linear slots."""
    return -(-rs.counters_size(linear_of(rp)) // 64)


def linear_of(rp: Kretprobe) -> rs.Linear | None:
    return None if rp.linear is None else rs.Linear(*rp.linear)


TRAMP_PAGE: Final = 0x10000
TRAMP_SPAN: Final = TRAMP_PAGE - SALT_SIZE  # the trampolines' part: all but the thread salt
_MAP_PRIVATE_ANON_NORESERVE: Final = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000
_Q2 = struct.Struct("<QQ")
_Q = struct.Struct("<Q")


def return_probes_of(probes: Iterable[Kprobe]) -> list[Kretprobe]:
    """The return probes whose entries are among ``probes`` (a site's), in their order."""
    return [p.owner for p in probes if isinstance(p.owner, Kretprobe)]


def counter_blocks(site: ProbeSite, first: int) -> list[tuple[Kretprobe, int]]:
    """Each return probe at ``site`` with the index of its counters: one block after the
    other from ``first`` (the first probe's hits are the site's: ``SiteOpt.counter``)."""
    blocks = []
    for rp in return_probes_of(site.probes):
        blocks.append((rp, first))
        first += counters_needed(rp)
    return blocks


def tsc_mult() -> int:
    """``ns = ticks * mult >> 32`` on this machine, measured over 20 ms (the TSC is invariant
    here: tsc.py)."""
    global _MULT
    if _MULT is None:
        ns0, t0 = time.monotonic_ns(), read_tsc()
        time.sleep(0.02)
        ns1, t1 = time.monotonic_ns(), read_tsc()
        _MULT = max(1, ((ns1 - ns0) << 32) // max(1, t1 - t0))
    return _MULT


_MULT: int | None = None


# What a trampoline's code holds (``ReturnStacks.trampolines``).
_TrampolineKey = tuple[int, int, int, int, int, tuple[str, ...], tuple[int, int, int] | None, bool]


@dataclass(slots=True)
class _Seen:
    """A block of a probe's counters (in shared area ``area``, at index ``counter``) as
    last added to the probe ``rp``."""

    rp: Kretprobe
    area: int
    counter: int
    returns: int = 0
    missed: int = 0
    abandoned: int = 0


@dataclass(slots=True)
class ReturnStacks:
    """The fast tier's return probes in one address space (``JumpState.returns``)."""

    shadow: int = 0  # the shadow stacks' mapping
    tramp_start: int = 0  # the trampolines' page
    tramp_used: int = 0
    # Trampolines by what their code holds: (site address, its counters, unit, value bits,
    # the id of the record it writes, the entry's registers for it, its linear buckets);
    # the ones each site's current detour hooks to (for ``unhook``).
    trampolines: dict[_TrampolineKey, int] = field(default_factory=dict)
    current: dict[int, set[int]] = field(default_factory=dict)
    # Site address → every block of counters its probes' trampolines count into (by the
    # block's address), as last read: a probe may have several, its trampolines of before
    # a change of the site's probes still counting for the frames they hooked.
    seen: dict[int, dict[int, _Seen]] = field(default_factory=dict)

    def forget(self) -> None:
        """The address space was replaced (exec): none of it is there any more (in place:
        the optimizer's ``FastReturns`` holds this object)."""
        self.shadow = self.tramp_start = self.tramp_used = 0
        self.trampolines.clear()
        self.current.clear()
        self.seen.clear()

    def tramp_range(self) -> tuple[int, int]:
        return self.tramp_start, self.tramp_start + TRAMP_SPAN

    def unhook(self, threads: Iterable[Thread], only: Collection[int] = ()) -> int:
        """Put the real return address back in every frame of ``threads`` hooked to one of
        our trampolines (``only``: those alone); how many. The threads are held.
        Entries stay: the frames return straight home and the entries are released later as
        vanished (a thread inside a trampoline still pops its own)."""
        if not self.shadow:
            return 0
        start, end = self.tramp_range()
        done = 0
        for t in threads:
            try:
                # A thread in a handler has its view loaded, maybe changed: not reloaded.
                fs_base = (t.regs if t.busy or t.regs.dirty else t.load_regs()).fs_base
                slot = _find_slot(t.tracee, self.shadow, fs_base)
                if slot is None:
                    continue
                depth = min(_Q.unpack(t.tracee.read(slot + sh.T_DEPTH, 8))[0], sh.CAPACITY)
                raw = t.tracee.read(slot + sh.T_ENTRIES, depth * sh.ENTRY) if depth else b""
                lost = t.tracee.read(slot + sh.T_LOST, sh.LOST_MAX * LOST)
            except (TargetError, OSError):
                continue
            # Newest first: in a tail-call chain the newer entry's "return address" is the
            # older one's trampoline, then the older one puts the real address. Then the
            # released frames that may still be live (the lost ring, T_LOST).
            pairs = [_Q2.unpack_from(raw, i * sh.ENTRY) for i in reversed(range(depth))]
            pairs += [
                (ret, stack)
                for stack, ret in (_Q2.unpack_from(lost, i * LOST) for i in range(sh.LOST_MAX))
                if stack
            ]
            for ret, stack in pairs:
                try:
                    now = t.tracee.read_word(stack)
                except TargetError:
                    continue
                if start <= now < end and (not only or now in only):
                    t.tracee.write_word(stack, ret)
                    done += 1
        return done

    def rehook(self, t: Thread, sp: int) -> int:
        """A C++ exception was caught (``__cxa_begin_catch``) below the stack pointer
        ``sp`` of held thread ``t``: the frames our trampolines had hooked above it survived
        the unwinding, which ``unhook`` gave their real return addresses; each is hooked to
        its trampoline again, oldest first (a tail-call chain's newer entry then finds its
        older one's trampoline in the slot, as when it hooked). How many."""
        if not self.shadow:
            return 0
        try:
            slot = _find_slot(t.tracee, self.shadow, t.regs.fs_base)
            if slot is None:
                return 0
            depth = min(_Q.unpack(t.tracee.read(slot + sh.T_DEPTH, 8))[0], sh.CAPACITY)
            raw = t.tracee.read(slot + sh.T_ENTRIES, depth * sh.ENTRY) if depth else b""
        except (TargetError, OSError):
            return 0
        done = 0
        for i in range(depth):
            ret, stack = _Q2.unpack_from(raw, i * sh.ENTRY)
            if stack <= sp:
                break  # this one and the newer ones are frames the exception ended
            tramp = _Q.unpack_from(raw, i * sh.ENTRY + sh.E_TRAMP)[0]
            try:
                if t.tracee.read_word(stack) == ret:
                    t.tracee.write_word(stack, tramp)
                    done += 1
            except TargetError:
                continue
        return done


def _find_slot(mem: Tracee, shadow: int, fs_base: int) -> int | None:
    """The thread slot of ``fs_base``, searched as the program's code searches."""
    index = rs.first_index(fs_base)
    for i in range(sh.NTHREADS):
        slot = rs.thread_slot(shadow, fs_base, index + i)
        owner = _Q.unpack(mem.read(slot + sh.T_OWNER, 8))[0]
        if owner == fs_base:
            return slot
        if owner == 0:
            return None
    return None


class FastReturns:
    """The optimizer's part for return probes: actions, trampolines, counts."""

    def __init__(
        self,
        program: Attachment,
        injector: ProgramCalls,
        memory: DetourMemory,
        stacks: ReturnStacks,
        thread_id: ThreadId = ThreadId.FSBASE,
    ) -> None:
        self._program = program
        self._tracer = program.tracer
        self._injector = injector
        self._memory = memory
        self._stacks = stacks
        self._thread_id = thread_id

    def action(
        self,
        site: ProbeSite,
        area: tuple[int, SharedArea],
        rp: Kretprobe,
        counter: int,
        record: RecordAction | None = None,
        entry_regs: tuple[str, ...] = (),
        entry_record: RecordAction | None = None,
    ) -> Action | str:
        """The entry action of return probe ``rp`` at ``site``, its counters at index
        ``counter`` of the shared area ``area`` (its index, and it), its trampoline made
        once; or why none. With ``record``, its trampoline
        writes that record of each return (and the entry keeps ``entry_regs`` for it, and
        writes ``entry_record``, the probe's entry action, naming it in the entry).
        Several return probes at one site hook one after the other: the later one's entry
        keeps the earlier one's trampoline as the return address (a chain, as a tail call
        makes), so the returns run newest first, as the trap tier reports them."""
        why = rp.why_on_traps()
        if why is not None:
            return why
        stacks = self._stacks
        self._ensure_memory(site.addr)
        index, shared = area
        counters = shared.counter_addr(counter)
        # A probe registered again at the site has new counters: a new trampoline (the old
        # one stays, for the frames still hooked to it).
        key = (
            site.addr,
            counters,
            rp.duration_unit,
            rp.value_bits,
            record.probe_id if record else 0,
            entry_regs,
            rp.linear,
            entry_record is not None,
        )
        tramp = stacks.trampolines.get(key, 0)
        ret_site = rs.ReturnSite(
            shadow=stacks.shadow,
            trampoline=tramp or stacks.tramp_start + stacks.tramp_used,
            tramp_start=stacks.tramp_start,
            tramp_size=TRAMP_SPAN,
            trap_trampoline=self._tracer.trampoline.addr,
            counters=counters,
            maxactive=max(0, rp.maxactive),
            thread_id=self._thread_id,
            value_bits=rp.value_bits,
            record=record,
            entry_regs=entry_regs,
            linear=linear_of(rp),
            thread_salt=self._memory.salt_of(stacks.tramp_start),
            entry_record=entry_record,
        )
        if not tramp:
            code = rt.build_trampoline(ret_site, max(1, tsc_mult() // max(1, rp.duration_unit)))
            size = max(rt.TRAMPOLINE_MAX, -(-len(code) // 64) * 64)
            if stacks.tramp_used + size > TRAMP_SPAN - MARK_SIZE:
                return "no room left for another return trampoline (64 KiB of them per process)"
            for space in self._tracer.own_memories():
                space.write(ret_site.trampoline, code)
            stacks.trampolines[key] = ret_site.trampoline
            stacks.tramp_used += size
            seen = stacks.seen.setdefault(site.addr, {})
            counted = self._read(shared, counter, rp)[1:4]
            seen.setdefault(counters, _Seen(rp, index, counter, *counted))
        stacks.current.setdefault(site.addr, set()).add(ret_site.trampoline)
        return rs.RetEntryAction(ret_site)

    def forget_hooks(self, addr: int) -> None:
        """The site at ``addr`` gets a new detour: the trampolines it hooks to are its
        ``action``s' from now on."""
        self._stacks.current.pop(addr, None)

    def unhook_action(self, site: ProbeSite, area: SharedArea, so: SiteOpt) -> Action:
        """The action of the in-program unhook on an entry point of the unwinder
        (engine/trampoline.py ``UnwindUnhook``)."""
        self._ensure_memory(site.addr)
        stacks = self._stacks
        return UnhookAction(
            stacks.shadow,
            stacks.tramp_start,
            TRAMP_SPAN,
            area.counter_addr(so.counter),
            self._thread_id,
        )

    def _ensure_memory(self, near: int) -> None:
        """The shadow stacks' mapping and the trampolines' page, made once per image."""
        stacks = self._stacks
        if not stacks.tramp_start:
            stacks.tramp_start = self._memory.alloc_detour(near, TRAMP_SPAN - MARK_SIZE)
            stacks.tramp_used = 0
        if stacks.shadow:
            return
        with self._injector.injection_thread() as thread:
            insn = self._injector.find_syscall(read_maps(self._program.pid))
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            args = (0, SHADOW_SIZE, prot, _MAP_PRIVATE_ANON_NORESERVE, (1 << 64) - 1, 0)
            result = calls.run_syscall(thread, insn, NR_MMAP, *args, rescue=self._tracer.rescue)
        if result < 0:
            raise TargetError(f"mmap of the shadow stacks failed: {os.strerror(-result)}")
        stacks.shadow = result

    @staticmethod
    def _read(area: SharedArea, counter: int, rp: Kretprobe) -> tuple[int, ...]:
        """(hits, returns, missed, abandoned, sum of ns, then the histogram's slots: the
        65 log2 ones, or ``rp``'s linear ones) of the counters at index ``counter``."""
        base = area.layout.counter_offset(counter)
        view = area.view
        linear = linear_of(rp)
        try:
            head = struct.unpack_from("<5Q", view, base)
            if linear is None:
                hist = struct.unpack_from(f"<{rs.HIST_SLOTS}Q", view, base + rs.C_HIST)
            else:
                hist = struct.unpack_from(f"<{linear.nslots}Q", view, base + rs.C_LHIST)
        finally:
            view.release()
        return head + hist

    def collect(self, site: ProbeSite, areas: Sequence[SharedArea]) -> None:
        """Add what the program counted for each return probe at this site since the last
        call to the probe, in each block of counters it has had here: returns (``nhit``),
        misses, abandoned frames, the durations (their histogram: the blocks' sum)."""
        placed = {id(rp) for rp in return_probes_of(site.probes)}
        hists: dict[int, tuple[Kretprobe, list[int]]] = {}
        for seen in self._stacks.seen.get(site.addr, {}).values():
            rp = seen.rp
            if id(rp) not in placed:
                continue  # unregistered: what its trampolines still count is nobody's
            values = self._read(areas[seen.area], seen.counter, rp)
            _, returns, missed, abandoned, total = values[:5]
            rp.nhit += returns - seen.returns
            rp.nmissed += missed - seen.missed
            rp.nabandoned += abandoned - seen.abandoned
            seen.returns, seen.missed, seen.abandoned = returns, missed, abandoned
            _, hist = hists.setdefault(id(rp), (rp, [0] * (len(values) - 4)))
            for i, value in enumerate((total, *values[5:])):
                hist[i] += value
        for rp, (total, *slots) in hists.values():
            if rp.async_handler is None:  # a record probe's returns are its records
                rp.note_hist(tuple(slots), total)
