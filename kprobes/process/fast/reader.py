"""Asynchronous handlers: the records of optimized probes read from the ring and handed over.

A probe with an ``async_handler`` is optimized into a *record* probe (optimizer.py): each
hit writes a record in the shared ring, in the program, and the tool reads the ring when it
can (between stops, and every ``world.POLL`` seconds while ``run()`` waits) and calls the handler
with an ``Event`` (model.py, what every target hands over after the fact): the thread, the
CPU, the time, the place, the fetch-args evaluated by the trap tier's own code against what
the detour copied (fetch/fast.py), and the registers if the probe asked for them (read-only).
Where the probe cannot be optimized the same handler runs at its trap, with an ``Event``
built from the live thread: one handler, two tiers, the same values.

**In batches.** A probe whose events are only printed (``FastProbe.batch``: ``trace``) and
is alone at its site (a return probe: alone to take its site's records of returns) skips
the ``Event``: the ring is read as one block (ring_block.py) and
each run of its records goes through a decoder generated for its layout and its output's
line (batch.py), the same bytes at twenty to forty times the pace; the other runs go to the
handlers, in record order.

**Or as they lie**: with a ``tee`` (``kprobes record``: tee.py) each read's blocks go to it
whole, undecoded, in place of both paths; a record file's reader (cli/replay.py) later hands
them to ``deliver_blocks`` of a reader of its own, as this one would have.

**Threads** are named by their thread pointer (fs base) in the record; the tool learns each
thread's fs base at its first stop and when the first record probe is placed (every thread
held), and reads the ring before a thread's exit is handled, so that a new thread that
reuses the same TLS block is never given the records of the old one.

**Drops**: a full ring makes the detour count a drop and write nothing (perf's lost
events). ``RingReader.dropped`` is the total, and ``Process.dropped`` shows it.

**A reader that lags** (a busy program writes records faster than Python hands them over)
must not hold up whoever waits for it: a read stops between two records once ``until``
(``time.monotonic()``) has passed, or once a handler ended the run, and keeps the records it
had copied but not delivered for the next read, in order. ``discard()`` releases the rest
unread and counts them (``unread``): what a command ended early says it never read.
Rejected: reading the whole backlog before the end (a 32 MiB ring is 500,000 records, tens
of seconds of Python on a loaded machine: ``-d 1`` once ran for minutes).
"""

from __future__ import annotations

import heapq
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import (
    ENTRY_DATA,
    ENTRY_TSC,
    Captured,
    CapturePlan,
    entry_register_of,
)
from kprobes.arch.x86_64.record import THREAD_MASK, thread_salt
from kprobes.arch.x86_64.regs import REG_INDEX, Regs
from kprobes.arch.x86_64.stackwalk import WalkResult, read_walk_at
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeError
from kprobes.model import ArgValue, EntryData, Event, UserStack
from kprobes.process.fast.probe import FastProbe
from kprobes.process.fetch.evaluate import Memory
from kprobes.process.fetch.fast import entry_registers
from kprobes.values import dataclass, replace

if TYPE_CHECKING:
    from kprobes.arch.x86_64 import ring_block
    from kprobes.core.table import ProbeSite, ProbeTable
    from kprobes.linux.tsc import TscClock
    from kprobes.process.fast.batch import Decoder

_U64: Final = struct.Struct("<Q").unpack_from
BATCH: Final = 16384  # records read by a poll: run(timeout) returns between batches
CHECK_EVERY: Final = 32  # records delivered between two looks at the clock (``until``)
SLICE: Final = 1024  # records copied at a time, then handed over
ENTRY_DATA_KEPT: Final = 1 << 20  # entry actions' values waiting for their returns, at most
TEE_SLICE: Final = 1 << 16  # records copied at a time for a tee (4 MiB of one-slot records)


@dataclass(frozen=True, slots=True)
class Batcher:
    """How the runs of one record id are delivered in batches: for ``probe`` alone at its
    site, its decoder and its output's writer."""

    probe: Kprobe | Kretprobe
    decode: Decoder
    write: Callable[[str, int, int], None]  # a batch's text, its events, those left out
    addr: int  # the site, and its name: what the decoder is given
    location: str
    active: tuple[Kprobe, ...]  # the site's probes it was made for
    lines: bool  # a line an event, decoded with no other effect (``LineFormat.lines``)


class RingTee(Protocol):
    """Takes what each read of the rings copied, as it lies, in place of the handlers: the
    blocks of one read (one a ring), written to a record file (process/fast/tee.py)."""

    def take(self, blocks: Sequence[ring_block.Block]) -> None: ...


@dataclass(slots=True)
class RecordSite:
    """A site optimized with a record action: its id in the records, and its captures."""

    site: ProbeSite
    plan: CapturePlan
    with_regs: bool
    stack_depth: int = 0  # the records hold a stack walk after the captures (0: none)
    # Written at the return, by the trampoline of the return probe whose entry the site is:
    # its plan ends with the real return address ("rip") and the entry time (ENTRY_TSC).
    is_return: bool = False
    # That return probe, where the site has several (None: every return probe there; a
    # record file's reader makes a site of each record id).
    owner: Kretprobe | None = None
    # Written at the entry by ``owner``'s entry action (its values wait for the return's
    # record, by ticket: ``RingReader.entry_data``).
    is_entry_data: bool = False


class RingReader:
    """The rings of one address space, read in order of time, and the threads they name."""

    def __init__(
        self,
        table: ProbeTable,
        views: Callable[[], Iterable[memoryview]],
        symbolize: Callable[[int], str],
        comm: Callable[[int], str],
        fast_of: Callable[[Kprobe | Kretprobe], FastProbe | None],
        name_stack: Callable[[int, WalkResult], UserStack] | None = None,
    ) -> None:
        self.table = table
        self.name_stack = name_stack  # a walk's addresses named as the trap tier names them
        self.fast_of = fast_of  # a probe's FastProbe (Recording keeps them)
        self._areas = views
        self.symbolize = symbolize
        self.comm = comm
        self.sites: dict[int, RecordSite] = {}  # record id → site
        self.threads: dict[int, int] = {}  # fs base → tid
        self.dropped = 0
        self.delivered = 0
        self.unread = 0  # records released without being read (discard)
        # Reads stop between two records once time.monotonic() passes this (None: never).
        self.until: float | None = None
        self._kept: deque[sa.Record] = deque()  # copied, not delivered: the next read's first
        # Called with an unknown thread pointer (a thread set its TLS after we last looked,
        # as the loader does at startup): look at every thread again.
        self.relearn: Callable[[], None] = lambda: None
        self._draining = False
        self.is_muted = False  # discard(): records are released unread from then on
        self._clock: TscClock | None = None
        # Record id and slots → its batch path, or None: the handlers' (made at its first run).
        self._batchers: dict[tuple[int, int], Batcher | None] = {}
        # Takes the records as they lie in place of the handlers (``kprobes record``).
        self.tee: RingTee | None = None
        # The values of entry actions' records whose return is not read yet, by ticket + 1.
        self.entry_data: dict[int, EntryData] = {}
        self.after_drain: Callable[[], None] = lambda: None  # stackcounts.py's tables

    @property
    def is_active(self) -> bool:
        return bool(self.sites)

    @property
    def clock(self) -> TscClock | None:
        """Ticks to seconds (made with the first site; a record file's reader sets it)."""
        return self._clock

    @clock.setter
    def clock(self, value: TscClock) -> None:
        self._clock = value

    def tid_of(self, thread: int) -> int:
        """The thread a records' thread pointer names (0 if no thread has it now)."""
        tid = self.threads.get(thread)
        return self._thread_miss(thread) if tid is None else tid

    @property
    def is_draining(self) -> bool:
        """Records are being handed over: an exception raised now (by a signal handler)
        would lose the one in hand, neither delivered nor counted."""
        return self._draining

    def add_site(
        self,
        site: ProbeSite,
        plan: CapturePlan,
        with_regs: bool,
        stack_depth: int = 0,
        *,
        owner: Kretprobe | None = None,
        entry_data: bool = False,
    ) -> int:
        """A new record id for ``site`` (never reused: old records may still be in a ring):
        of its entry, or of the returns of ``owner``, a return probe whose entry it is, or
        (``entry_data``) of ``owner``'s entry action."""
        if self._clock is None:
            from kprobes.linux.tsc import TscClock  # a record probe's: on its first site

            self._clock = TscClock()
        rid = len(self.sites) + 1
        is_return = owner is not None and not entry_data
        self.sites[rid] = RecordSite(
            site, plan, with_regs, stack_depth, is_return, owner, is_entry_data=entry_data
        )
        return rid

    def note_thread(self, fs_base: int, tid: int, number: int = 0) -> None:
        """Records of thread pointer ``fs_base`` in the address space numbered ``number``
        (record.py's ``thread_salt``) are thread ``tid``'s."""
        self.threads[fs_base ^ thread_salt(number)] = tid
        self.comm(tid)  # read now: the thread may be gone when its records are read

    def forget(self) -> None:
        """The address space was replaced (exec): its rings were read for the last time
        (what a late read left in them is counted unread)."""
        self.unread += len(self._kept)
        self._kept.clear()
        for view in self._areas():
            self.unread += sa.skip_records(view)
        self.sites.clear()
        self.threads.clear()
        self._batchers.clear()

    # -- reading --------------------------------------------------------------------------

    def drain(self, *, everything: bool = True, below: float | None = None) -> None:
        """Read the rings and hand each record to its probes' handlers: a batch, or
        ``everything`` written so far (at most one ring's worth more, were the program to
        keep writing as fast as we read); either way no later than ``until``, looked at
        between slices. ``below``: a poll that gives way (giveway.py), in slices of
        ``SLICE`` records, while no ring's ``fill()`` has reached it."""
        if self._clock is None or self._draining:
            return
        if self.is_muted:
            self.discard()
            return
        self._draining = True
        try:
            if self._kept and not self._deliver_kept():
                return
            # Read in slices, so that records are handed over as they are copied and the
            # clock (and a handler's end of the run) is looked at often; a poll reads a
            # batch of them, a full read the ring's worth.
            most = max(self._capacities(), default=0) if everything else BATCH
            piece = SLICE if self.tee is None else TEE_SLICE
            for _ in range(1 + most // piece):
                if self._is_late() or self.table.pending_error is not None:
                    break
                if below is not None and self.fill() >= below:
                    break
                if self._drain(piece) < piece:
                    break
            if everything:
                self.after_drain()
        finally:
            self._draining = False

    def discard(self) -> None:
        """Nobody wants the records any more (the run was interrupted, or had its fill of
        events): those not read yet, and all that come, are released unread and counted."""
        self.is_muted = True
        self.unread += len(self._kept)
        self._kept.clear()
        for view in self._areas():
            self.dropped += sa.read_records(view, limit=0).dropped
            self.unread += sa.skip_records(view)

    def count_drops(self) -> int:
        """``dropped``, up to date, without reading a record (a count must not wait for a
        reader that lags)."""
        if self._clock is not None:
            for view in self._areas():
                self.dropped += sa.read_records(view, limit=0).dropped
        return self.dropped

    def _is_late(self) -> bool:
        return self.until is not None and time.monotonic() >= self.until

    def fill(self) -> float:
        """The fullest ring's share written and not read yet (giveway.py)."""
        return max((sa.fill(view) for view in self._areas()), default=0.0)

    def _capacities(self) -> Iterable[int]:
        return (sa.layout_of(view).capacity for view in self._areas())

    def _drain(self, limit: int) -> int:
        assert self._clock is not None
        self._clock.sample()
        from kprobes.arch.x86_64 import ring_block  # the records' code: with the first site

        blocks = [ring_block.read_block(view, limit=limit) for view in self._areas()]
        for block in blocks:
            self.dropped += block.dropped
        if self.tee is not None:
            self.tee.take(blocks)
            self.delivered += sum(block.count for block in blocks)
        else:
            self.deliver_blocks(blocks)
        return max((block.count for block in blocks), default=0)

    def deliver_blocks(self, blocks: Sequence[ring_block.Block]) -> None:
        """The blocks one read took from the rings (one a ring), to their handlers or
        their batch path: one ring's block as it lies, several rings' records merged by
        time. A record file's reader (``kprobes script``) hands its blocks here too."""
        if len(blocks) == 1 and not self._kept:  # one ring: its block, in batches
            self._deliver_block(blocks[0])
            return
        batches = [block.records() for block in blocks if block.count]
        records: Iterable[sa.Record] = (
            batches[0] if len(batches) == 1 else heapq.merge(*batches, key=lambda r: r.tsc)
        )
        self._kept.extend(records)
        self._deliver_kept()

    def _deliver_kept(self) -> bool:
        """The copied records, oldest first, until a handler ends the run or ``until``
        passes (looked at every ``CHECK_EVERY`` records); True if none is left."""
        kept = self._kept
        deliver = self._deliver
        table = self.table
        while kept:
            if self._is_late():
                return False  # the rest wait for the next read, or for discard()
            for _ in range(min(CHECK_EVERY, len(kept))):
                if table.pending_error is not None:
                    return False  # a handler ended the run
                deliver(kept.popleft())
        return True

    def _deliver_block(self, block: ring_block.Block) -> None:
        """A block's records in order: a run whose probe takes batches through its decoder,
        the others one by one to their handlers; what a late read or a handler's end of
        the run leaves is kept for the next read (as records)."""
        assert self._clock is not None
        runs = block.runs
        view = memoryview(block.data)
        batcher_of = self._run_batcher
        from kprobes.process.fast.interleave import decode_interleaved

        together = decode_interleaved(block, batcher_of, self._clock.segment_of)
        for i, run in enumerate(runs):
            if self._is_late() or self.table.pending_error is not None:
                self._kept.extend(block.records(runs[i:]))
                return
            batcher = batcher_of(run)
            if batcher is None:
                self._kept.extend(block.records((run,)))
                if not self._deliver_kept():
                    self._kept.extend(block.records(runs[i + 1 :]))
                    return
                continue
            text = None if together is None else together.take(run)
            printed = run.count
            if text is None:
                first_tsc = _U64(block.data, run.start + sa.REC_TSC)[0]
                segment = self._clock.segment_of(first_tsc)
                text, printed = batcher.decode(
                    view[run.start : run.end], *segment, batcher.addr, batcher.location
                )
            self.delivered += run.count
            try:
                batcher.write(text, printed, run.count - printed)
            except Exception as exc:  # raised from run(), as a handler's would be
                self.table.park(exc)

    def _run_batcher(self, run: ring_block.Run) -> Batcher | None:
        """``run``'s batch path (``_batcher``), looked up once while its site's probes stay
        the same."""
        if run.has_regs:
            return None
        key = (run.probe, run.slots)
        known = self._batchers.get(key)
        if known is not None:
            rs = self.sites.get(run.probe)
            if rs is not None and rs.site.active is known.active:
                return known
        return self._batcher(*key)

    def _batcher(self, rid: int, slots: int) -> Batcher | None:
        """The batch path of record id ``rid``'s runs of ``slots`` slots, if its site has
        one probe with a handler and that probe takes batches (made once, and again when
        the site's probes change)."""
        rs = self.sites.get(rid)
        if rs is None or rs.stack_depth or rs.is_entry_data:  # stacks: events, one by one
            return None
        active = record_targets(rs)
        fp = self.fast_of(active[0]) if len(active) == 1 else None
        if fp is None or fp.batch is None:
            return None
        key = (rid, slots)
        if key in self._batchers:
            known = self._batchers[key]
            if known is None or known.probe is active[0]:
                if known is not None and known.active is not rs.site.active:
                    self._batchers[key] = known = replace(known, active=rs.site.active)
                return known
        self._batchers[key] = made = self._make_batcher(rs, active[0], fp, slots)
        return made

    def _make_batcher(
        self, rs: RecordSite, kp: Kprobe | Kretprobe, fp: FastProbe, slots: int
    ) -> Batcher | None:
        assert self._clock is not None and fp.batch is not None
        try:
            from kprobes.process.fast.batch import plan_decoder

            plan = plan_decoder(fp.spec, fp.resolvers, rs.plan, rs.site.addr)
        except ProbeError:
            # Its @symbol asked of a program that is gone (a short one, its records read
            # after its exit): each event then goes through the handler, whose fetcher
            # resolved it at placing.
            return None
        if plan is None:
            return None
        layout = plan.layout(fp.group, fp.event, fp.pid, self.comm, self.symbolize, rs.site.addr)
        line = fp.batch.writer(layout)
        if line is None:
            return None
        decode = plan.compile(
            line, slots, self.threads, self._thread_miss, self._clock.seconds, self.comm
        )
        addr = rs.site.addr
        return Batcher(
            kp, decode, line.write, addr, self.symbolize(addr), rs.site.active, line.lines
        )

    def _thread_miss(self, thread: int) -> int:
        """A thread pointer not known yet: look at every thread again (``relearn``)."""
        self.relearn()
        return self.threads.setdefault(thread, 0)

    def _deliver(self, record: sa.Record) -> None:
        rs = self.sites.get(record.probe)
        if rs is None:
            return
        assert self._clock is not None
        captured = Captured(rs.plan, record.data)
        tid = self.threads.get(record.thread)
        if tid is None:
            tid = self._thread_miss(record.thread)
        regs = Regs(tid)
        words = regs.words
        if record.regs is not None:
            for name, value in zip(sa.REG_ORDER, record.regs, strict=True):
                words[REG_INDEX[name]] = value
        entered = captured.regs.pop(ENTRY_TSC, 0)
        ticket = captured.regs.pop(ENTRY_DATA, 0)
        kept = _entry_words(captured.regs) if rs.is_return else None
        for name, value in captured.regs.items():
            words[REG_INDEX[name]] = value
        ip = words[REG_INDEX["rip"]] if rs.is_return else rs.site.addr
        words[REG_INDEX["rip"]] = ip
        words[REG_INDEX["fs_base"]] = record.thread & THREAD_MASK
        memory = Memory(captured.read, captured.read_string, self.symbolize, self.comm)
        if rs.is_entry_data:
            self._keep_entry_data(rs, record.ticket, regs, memory)
            return
        cpu = -1 if record.cpu == sa.META_CPU_MASK else record.cpu
        when = self._clock.seconds(record.tsc)
        snapshot = regs.frozen() if rs.with_regs else None
        name = self.comm(tid)
        location = self.symbolize(ip)
        stack = None
        if rs.stack_depth and self.name_stack is not None:
            walk = read_walk_at(record.data, rs.plan.size)
            stack = self.name_stack(ip, walk)
        fast_of = self.fast_of
        returned = _return_fields(
            rs, self.symbolize, self._clock.seconds(entered) if entered else 0.0
        )
        data = self.entry_data.pop(ticket, None) if ticket else None
        for target in record_targets(rs):
            handler: Callable[[Any, Event], Any] | None = target.async_handler
            if handler is None:
                continue
            fp = fast_of(target)
            if fp is None:
                continue
            at_entry = () if not kept else _at_entry(fp, tid, kept, memory)
            args = fp.fetcher.fetch(regs, memory, at_entry)
            event = Event(
                fp.group, fp.event, fp.pid, tid, name, cpu, when, ip, location, args,
                regs=snapshot if fp.with_regs else None,
                stack=None if fp.stack_depth is None else cut_stack(stack, fp.stack_depth),
                data=data if fp.entry is not None else None,
                **returned,
            )  # fmt: skip
            if fp.entry is not None and data is None and isinstance(target, Kretprobe):
                target.nmissed_data += 1
            self.delivered += 1
            try:
                handler(target, event)
            except Exception as exc:  # raised from run(), as a trap handler's would be
                self.table.park(exc)

    def _keep_entry_data(self, rs: RecordSite, ticket: int, regs: Regs, memory: Memory) -> None:
        """An entry action's record: its values, kept for the return's record, which names
        it by ``ticket`` + 1 (the oldest are let go past ``ENTRY_DATA_KEPT``: frames that
        never return, left by a ``longjmp``)."""
        fp = None if rs.owner is None else self.fast_of(rs.owner)
        if fp is None or fp.entry is None:
            return
        kept = self.entry_data
        kept[ticket + 1] = fp.entry.data(regs, memory)
        if len(kept) > ENTRY_DATA_KEPT:
            del kept[next(iter(kept))]


def cut_stack(stack: UserStack | None, depth: int | None) -> UserStack | None:
    """``stack`` to ``depth`` frames (a site's walk takes the most any of its probes wants)."""
    if stack is None or depth is None or len(stack.frames) <= depth:
        return stack
    return UserStack(stack.frames[:depth], "depth limit")


def _entry_words(regs: dict[str, int]) -> dict[str, int]:
    """The words a return record's entry kept, taken out of its registers (by register)."""
    return {reg: regs.pop(name) for name in list(regs) if (reg := entry_register_of(name))}


def _at_entry(
    fp: FastProbe, tid: int, kept: dict[str, int], memory: Memory
) -> tuple[ArgValue, ...]:
    """A return record's ``$argN``: evaluated on the registers its entry kept."""
    regs = Regs(tid)
    for reg in entry_registers(fp.spec):
        regs.words[REG_INDEX[reg]] = kept[reg]
    return fp.fetcher.entry(regs, memory)


def record_targets(rs: RecordSite) -> list[Kprobe | Kretprobe]:
    """The probes whose ``async_handler`` takes the records of ``rs``: its probes, or, for
    the records of returns, the return probes whose entry its probes are."""
    out: list[Kprobe | Kretprobe] = []
    for probe in rs.site.active:
        target = probe.owner if rs.is_return else probe
        if rs.owner is not None and target is not rs.owner:
            continue  # another return probe's records
        if isinstance(target, Kprobe | Kretprobe) and target.async_handler is not None:
            out.append(target)
    return out


def _return_fields(
    rs: RecordSite, symbolize: Callable[[int], str], entered: float
) -> dict[str, Any]:
    """The fields a return event adds (``Event(**fields)``): none for an entry's record."""
    if not rs.is_return:
        return _NO_FIELDS
    func_ip = rs.site.addr
    return {
        "is_return": True,
        "func": symbolize(func_ip).split("+")[0],
        "func_ip": func_ip,
        "entry_timestamp": entered,
    }


_NO_FIELDS: Final[dict[str, Any]] = {}
