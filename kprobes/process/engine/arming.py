"""Placing a probe in this process: the core's arch hooks (resolve, check, prepare, arm...).

The kernel's ``arch_prepare_kprobe``/``arch_arm_kprobe`` and their kin, for a process we
trace: where a symbol is in this image (ifuncs run in the program to find their
implementation), whether an address may be probed (an instruction boundary, found by
decoding from the function's start; not our own pages; not the blacklist), how the
instruction runs out of line (its plan and slot, decided once), and the int3 itself, noted
in the rescue first. Never from patched bytes: every decode reads through ``_original``.

``Arming`` is a part of ``Process`` (target.py), which hands the core's calls on to it. It
knows the optimizer only as ``Jumps``, below: the fast tier depends on the engine, never the
other way round.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import TYPE_CHECKING, Any, Protocol

from kprobes.arch.x86_64.decode import check_boundary, iter_insns
from kprobes.arch.x86_64.emulate import changes_rip_only, emulator_for
from kprobes.arch.x86_64.leftover import original_under_jump
from kprobes.arch.x86_64.plan import SLOT_SIZE, PlanKind, build_slot, plan_instruction
from kprobes.arch.x86_64.rescue import AREA_SIZE as RESCUE_SIZE
from kprobes.arch.x86_64.rescue import find_areas, left_breakpoints
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Jprobe, Kretprobe
from kprobes.core.table import ProbeSite
from kprobes.errors import (
    Blacklisted,
    InternalError,
    NotABoundary,
    NotMapped,
    ProbeRejected,
    SymbolNotFound,
    TargetError,
)
from kprobes.linux import ptrace
from kprobes.model import BlacklistEntry
from kprobes.process.engine.prepared import Prepared
from kprobes.symbols.elf import SymbolKind
from kprobes.symbols.maps import read_maps
from kprobes.values import dataclass

if TYPE_CHECKING:
    from collections.abc import Callable

    from kprobes.core.table import ProbeTable
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.contracts import Injector

_MAX_FUNC_DECODE = 1 << 20


@dataclass(frozen=True, slots=True)
class ProbeLocation:
    addr: int
    display: str
    module_name: str
    func_start: int
    func_size: int
    is_executable: bool
    module_path: str = ""
    bias: int = 0  # runtime address = bias + the ELF file's virtual address


class Jumps(Protocol):
    """What arming needs of the optimizer (fast/optimizer.py), which keeps the jumps."""

    def unoptimize_around(self, addr: int) -> None:
        """A probe goes to ``addr``: a jump whose region covers it goes back to its int3."""
        ...

    def unoptimize(self, site: ProbeSite, *, rearm: bool) -> None:
        """Put the site's original bytes back (then its int3 if ``rearm``); world held."""
        ...

    def cover(self, addr: int, length: int) -> str | None:
        """Keep the page(s) of [addr, addr+length) from other tools' uprobes; why not."""
        ...

    def collect_counts(self) -> None:
        """Add what the program counted by itself to the probes' ``nhit``."""
        ...

    def forget_site(self, addr: int) -> None:
        """The site left the probe table: its jump state goes with it."""
        ...


class Arming:
    """The arch hooks of ``Process``: resolve, check, prepare, remove, arm, disarm, drop."""

    def __init__(
        self,
        program: Attachment,
        injector: Injector,
        table: ProbeTable,
        jumps: Jumps,
        is_starting: Callable[[], bool],
    ) -> None:
        self._program = program
        self.pid = program.pid
        self._tracer = program.tracer
        self._injector = injector
        self._table = table
        self._jumps = jumps
        self._is_starting = is_starting  # the loader has not relocated the libraries yet
        self.user_blacklist: list[BlacklistEntry] = []  # Process.add_blacklist's
        self._boundaries: dict[int, frozenset[int]] = {}  # function → its instructions
        self._dead_int3s: dict[int, int] | None = None  # _left_int3s

    def forget_image(self) -> None:
        """exec replaced the program's image: what was known of its code goes with it."""
        self._boundaries.clear()
        self._dead_int3s = None

    def blacklist(self) -> list[BlacklistEntry]:
        """Our own pages (the out-of-line area, the rescue), then the user's entries."""
        out = list(self.user_blacklist)
        xol = self._tracer.xol
        if xol is not None:
            for page in xol.pages:
                out.append(BlacklistEntry(page.start, page.end, "kprobes out-of-line area"))
        area = self._tracer.rescue.area
        if area:
            out.append(BlacklistEntry(area, area + RESCUE_SIZE, "kprobes rescue area"))
        return out

    def resolve(self, probe: Kprobe) -> ProbeLocation:
        self._program.require()
        resolver = self._program.symbols()
        if probe.addr is not None:
            addr = probe.addr + probe.offset
            if self._tracer.xol is not None and self._tracer.xol.contains(addr):
                raise Blacklisted(f"{addr:#x} is inside kprobes' own out-of-line area")
            area = self._tracer.rescue.area
            if area and area <= addr < area + RESCUE_SIZE:
                raise Blacklisted(f"{addr:#x} is inside kprobes' own rescue area")
            try:
                loc = resolver.locate_address(addr)
            except SymbolNotFound:
                resolver.refresh()  # maybe a library was loaded since
                loc = resolver.locate_address(addr)
        else:
            assert probe.symbol is not None
            try:
                loc = resolver.resolve(probe.symbol, probe.offset)
            except SymbolNotFound:
                resolver.refresh()  # maybe a library was loaded since
                loc = resolver.resolve(probe.symbol, probe.offset)
        if loc.symbol is not None and loc.symbol.kind is SymbolKind.IFUNC:
            name = loc.symbol.name
            if self._is_starting():  # its resolver cannot run in a library not relocated yet
                raise NotMapped(
                    f"{name} is a GNU ifunc: it is placed once the loader has "
                    f"relocated {loc.module.name}"
                )
            impl = self._injector.ifunc_target(loc.addr - loc.offset)
            try:
                loc = resolver.locate_address(impl + loc.offset)
            except SymbolNotFound as exc:
                raise SymbolNotFound(
                    f"{name} is a GNU ifunc whose implementation {impl:#x} is not in "
                    "a mapped ELF file (the vdso?), where kprobes cannot probe"
                ) from exc
        return ProbeLocation(
            addr=loc.addr,
            display=loc.display,
            module_name=loc.module.name,
            func_start=loc.func_start,
            func_size=loc.func_size,
            is_executable=any(m.contains(loc.addr) and "x" in m.perms for m in loc.module.mappings),
            module_path=loc.module.path,
            bias=loc.module.bias,
        )

    def _readable_path(self, path: str) -> str:
        """The module's file as this process can open it (across mount namespaces)."""
        inside = f"/proc/{self.pid}/root{path}"
        return inside if os.path.exists(inside) else path

    def check(self, probe: Kprobe, location: Any) -> None:
        loc: ProbeLocation = location
        if not loc.is_executable:
            raise ProbeRejected(
                f"{loc.addr:#x} ({loc.display}) is not in executable code", errno=errno.EINVAL
            )
        self._take_back_leftover_jump(loc.addr)
        for entry in self.blacklist():
            if loc.addr in entry:
                raise Blacklisted(f"{loc.addr:#x} ({loc.display}) is blacklisted: {entry.reason}")
        if isinstance(probe.owner, (Kretprobe, Jprobe)) and loc.func_start != loc.addr:
            what = "kretprobe" if isinstance(probe.owner, Kretprobe) else "jprobe"
            raise ProbeRejected(
                f"a {what} must be at a function entry; {loc.display} is not",
                errno=errno.EINVAL,
            )
        if isinstance(probe.owner, Jprobe):
            site = self._table.get(loc.addr)
            if site is not None and any(isinstance(p.owner, Jprobe) for p in site.probes):
                raise ProbeRejected(
                    f"{loc.display} already has a jprobe (one per function)", errno=errno.EEXIST
                )
        if loc.func_start >= loc.addr:
            return
        bounds = self._boundaries.get(loc.func_start)
        if bounds is None:
            size = loc.func_size or (loc.addr - loc.func_start + 16)
            self._take_back_leftover_jumps(loc.func_start, min(size, _MAX_FUNC_DECODE))
            code = self._program.original(loc.func_start, min(size, _MAX_FUNC_DECODE))
            bounds = frozenset(i.addr for i in iter_insns(code, loc.func_start))
            if loc.func_size:
                self._boundaries[loc.func_start] = bounds
        if loc.addr not in bounds:
            code = self._program.original(loc.func_start, loc.addr - loc.func_start + 16)
            check_boundary(code, loc.func_start, loc.addr)
            raise NotABoundary(f"{loc.addr:#x} ({loc.display}) is not an instruction boundary")

    def _take_back_leftover_jump(self, addr: int, head: bytes | None = None) -> None:
        """A jump a dead kprobes left here (leftover.py) gives the site its original bytes
        back before anything decodes it; so does an int3 it left before a jump's other four
        bytes (killed between two writes of the jump: breakpoints.py), which the rescue would
        have finished into that jump. The world is held (registration is a batch)."""
        breakpoints = self._tracer.breakpoints
        if addr in breakpoints.ever_jumped or addr in breakpoints.ever_patched:
            return  # ours
        memory = self._program.memory()
        head = memory.read(addr, 5) if head is None else head
        is_int3 = head[0] == 0xCC
        if is_int3:
            head = b"\xe9" + head[1:]
        original = original_under_jump(addr, head, memory.read_some)
        if original is None and is_int3:
            byte = self._left_int3s().get(addr)
            original = None if byte is None else bytes([byte])
        if original is not None:
            for space in self._tracer.own_memories():
                space.write(addr, original)

    def _left_int3s(self) -> dict[int, int]:
        """The int3s a dead kprobes left, by its rescue's table (rescue.left_breakpoints):
        read once a session (no other tool can place one while we trace the program)."""
        if self._dead_int3s is None:
            memory, own = self._program.memory(), self._tracer.rescue.area
            self._dead_int3s = {}
            for m in read_maps(self.pid):
                if m.path or "x" not in m.perms or m.end - m.start < RESCUE_SIZE:
                    continue
                for area in find_areas(m.start, m.end, memory.read_some):
                    if area != own:
                        self._dead_int3s.update(left_breakpoints(area, memory.read_some))
        return self._dead_int3s

    def _take_back_leftover_jumps(self, start: int, size: int) -> None:
        """Every jump a dead kprobes left in the function at ``start`` is taken back before
        its code is decoded: one at another site would make the decode go astray."""
        code = self._program.memory().read_some(start, size)
        for first in (b"\xe9", b"\xcc"):
            at = code.find(first)
            while 0 <= at <= len(code) - 5:
                self._take_back_leftover_jump(start + at, code[at : at + 5])
                at = code.find(first, at + 1)

    def prepare(self, site: ProbeSite) -> None:
        self._injector.ensure_rescue()
        addr = site.addr
        code = self._program.original(addr, 16)
        plan = plan_instruction(code, addr, has_post_handler=site.has_post_handler)
        old: Prepared | None = site.ainsn
        if plan.kind is PlanKind.EMULATE:
            prepared = Prepared(
                plan,
                plan.kind,
                0,
                0,
                emulator_for(plan),
                is_one_stop=True,
                is_rip_only=changes_rip_only(plan),
                addr_word=ptrace.Word(addr),
            )
        else:
            xol = self._injector.xol()
            slot = xol.alloc(addr)
            try:
                body = build_slot(plan, code, slot)
                # The rest of the slot is int3s (a reused slot holds an older copy): a thread
                # that runs past the end of this one traps, and the rescue knows that trap.
                for space in self._tracer.own_memories():
                    space.write(slot, body.ljust(SLOT_SIZE, b"\xcc"))
            except BaseException:
                xol.release(slot)
                raise
            one_stop = plan.kind is PlanKind.BOOST
            prepared = Prepared(
                plan,
                plan.kind,
                slot,
                len(body),
                is_one_stop=one_stop,
                is_rip_only=True,
                slot_word=ptrace.Word(slot),
            )
            self._tracer.slot_owner[slot] = site
            self._tracer.slot_history[slot] = prepared
            if plan.kind in (PlanKind.STEP, PlanKind.SINGLESTEP):
                self._tracer.rescue.note_slot(
                    self._tracer.own_memories(), slot, plan.length, plan.addr
                )
        site.ainsn = prepared
        if old is not None and old.slot:
            self._release_slot(old)

    def remove(self, site: ProbeSite) -> None:
        self._jumps.forget_site(site.addr)
        old: Prepared | None = site.ainsn
        if old is not None and old.slot:
            self._release_slot(old)

    def _release_slot(self, prepared: Prepared) -> None:
        self._tracer.slot_owner.pop(prepared.slot, None)
        if self._tracer.xol is not None:
            self._tracer.xol.release(prepared.slot)

    def arm(self, site: ProbeSite) -> None:
        self._injector.ensure_rescue()
        # Its page kept out of other tools' kernel uprobes first (shield.py): one that came
        # and went over our int3 would take it with it. A program that refuses keeps the
        # int3 all the same: nothing worse than before.
        with contextlib.suppress(TargetError, InternalError):
            self._jumps.cover(site.addr, 1)
        self._jumps.unoptimize_around(site.addr)
        original = self._program.original(site.addr, 1)[0]
        self._tracer.rescue.note_breakpoint(self._tracer.own_memories(), site.addr, original)
        self._tracer.breakpoints.arm(self._tracer.own_memories(), site.addr, original)

    def disarm(self, site: ProbeSite) -> None:
        if site.addr in self._tracer.breakpoints.jumps:
            self._jumps.unoptimize(site, rearm=False)
        elif site.addr in self._tracer.breakpoints.armed:
            self._tracer.breakpoints.disarm(self._tracer.own_memories(), site.addr)

    def drop(self, site: ProbeSite) -> None:
        self._jumps.collect_counts()  # the counter goes with the code (exec, dlclose)
        self._tracer.breakpoints.drop(site.addr)
        self._jumps.forget_site(site.addr)
