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

A probe with an ``async_handler`` is a *record*: its detour also writes a record of the hit
in the shared ring (recording.py, reader.py). The shared areas and detour pages are
memory.py's; the state machine of each site is core/optimizer.py's.

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
``A+len``, an instruction boundary of the original code. Both ways the five bytes change in
three writes, the kernel's ``text_poke_bp`` order (breakpoints.py), and the rescue knows the
jump beforehand, so a tool killed between two writes leaves a site the program finishes
alone (docs/decisions.md, "A jump is written and removed in three steps").
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.decode import MAX_INSN_LEN
from kprobes.arch.x86_64.detour import Action, Actions, build_detour
from kprobes.arch.x86_64.jumpopt import Refusal, find_region
from kprobes.arch.x86_64.plan import SLOT_SIZE
from kprobes.arch.x86_64.record import RecordAction
from kprobes.arch.x86_64.retstack import RetEntryAction
from kprobes.core.optimizer import OptState, SiteOpt, why_no_jump
from kprobes.errors import NotRelocatable, TargetError
from kprobes.process.engine.breakpoints import JUMP_LEN
from kprobes.process.engine.threads import ThreadState
from kprobes.process.engine.trampoline import UnwindUnhook
from kprobes.process.fast.returns import (
    FastReturns,
    counter_blocks,
    counters_needed,
    return_probes_of,
)
from kprobes.process.inject import calls
from kprobes.symbols.maps import read_maps
from kprobes.symbols.parts import function_parts

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from kprobes.core.table import ProbeSite, ProbeTable
    from kprobes.process.engine.arming import ProbeLocation
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.prepared import Prepared
    from kprobes.process.engine.tracer import Tracer
    from kprobes.process.fast.memory import DetourMemory
    from kprobes.process.fast.recording import Recording
    from kprobes.process.fast.state import JumpState, SharedArea
    from kprobes.process.inject.program import ProgramCalls

_DETOUR_ALIGN: Final = 16


def _writes_records(action: Action) -> bool:
    """The action writes records into its area's ring (an entry's, or a return's)."""
    if isinstance(action, Actions):
        return any(map(_writes_records, action.actions))
    if isinstance(action, RetEntryAction):
        return action.site.record is not None
    return isinstance(action, RecordAction)


# The longest region a jump displaces: whole instructions over its five bytes, the last of
# which may begin at the fifth.
_REGION_MAX: Final = JUMP_LEN - 1 + MAX_INSN_LEN


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
                try:
                    regs = t.load_regs()
                except ProcessLookupError:
                    continue  # exiting (a joined thread's task outlives the join a while):
                    # it runs no more code, and its exit is reported later
                words = sorted(set(t.stack_words(regs.rsp)))
                self._seen.append((t.tid, regs.rip, words))
        return self._seen


def _cannot_call(pid: int) -> Callable[..., int]:
    def call(nr: int, *args: int) -> int:
        raise TargetError(f"process {pid} (a followed child) shares this code")

    return call


class Optimizer:
    """The optimizer, for ``Process``: optimize, unoptimize, and the counts. It is what
    arming knows as its ``Jumps`` (engine/arming.py)."""

    def __init__(
        self,
        program: Attachment,
        injector: ProgramCalls,
        memory: DetourMemory,
        recording: Recording,
        state: JumpState,
        table: ProbeTable,
        batch: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._program = program
        self.pid = program.pid
        self._tracer = program.tracer
        self._injector = injector
        self._memory = memory
        self._recording = recording
        self._state = state
        self._table = table
        self._batch = batch  # Process.batch: the world held, the sweep at its end
        self._returns = FastReturns(program, injector, memory, state.returns)

    def forget_site(self, addr: int) -> None:
        self._state.forget_site(addr)

    @property
    def optimization(self) -> bool:
        """The document's ``debug.kprobes-optimization`` sysctl: False puts every optimized
        probe back on its int3, True optimizes them again."""
        return self._state.is_enabled

    @optimization.setter
    def optimization(self, value: bool) -> None:
        with self._batch():  # its end optimizes or unoptimizes every site
            self._state.is_enabled = bool(value)

    # -- counts ----------------------------------------------------------------------------

    def collect_counts(self) -> None:
        """Add the hits counted in the program to the probes' ``nhit`` (the records of
        record probes are read apart: recording.py)."""
        table = self._table
        state = self._state
        for addr, delta in state.counts():
            site = table.get(addr)
            for probe in site.active if site is not None else ():  # as a trap counts
                probe.nhit += delta
        for addr in list(state.returns.seen):
            site, so = table.get(addr), state.sites.get(addr)
            if site is not None and so is not None and so.counter >= 0:
                self._returns.collect(site, state.areas)

    # -- the sweep, at the end of every stop of the world --------------------------------

    def retry_optimizing(self) -> None:
        """Stop the world once more if a site waits for a thread that was in its way (the
        kernel's optimizer retries from its delayed work; we retry when ``run()`` returns)."""
        state = self._state
        for site in self._table:
            so = state.sites.get(site.addr)
            is_waiting = so is not None and so.state is OptState.TRAP
            if is_waiting and why_no_jump(site, state.is_enabled) is None:
                with self._batch():
                    pass
                return

    def optimize_sites(self) -> None:
        """Bring every site to what it should be: a jump where asked and possible, else the
        int3. The world is held here."""
        state = self._state
        threads = _Threads()
        for site in list(self._table):
            so = state.sites.get(site.addr)
            why = why_no_jump(site, state.is_enabled)
            if why is not None:
                if so is not None and so.state is OptState.OPTIMIZED:
                    self.unoptimize(site, rearm=site.is_armed)
                if so is not None and so.state is OptState.TRAP:
                    so.reason = why
                continue
            if so is None:
                so = state.sites[site.addr] = SiteOpt()
            if so.state is OptState.OPTIMIZED and so.probes != tuple(site.probes):
                # Its detour was made for other probes (one came or went): made again. The
                # frames hooked meanwhile keep their trampolines, which stay valid.
                self.unoptimize(site, rearm=True, unhook=False)
            if so.state is OptState.TRAP:
                self._optimize(site, so, threads)

    def _optimize(self, site: ProbeSite, so: SiteOpt, threads: _Threads) -> None:
        """Replace the site's int3 by a jump to a new count detour, or say why not."""
        assert self._tracer.world.is_stopped, "optimizing needs the world stopped"
        addr = site.addr
        if addr not in self._tracer.breakpoints.armed:
            so.reason = "no int3 to replace"
            return
        # Step 1: the region the jump displaces, from the original code only.
        loc: ProbeLocation = site.location  # type: ignore[assignment]
        code = self._program.original(loc.func_start, loc.func_size) if loc.func_size > 0 else b""
        parts = self._other_parts(loc)
        if isinstance(parts, str):
            so.to(OptState.REFUSED, parts)
            return
        fragments, pads = parts
        region = find_region(
            code, loc.func_start, addr, loc.func_size, fragments=fragments, entries=pads
        )
        if isinstance(region, Refusal):
            so.to(OptState.REFUSED, region.reason)
            return
        # Step 2: what may not be there while we patch.
        why = self._in_the_way(site, region.end, threads)
        if why is not None:
            so.reason = why  # tried again at the next stop of the world
            return
        # Step 3: the pages the jump goes on kept out of other tools' uprobes (shield.py),
        # then no int3 but ours found in the five bytes once they are.
        why = self._shield_site(addr, region.original[:JUMP_LEN])
        if why is not None:
            so.to(OptState.REFUSED, why)
            return
        # Step 4: the counter, the action, then the detour, written before the jump to it.
        try:
            rps = return_probes_of(site.probes)
            need = max(1, sum(map(counters_needed, rps)))
            # Return probes that came or went: a new block, whose places no other probe's
            # trampoline counts into (the old trampolines keep their own: returns.py).
            if so.counter < 0 or need > so.counters or return_probes_of(so.probes) != rps:
                so.area = self._memory.area(addr, need)
                area = self._state.areas[so.area]
                so.counter, area.next_counter = area.next_counter, area.next_counter + need
                so.counters = need
                so.seen = sa.read_counter(area.view, so.counter)
            area = self._state.areas[so.area]
            if rps:
                action = self._return_action(site, area, so)
            elif any(isinstance(p.owner, UnwindUnhook) for p in site.probes):
                action = self._returns.unhook_action(site, area, so)
            else:
                action = self._recording.action(site, area, so)
            if isinstance(action, str):
                so.to(OptState.REFUSED, action)
                return
            if _writes_records(action):
                self._memory.fault_in_ring(so.area)
            page = self._memory.detour_page(addr)
            at = page.start + page.used
            detour = build_detour(at, region, action, thread_salt=page.start)
            page.used += -(-len(detour.code) // _DETOUR_ALIGN) * _DETOUR_ALIGN
        except NotRelocatable as exc:  # out of reach (ERANGE), too large a detour (E2BIG)
            so.to(OptState.REFUSED, str(exc))
            return
        except TargetError as exc:
            so.reason = f"the program could not map the detour or the area: {exc}"
            return
        spaces = list(self._tracer.own_memories())
        for space in spaces:
            space.write(at, detour.code)
        # Step 5: the jump over the int3 and the 4 bytes after it, in three writes (int3,
        # the 4 bytes, the first byte: breakpoints.py), the rescue told first how to finish
        # an int3 followed by the jump's 4 bytes should the tool die between two of them.
        self._tracer.rescue.note_jump(spaces, addr, region.original[0], detour.patch)
        self._tracer.breakpoints.patch_jump(spaces, addr, detour.patch, region.original[:5])
        so.detour, so.region_len = at, region.length
        so.probes = tuple(site.probes)
        so.to(OptState.OPTIMIZED)

    def _return_action(self, site: ProbeSite, area: SharedArea, so: SiteOpt) -> Action | str:
        """The entry action of the return probes at ``site``: each one's hook, its
        trampoline writing a record of each return if the probe has an asynchronous handler
        (recording.py), else aggregating; an entry probe's record first if one shares the
        site. Several return probes hook one after the other (returns.py)."""
        entry = self._recording.entry_record(site, area, so, counted=False)
        if isinstance(entry, str):
            return entry
        actions: list[Action] = [] if entry is None else [entry]
        self._returns.forget_hooks(site.addr)
        for rp, counter in counter_blocks(site, so.counter):
            record = self._recording.return_record(site, area, so, rp)
            if isinstance(record, str):
                return record
            shared = (so.area, area)
            hook = self._returns.action(site, shared, rp, counter, *(record or ()))
            if isinstance(hook, str):
                return hook
            actions.append(hook)
        self._recording.tables.refresh()  # walks learn where the trampolines and stacks are
        return actions[0] if len(actions) == 1 else Actions(tuple(actions))

    def _shield_site(self, addr: int, original: bytes) -> str | None:
        """Cover the jump's pages in every address space with a copy of the code (shield.py);
        then the five bytes must be our int3 and the original four. Why not, or None."""
        tracer = self._tracer
        shield = self._state.shield
        for space in tracer.own_memories():
            if not shield.is_covered(space.pid, addr, JUMP_LEN):
                try:
                    if space is not tracer.main:  # a followed fork child: as at the fork
                        why = shield.cover(space.pid, addr, JUMP_LEN, _cannot_call(space.pid))
                    else:
                        why = self.cover(addr)
                except TargetError as exc:
                    why = f"its page could not be kept from other tools' uprobes: {exc}"
                if why is not None:
                    return why
            if space.read(addr, JUMP_LEN) != b"\xcc" + original[1:]:
                return (
                    "another tool's breakpoint (a kernel uprobe?) came into the five bytes "
                    "the jump would take"
                )
        return None

    def cover(self, addr: int, length: int = JUMP_LEN) -> str | None:
        """``Shield.cover`` of the main image, by the program's own ``mprotect``: an
        injection only for a page not covered yet, and none once the program refused."""
        tracer = self._tracer
        shield = self._state.shield
        assert tracer.main is not None
        pid = tracer.main.pid
        if shield.is_covered(pid, addr, length) or shield.refusal(pid) is not None:
            return shield.refusal(pid)
        with self._injector.injection_thread() as thread:
            insn = self._injector.find_syscall(read_maps(self.pid))

            def call(nr: int, *args: int) -> int:
                return calls.run_syscall(thread, insn, nr, *args, rescue=tracer.rescue)

            return shield.cover(pid, addr, length, call)

    def _other_parts(self, loc: ProbeLocation) -> tuple[list[tuple[int, bytes]], list[int]] | str:
        """The other parts of the probed function (gcc's ``foo.cold`` and ``foo.cold.N``; for
        a probe in one of them, ``foo`` and the rest), whose jumps may enter the region, and
        the landing pads of every part (the C++ unwinder enters there). A str says why they
        cannot be known (an exception table this reader does not understand)."""
        module = self._program.symbols().get_module_at(loc.addr)
        found = None if module is None else module.image.function_at(loc.addr - module.bias)
        if module is None or found is None:
            return [], []
        bias = module.bias
        parts = function_parts(module.image, module.path, found[0].name, loc.func_start - bias)
        if isinstance(parts, str):
            return parts
        fragments = [
            (bias + sym.value, self._program.original(bias + sym.value, sym.size))
            for sym in parts.others
        ]
        return fragments, [bias + pad for pad in parts.pads]

    def unoptimize(self, site: ProbeSite, *, rearm: bool, unhook: bool = True) -> None:
        """Put the original bytes back, then the int3 if ``rearm``; with ``unhook``, the
        real return address back in the frames its return probes hooked. The world is
        held."""
        assert self._tracer.world.is_stopped, "unoptimizing needs the world stopped"
        so = self._state.sites[site.addr]
        self.collect_counts()
        breakpoints = self._tracer.breakpoints
        original = breakpoints.jumps[site.addr][1][0]
        breakpoints.unpatch_jump(self._tracer.own_memories(), site.addr, rearm=rearm)
        # An int3 there is the probe's own again (a tool killed before this write leaves a
        # rescue that tells the two by the 4 bytes after it: the same outcome).
        self._tracer.rescue.note_jump(self._tracer.own_memories(), site.addr, original, b"")
        so.detour = 0
        so.to(OptState.TRAP)
        # A return probe's live frames get their real return addresses back (a thread that
        # was inside the entry detour hooks its frame still: the trampoline stays valid).
        tramps = self._state.returns.current.get(site.addr)
        if tramps and unhook:
            self._state.returns.unhook(self._tracer.threads.values(), only=tramps)

    def unoptimize_around(self, addr: int) -> None:
        """A probe is being armed at ``addr``: an optimized region that covers it goes back to
        its int3 first (the kernel unoptimizes a probe whose region another probe enters)."""
        sites = self._state.sites
        for start in range(addr - _REGION_MAX + 1, addr):  # not every site: thousands arm
            so = sites.get(start)
            if so is not None and so.state is OptState.OPTIMIZED and addr < start + so.region_len:
                site = self._table.get(start)
                if site is not None:
                    self.unoptimize(site, rearm=True)
                    so.reason = f"another probe at {addr:#x} is inside the region"

    def _in_the_way(self, site: ProbeSite, end: int, threads: _Threads) -> str | None:
        """Why the region [site.addr, end) cannot be patched now, or None."""
        addr = site.addr
        sites = self._table.sites
        for other in range(addr + 1, end):  # a few bytes: not every site in the table
            if other in sites:
                return f"another probe at {other:#x} is inside the region"
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

    # -- listing ---------------------------------------------------------------------------

    def plan_of(self, site: ProbeSite) -> tuple[str, str]:
        """(plan, why not optimized) for ``list()``."""
        x: Prepared | None = site.ainsn
        plan = x.kind.value if x is not None else ""
        so = self._state.sites.get(site.addr)
        if so is not None and so.state is OptState.OPTIMIZED:
            return "OPTIMIZED", ""
        why = why_no_jump(site, self._state.is_enabled)
        if why is None:
            why = so.reason if so is not None and so.reason else "not yet tried"
        return plan, why
