"""Record probes on a process: the action of a site whose probes have asynchronous handlers,
the threads the records name, and the reading of the rings (reader.py has the reader).

A probe with an ``async_handler`` is prepared at registration (``equip``: its
``args`` parsed, its trap-tier handler built), so that it works on traps from the start; the
optimizer then gives its site a record action where the code allows it: the captures of
every such probe's fetch-args (fetch/fast.py), the registers if one of them wants them, and
the counter that ``nhit`` reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import CapturePlan
from kprobes.arch.x86_64.detour import Action, CountAction
from kprobes.arch.x86_64.record import CpuId, RecordAction
from kprobes.arch.x86_64.retstack import ENTRY_TICKET
from kprobes.arch.x86_64.stackids import StackCountAction, StackTable, stride_for
from kprobes.core.probes import check_handlers
from kprobes.errors import InternalError, TargetError, UnsupportedOption
from kprobes.process.engine.threads import ThreadState
from kprobes.process.fast.frametables import FrameTables
from kprobes.process.fast.giveway import GiveWay
from kprobes.process.fast.lease import Lease
from kprobes.process.fast.probe import FastProbe, equip
from kprobes.process.fast.reader import RingReader
from kprobes.process.fast.stackcounts import StackTally
from kprobes.process.fast.trapevents import return_trap_delivery, trap_delivery
from kprobes.process.fetch.evaluate import CommCache, CpuReader, Memory, Symbolizer
from kprobes.process.fetch.fast import (
    NotCapturable,
    entry_registers,
    plan_captures,
    plan_return_captures,
)


class StackNames(Protocol):
    """What names the frames of stacks walked in the program (process/stacks.py's
    ``Backtraces``): it may read the live program's symbols; records are named later."""

    def walked(self, ip: int, walk: WalkResult) -> UserStack: ...

    def note_main(self) -> None: ...


if TYPE_CHECKING:
    from kprobes.arch.x86_64.stackwalk import WalkResult
    from kprobes.core.optimizer import SiteOpt
    from kprobes.core.probes import Kprobe
    from kprobes.core.retprobes import Kretprobe
    from kprobes.core.table import ProbeSite, ProbeTable
    from kprobes.model import UserStack
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.threads import Thread
    from kprobes.process.fast.state import JumpState, SharedArea
    from kprobes.process.inject.program import ProgramCalls


def _cpu_id() -> CpuId:
    """rdpid where the CPU has it, else rdtscp (both read the CPU number Linux keeps in
    TSC_AUX)."""
    global _CPU_ID
    if _CPU_ID is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "").split()
        except OSError:
            flags = []
        _CPU_ID = (
            CpuId.RDPID if "rdpid" in flags else CpuId.RDTSCP if "rdtscp" in flags else CpuId.NONE
        )
    return _CPU_ID


_CPU_ID: CpuId | None = None


class Recording:
    """Record probes, for ``Process``: their preparation, their actions, their reader."""

    def __init__(
        self,
        program: Attachment,
        injector: ProgramCalls,
        state: JumpState,
        table: ProbeTable,
    ) -> None:
        self._program = program
        self.pid = program.pid
        self._tracer = program.tracer
        self._injector = injector
        self._state = state
        self._table = table
        # Each probe with an async_handler: its FastProbe and what runs it at a trap. The
        # probe is held too, so that its id names it alone while it is here.
        self._fast: dict[int, tuple[Kprobe, FastProbe, Callable[[Kprobe, Any], None]]] = {}
        # Each return probe with an async_handler: its FastProbe (its records are written
        # at the return, by its trampoline: fast/returns.py).
        self._returns: dict[int, tuple[Kretprobe, FastProbe]] = {}
        self._cpu: CpuReader | None = None
        self._give_way = GiveWay()
        self.after_poll: Callable[[], None] = lambda: None  # a stream's flush (cli/trace_cmd.py)
        self.tables = FrameTables(program, injector, state)  # for records with a stack
        self.stack_tally: StackTally | None = (
            None  # stacks counted in the program (with the reader)
        )
        # Names the frames of a stack walked in the program (stacks.py; target.py sets it).
        self.stack_names: StackNames | None = None
        table.run_async = self._run_at_trap

    def _fetch(self, addr: int, size: int) -> bytes:
        return self._program.memory().read_as_program(addr, size)

    def _fetch_string(self, addr: int, max_len: int = 4096) -> bytes:
        return self._program.memory().read_string(addr, max_len, as_program=True)

    def equip_async(self, kps: Sequence[Kprobe], events: Mapping[Kprobe, str]) -> None:
        """Prepare the probes with an asynchronous handler (before anything is placed: a
        wrong fetch-arg raises SpecError here), their events named as ``events`` says.
        ``args`` or an event name without one would be for nobody: refused
        (``UnsupportedOption``), never ignored."""
        for kp in kps:
            check_handlers(kp)
            if kp.async_handler is None and (kp.args or kp in events or kp.with_regs):
                if kp.args:
                    option, what = f"args={' '.join(kp.args)!r}", "fetch-args are evaluated"
                elif kp in events:
                    option, what = f"event={events[kp]!r}", "events are made"
                else:
                    option, what = "with_regs=True", "registers are copied"
                raise UnsupportedOption(
                    "Process",
                    option,
                    "Kprobe",
                    f"{what} for the records of an async_handler; a pre_handler reads "
                    "registers and memory itself (give an async_handler, or leave them out)",
                )
            if kp.async_handler is None or id(kp) in self._fast:
                continue
            reader = self.ring_reader()
            memory = Memory(self._fetch, self._fetch_string, reader.symbolize, reader.comm)
            event = events.get(kp, "")
            self.prepare(kp, equip(kp, self._program.symbols, memory, pid=self.pid, event=event))

    def prepare(self, kp: Kprobe, fp: FastProbe) -> None:
        """``kp``'s async_handler is run with ``fp`` (the command line's own probes come
        prepared so; ``equip_async`` prepares the API's)."""
        if self._cpu is None:
            self._cpu = CpuReader(self.pid)
        self._fast[id(kp)] = (kp, fp, trap_delivery(fp, self._cpu))

    def prepare_return(self, rp: Kretprobe, fp: FastProbe) -> None:
        """``rp``'s async_handler is run with ``fp``'s events of its returns, from the records
        its trampoline writes (``return_record``); where its entry keeps the int3, its trap
        handlers make them."""
        if self._cpu is None:
            self._cpu = CpuReader(self.pid)
        self._returns[id(rp)] = (rp, fp)

    @contextmanager
    def returns_equipped(
        self, rps: Sequence[Kretprobe], events: Mapping[Kretprobe, str]
    ) -> Iterator[None]:
        """Around the registration of ``rps``: those with an asynchronous handler prepared
        first (``equip_returns``), forgotten if they end up unregistered."""
        try:
            self.equip_returns(rps, events)
            yield
        except BaseException:
            self.forget([rp for rp in rps if not rp.is_registered])
            raise

    def equip_returns(self, rps: Sequence[Kretprobe], events: Mapping[Kretprobe, str]) -> None:
        """Prepare the API's return probes with an asynchronous handler (a wrong fetch-arg
        raises SpecError here): the records of the fast tier, and at the return's trap the
        same event, made by its handler."""
        for rp in rps:
            if rp.async_handler is None:
                if rp.args or rp in events or rp.with_regs or rp.entry_args:
                    raise UnsupportedOption(
                        "Process",
                        f"args={' '.join(rp.args)!r}"
                        if rp.args
                        else f"event={events[rp]!r}"
                        if rp in events
                        else "with_regs=True"
                        if rp.with_regs
                        else f"entry_args={' '.join(rp.entry_args)!r}",
                        "Kretprobe",
                        "its handler runs at the return with the live registers: read them "
                        "there (or give an async_handler)",
                    )
                continue
            if id(rp) in self._returns:
                continue
            if rp.handler or rp.entry_handler or rp.data_size:
                raise UnsupportedOption(
                    "Process",
                    "async_handler",
                    "Kretprobe",
                    "an async_handler sees returns after the fact: it does not go with a "
                    "handler, an entry_handler or data_size (register two probes)",
                )
            reader = self.ring_reader()
            memory = Memory(self._fetch, self._fetch_string, reader.symbolize, reader.comm)
            fp = equip(rp, self._program.symbols, memory, pid=self.pid, event=events.get(rp, ""))
            self.prepare_return(rp, fp)
            assert self._cpu is not None
            rp.entry_handler, rp.handler = return_trap_delivery(rp, fp, self._cpu, self.drain_rings)
            rp.handlers_on_traps_only = True

    def fast_of(self, kp: Kprobe | Kretprobe) -> FastProbe | None:
        entry = self._fast.get(id(kp))
        if entry is not None:
            return entry[1]
        ret = self._returns.get(id(kp))
        return None if ret is None else ret[1]

    def forget(self, kps: Sequence[Kprobe | Kretprobe]) -> None:
        """The probes were unregistered (or never were): nothing of theirs is kept."""
        for kp in kps:
            self._fast.pop(id(kp), None)
            self._returns.pop(id(kp), None)

    def close(self) -> None:
        """The process is no longer traced: the files the trap tier's events read go, and
        no thread waits for room in a ring any more."""
        self._state.release_waiters()
        if self._cpu is not None:
            self._cpu.close()

    def _run_at_trap(self, kp: Kprobe, regs: Any) -> None:
        entry = self._fast.get(id(kp))
        if entry is not None:
            entry[2](kp, regs)

    @property
    def dropped(self) -> int:
        """Records of optimized probes lost to a full ring (perf's lost events): their hits
        are in ``nhit``, their handlers did not run."""
        reader = self._state.reader
        if reader is None:
            return 0
        tally = self.stack_tally
        return reader.count_drops() + (0 if tally is None else tally.lost())

    @property
    def unread(self) -> int:
        """Records of optimized probes released without being read (``discard_records``):
        hits that are in ``nhit`` whose handlers never ran."""
        reader = self._state.reader
        return 0 if reader is None else reader.unread

    @property
    def reading_deadline(self) -> float | None:
        """A ``time.monotonic()`` after which every read of the rings (``run()``'s, a
        detach's) stops between two records and leaves the rest for the next read or for
        ``discard_records``: how a command keeps its deadline while its reader lags (None,
        the default: every read hands over all that was written)."""
        reader = self._state.reader
        return None if reader is None else reader.until

    @reading_deadline.setter
    def reading_deadline(self, value: float | None) -> None:
        self.ring_reader().until = value

    @property
    def is_recording(self) -> bool:
        """Some probe writes records into the rings (an optimized record probe)."""
        reader = self._state.reader
        return reader is not None and reader.is_active

    @property
    def is_reading_records(self) -> bool:
        """A read of the rings is handing records to their handlers (``sigint.py``: not a
        moment to raise an exception; ``end_run`` stops the read between two records)."""
        reader = self._state.reader
        return reader is not None and reader.is_draining

    def read_records(self) -> None:
        """Hand the records written so far to their handlers (until ``reading_deadline``),
        outside ``run()``: what a command reads once it has disabled its probes. An
        exception a handler raised is raised here."""
        self.drain_rings()
        exc = self._table.take_error()
        if exc is not None:
            raise exc

    @property
    def ring_size(self) -> int:
        """Bytes of each shared ring of records (set before the first record probe is
        optimized; a power of two, at least 8 KiB)."""
        return self._state.ring_bytes

    @ring_size.setter
    def ring_size(self, value: int) -> None:
        if self._state.areas:
            raise TargetError("the ring is in use: set ring_size before optimizing")
        sa.AreaLayout(0, value // sa.SLOT)  # raises for a size that is not one
        self._state.ring_bytes = value

    @property
    def block_when_full(self) -> bool:
        """A record probe's hit that finds its ring full waits for the reader to make room,
        as long as the reader reads, instead of dropping (``trace --block``): every event
        is kept, at the cost of slowing the program to the reader's pace. Set before the
        first record probe is optimized."""
        return self._state.waits_when_full

    @block_when_full.setter
    def block_when_full(self, value: bool) -> None:
        if value == self._state.waits_when_full:
            return
        if self._state.areas:
            raise TargetError("the rings are in use: set block_when_full before optimizing")
        self._state.waits_when_full = value

    def ring_reader(self) -> RingReader:
        state = self._state
        if state.reader is None:
            state.reader = RingReader(
                self._table,
                lambda: [area.view for area in state.areas],
                Symbolizer(lambda addr: self._program.symbols().locate_address(addr)),
                CommCache(self.pid),
                self.fast_of,
                lambda ip, walk: self._name_stack(ip, walk),
            )
            self.stack_tally = StackTally(
                lambda: state.areas, state.reader, self.fast_of, self._name_stack
            )
            state.reader.after_drain = self.stack_tally.take
        return state.reader

    def follow_stacks(self, names: StackNames, code_watchers: list[Callable[[], None]]) -> None:
        """Stacks walked in the program are named by ``names``; the frame tables follow
        the code through ``code_watchers`` (process/following/) once a walk needs them."""
        self.stack_names = names
        self.tables.code_watchers = code_watchers

    def _name_stack(self, ip: int, walk: WalkResult) -> UserStack:
        if self.stack_names is None:
            raise InternalError("a stack walked in the program, and nothing to name it")
        return self.stack_names.walked(ip, walk)

    def drain_rings(self) -> None:
        """Every record written so far to its handlers (before a trap's event, at the end
        of ``run()``, before the counts are read)."""
        reader = self._state.reader
        if reader is not None:
            reader.drain()

    def discard_records(self) -> None:
        """Drop the records of optimized probes not read yet (their handlers will not see
        them): what a run that was interrupted, or had enough, leaves behind."""
        reader = self._state.reader
        self._state.release_waiters()  # nobody reads for them any more
        if reader is not None:
            reader.discard()

    def poll_rings(self) -> None:
        """One batch of records, while ``run()`` waits for stops, giving way to the program
        (giveway.py) unless its threads wait for the reader (``--block``) or the records
        are only copied (``record``'s tee)."""
        reader = self._state.reader
        if reader is not None:
            may = not self._state.waits_when_full and reader.tee is None
            self._give_way.poll(reader, may=may)
            self.after_poll()

    def learn_thread(self, t: Thread) -> None:
        """A new thread's first stop: its thread pointer names it in records from now on
        (records of an exited thread that had the same one are read first)."""
        reader = self._state.reader
        if reader is not None and reader.is_active:
            reader.drain()
            reader.note_thread(t.load_regs().fs_base, t.tid, t.tracee.number)

    def action(self, site: ProbeSite, area: SharedArea, so: SiteOpt) -> Action | str:
        """The site's action: a count, or a record if a probe has an asynchronous handler
        (then also the count); a str says why the site cannot be optimized."""
        record = self.entry_record(site, area, so)
        return CountAction(area.counter_addr(so.counter)) if record is None else record

    def entry_record(
        self, site: ProbeSite, area: SharedArea, so: SiteOpt, *, counted: bool = True
    ) -> RecordAction | StackCountAction | str | None:
        """The record of a hit of the site's probes with an asynchronous handler (None:
        none has one), also counting it unless the site counts its hits otherwise (a
        return probe's entry: ``counted`` off); a str says why it cannot be made. Where
        every such probe counts by stack (``count_sink``), a stack count instead, with no
        record (stackcounts.py)."""
        wanted = [p for p in site.probes if p.async_handler is not None]
        fast = [fp for fp in map(self.fast_of, wanted) if fp is not None]
        if len(fast) < len(wanted):
            return "its asynchronous handler was not prepared"
        if not fast:
            return None
        if counted and all(fp.count_sink is not None for fp in fast):
            return self._stack_count_action(site, area, so, fast)
        try:
            plan = plan_captures([(fp.spec, fp.resolvers) for fp in fast])
        except NotCapturable as exc:
            return str(exc)
        with_regs = any(fp.with_regs for fp in fast)
        # The user stack, walked in the detour, for the probe that wants the most frames.
        depth = max((fp.stack_depth or 0 for fp in fast), default=0)
        return self._record_action(site, area, so, plan, with_regs, counted=counted, depth=depth)

    def return_record(
        self, site: ProbeSite, area: SharedArea, so: SiteOpt, rp: Kretprobe
    ) -> tuple[RecordAction, tuple[str, ...], RecordAction | None] | str | None:
        """The record the trampoline of return probe ``rp`` (whose entry is ``site``) writes
        of each return, the registers its entry keeps for it and the record of its entry
        action (None: it has none), or None (it writes none, it aggregates), or why the
        site cannot be optimized: the return's fetch-args, its caller, its entry time, its
        ``$argN``, its entry action's fetch-args."""
        if rp.async_handler is None or not rp.optimize:
            return None
        entry = self._returns.get(id(rp))
        if entry is None:
            return "its asynchronous handler was not prepared"
        fp = entry[1]
        try:
            plan = plan_return_captures(fp.spec, fp.resolvers, entry_data=fp.entry is not None)
            keeps = entry_registers(fp.spec)
            data_plan = None
            if fp.entry is not None:
                data_plan = plan_captures([(fp.entry.spec, fp.resolvers)])
        except NotCapturable as exc:
            return str(exc)
        # The caller's stack, walked by the trampoline from the real return address.
        depth = fp.stack_depth or 0
        record = self._record_action(site, area, so, plan, fp.with_regs, returns=rp, depth=depth)
        if isinstance(record, str):
            return record
        if data_plan is None:
            return record, keeps, None
        data = self._record_action(site, area, so, data_plan, False, returns=rp, entry_data=True)
        return data if isinstance(data, str) else (record, keeps, data)

    def _record_action(
        self,
        site: ProbeSite,
        area: SharedArea,
        so: SiteOpt,
        plan: CapturePlan,
        with_regs: bool,
        *,
        returns: Kretprobe | None = None,
        counted: bool = True,
        depth: int = 0,
        entry_data: bool = False,
    ) -> RecordAction | str:
        """A record action of ``plan`` for ``site`` (at its entry, or at the return of the
        return probe ``returns``, which its trampoline counts, or, ``entry_data``, at the
        entry for that probe's entry action), its record id kept while the plan holds; it
        counts the hit too if ``counted`` (and not ``returns``)."""
        if plan.reads_memory:
            # A bad pointer must give (fault): the tracer fixes such faults, and the rescue
            # once the tool is gone (faults.py). Without a rescue (seccomp) the program
            # is no worse off than with our int3s, which need it as much.
            self._injector.activate_fetch_faults()
        stack = None
        if depth:  # the first frame is the hit's ip: the others are return addresses
            walk = self.tables.walk(so.area, max(depth - 1, 1))
            if isinstance(walk, str):
                return walk
            if self.stack_names is not None:
                self.stack_names.note_main()
            # A stack the walk cannot read must give UNREADABLE, never the program's
            # SIGSEGV, when the tool is gone too: as a fetch that reads memory.
            self._injector.activate_fetch_faults()
            stack = walk
        reader = self.ring_reader()
        if self._state.waits_when_full:
            self._hold_lease()
        if not reader.is_active:
            self._learn_all_threads(reader)
        ids = so.entry_data if entry_data else so.returns
        if returns is None:
            rid, held = so.record_id, so.plan
        else:
            rid, held = ids.get(returns, (0, None))
        known = reader.sites.get(rid)
        if (
            known is None
            or held != plan
            or known.with_regs != with_regs
            or known.stack_depth != depth
        ):
            rid = reader.add_site(
                site, plan, with_regs, depth, owner=returns, entry_data=entry_data
            )
            if returns is not None:
                ids[returns] = rid, plan
            else:
                so.record_id, so.plan = rid, plan
        try:
            return RecordAction(
                rid,
                area.layout.ring_at(area.addr),
                with_regs=with_regs,
                plan=plan,
                cpu_id=_cpu_id(),
                counter=area.counter_addr(so.counter) if counted and returns is None else None,
                may_wait=self._state.waits_when_full,
                stack=stack,
                ticket_to=ENTRY_TICKET if entry_data else None,
            )
        except InternalError as exc:  # a record larger than the ring's mirror
            return f"its fetch-args need too large a record: {exc}"

    def _stack_count_action(
        self, site: ProbeSite, area: SharedArea, so: SiteOpt, fast: Sequence[FastProbe]
    ) -> StackCountAction | str:
        """Hits counted by stack id in the program (stackcounts.py), no record each."""
        layout = area.layout
        if not layout.stack_entries:
            return "its shared area has no table of stack ids (stack_ids was set after it)"
        depth = max(fp.stack_depth or 1 for fp in fast)
        walk = self.tables.walk(so.area, max(depth - 1, 1))
        if isinstance(walk, str):
            return walk
        if stride_for(walk.max_returns) > layout.stack_stride:
            return f"its area's stack ids hold fewer than {walk.max_returns} return addresses"
        if self.stack_names is not None:
            self.stack_names.note_main()
        self._injector.activate_fetch_faults()  # a bad stack: UNREADABLE, never a SIGSEGV
        reader = self.ring_reader()
        known = reader.sites.get(so.record_id)
        if known is None or known.plan != CapturePlan() or known.stack_depth != depth:
            so.record_id, so.plan = (
                reader.add_site(site, CapturePlan(), False, depth),
                CapturePlan(),
            )
        assert self.stack_tally is not None  # made with the reader
        self.stack_tally.is_active = True
        table = StackTable(
            area.addr + layout.stacks_offset,
            layout.stack_entries,
            layout.stack_stride,
            area.addr + sa.OFF_STACKS_LOST,
        )
        return StackCountAction(so.record_id, table, walk, area.counter_addr(so.counter))

    @property
    def stack_ids(self) -> tuple[int, int]:
        """The table of stack ids each shared area holds (``stackcount``): (entries, return
        addresses each), (0, 0) for none. Set before the first probe is optimized."""
        return self._state.stack_ids, self._state.stack_returns

    @stack_ids.setter
    def stack_ids(self, value: tuple[int, int]) -> None:
        if self._state.areas:
            raise TargetError("the shared areas are in use: set stack_ids before optimizing")
        entries, returns = value
        if entries:
            sa.AreaLayout(0, 0, entries, stride_for(returns))  # raises for a wrong size
        self._state.stack_ids, self._state.stack_returns = entries, returns

    def _hold_lease(self) -> None:
        """Producers that find the ring full wait from now on, while the tool lives and
        reads (lease.py); not once the reader was told to stop (``discard_records``)."""
        state = self._state
        if state.reader is not None and state.reader.is_muted:
            return
        if state.lease is None:
            state.lease = Lease(lambda: [area.view for area in state.areas])
        state.lease.hold()

    def _learn_all_threads(self, reader: RingReader) -> None:
        self._note_threads(reader)
        reader.relearn = self._relearn_threads
        self._tracer.on_thread_start = self.learn_thread
        self._tracer.ring_poll = self.poll_rings

    def _note_threads(self, reader: RingReader) -> None:
        """Every held thread's thread pointer (the world is stopped)."""
        for t in self._tracer.threads.values():
            if t.state in (ThreadState.STOPPED, ThreadState.GROUP_STOPPED) and not t.busy:
                reader.note_thread(t.load_regs().fs_base, t.tid, t.tracee.number)

    def _relearn_threads(self) -> None:
        reader = self._state.reader
        if reader is None or not self._tracer.is_alive:
            return
        if self._tracer.world.is_stopped:
            self._note_threads(reader)
            return
        self._tracer.world.stop()
        try:
            self._note_threads(reader)
        finally:
            self._tracer.world.resume()
