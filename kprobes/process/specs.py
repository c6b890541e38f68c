"""Probe-language specs placed on a process: each hit becomes an ``Event``.

A ``p`` spec becomes a ``Kprobe`` whose pre handler fetches the args and hands an event to
the sink; an ``r`` (or ``%return``) spec becomes a ``Kretprobe`` whose entry handler keeps
the entry timestamp and any ``$argN`` and whose return handler builds the return event
``(caller+off/size <- func)``. The events are the same values the kernel targets produce, so
the command line's outputs and aggregations do not know which target they came from.

With ``stack_depth`` every event carries the thread's user stack (``trace --stack``,
``stackcount``): walked in the detour where an entry spec takes a jump and ``fast_stacks``
allows it (a return spec's by its trampoline, from the real return address), else unwound
in the handler while the thread is stopped. With ``stack_counts``
too (``stackcount``), the fast tier counts the hits by stack in the program and hands
each stack's count over (process/fast/stackcounts.py), with no record per hit.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe, KretprobeInstance
from kprobes.errors import InternalError, ProbeRejected, SpecError, TargetError
from kprobes.model import ArgValue, Event
from kprobes.process.fast.probe import FastProbe
from kprobes.process.fetch.evaluate import ArgFetcher, CommCache, CpuReader, Memory, Symbolizer
from kprobes.process.fetch.fast import data_resolver, file_resolver
from kprobes.spec import AddressLocation, FileOffsetLocation, ProbeSpec, SymbolLocation, parse
from kprobes.values import dataclass, field

if TYPE_CHECKING:
    from kprobes.process.fast.batch import BatchOutput
    from kprobes.process.target import Process

Sink = Callable[[Event], None]
# Takes an event that stands for ``count`` hits of its stack (stacks counted in the program).
StackSink = Callable[[Event, int], None]
# A probe line's own handler (Process.add): handler(kp, event), or handler(ri, event).
LineHandler = Callable[[Any, Event], Any]
# The output that takes a spec's events as rows, a batch at a time (process/fast/batch.py),
# where nothing needs each event as a value; None: the sink gets each event.
BatchOutputs = Callable[[ProbeSpec], "BatchOutput | None"]
_now = time.monotonic


_SELF = "/proc/self"  # file offsets with no path are in the executable


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a spec's probe goes: a symbol (+offset), or an address; the file it names."""

    symbol: str | None
    offset: int
    addr: int | None
    path: str


@dataclass(slots=True)
class PlacedSpec:
    """One spec and the probe that implements it on the process."""

    spec: ProbeSpec
    probe: Kprobe | Kretprobe
    entry_time: dict[int, tuple[float, tuple[ArgValue, ...]]] = field(default_factory=dict)
    counts_in_place: bool = False  # makes no events: its hits are the count

    @property
    def name(self) -> str:
        return f"{self.spec.effective_group}/{self.spec.effective_event}"

    @property
    def hits(self) -> int:
        return self.probe.nhit

    @property
    def missed(self) -> int:
        """Hits whose handler could not run, plus (return probes) returns that were lost."""
        if isinstance(self.probe, Kretprobe):
            return self.probe.nmissed + self.probe.nabandoned
        return self.probe.nmissed


class SpecTracer:
    """Places specs on one process and turns their hits into events for ``sink``."""

    def __init__(
        self,
        proc: Process,
        sink: Sink,
        *,
        optimize: bool = False,
        count_only: bool = False,
        stack_depth: int | None = None,
        fast_stacks: bool = False,
        batch: BatchOutputs | None = None,
        durations_unit: int = 0,
        retval_bits: int = 0,
        linear: tuple[int, int, int] | None = None,
        stack_counts: StackSink | None = None,
        max_stacks: int = 0,
    ) -> None:
        self.proc = proc
        self.sink = sink
        self.batch = batch
        # Stacks are unwound at the hit, in the stopped thread: on traps, with events; with
        # ``fast_stacks``, entry specs stay record probes whose detours walk the stack.
        self.stack_depth = stack_depth  # each event's user stack, this many frames at most
        self.optimize = optimize and (stack_depth is None or fast_stacks)
        self.count_only = count_only and stack_depth is None  # only count hits: no events
        # Entry specs on jumps count their hits by stack in the program, into a table of
        # ``max_stacks`` stack ids an area, each stack's count to ``stack_counts``.
        self.stack_counts = stack_counts if self.optimize and stack_depth and max_stacks else None
        if self.stack_counts is not None and stack_depth is not None:
            try:
                proc.records.stack_ids = (max_stacks, max(stack_depth - 1, 1))
            except TargetError:  # its areas were made before: records, a hit each
                self.stack_counts = None
        # ``latency``: return specs timed in the program where their entry takes a jump
        # (fast/returns.py), in units of this many ns; their events only from traps.
        self.durations_unit = durations_unit if self.optimize else 0
        # ``hist -H`` of ``$retval``: its low 32 or 64 bits aggregated in the program.
        self.retval_bits = retval_bits if self.optimize else 0
        # Either aggregated into linear buckets (low, high, step) rather than log2 slots,
        # where the program can (values unsigned: low >= 0; at most LHIST_SLOTS_MAX slots).
        self.linear = linear
        self.placed: list[PlacedSpec] = []
        self.lines: list[tuple[Kprobe | Kretprobe, str, LineHandler | None]] = []  # add()'s
        self.comm = CommCache(proc.pid)
        self.cpu = CpuReader(proc.pid)
        self.memory = Memory(proc.fetch, proc.fetch_string, self.symbolize, self.comm)
        self._symbolizer = Symbolizer(lambda addr: proc.symbols().locate_address(addr))

    # -- symbols -----------------------------------------------------------------------

    def symbolize(self, addr: int) -> str:
        """``func+0xoff/0xsize`` as the kernel's %pS prints it, else the hex address."""
        return self._symbolizer(addr)

    def _resolve_data(self, name: str) -> int:
        return data_resolver(self.proc.symbols)(name)

    def _file_address(self, path: str) -> Callable[[int], int]:
        return file_resolver(self.proc.symbols, path)

    # -- placing -----------------------------------------------------------------------

    def build(self, spec: ProbeSpec, handler: LineHandler | None = None) -> PlacedSpec:
        """The probe for ``spec`` (not registered yet); its events go to ``handler`` with
        the probe (or, for a return, its instance) if one is given, else to the sink."""
        where = self._where(spec)
        fetcher = ArgFetcher(spec, self._resolve_data, self._file_address(where.path or _SELF))
        if spec.is_return:
            return self._return_probe(spec, where, fetcher, handler)
        if self.count_only:
            kp = Kprobe(
                symbol=where.symbol, offset=where.offset, addr=where.addr, optimize=self.optimize
            )
            return PlacedSpec(spec, kp, counts_in_place=True)
        if self.optimize:
            return self._record_probe(spec, where, fetcher, handler)
        return self._trap_probe(spec, where, fetcher, handler)

    def _where(self, spec: ProbeSpec) -> _Where:
        match spec.location:
            case SymbolLocation(symbol=sym, offset=off, module=module):
                path = module if module and "/" in module else ""
                return _Where(f"{module}:{sym}" if module else sym, off, None, path)
            case AddressLocation(address=a):
                return _Where(None, 0, a, "")
            case FileOffsetLocation(path=p, offset=off):
                return _Where(None, 0, self._file_address(p)(off), p)
            case None:
                raise ProbeRejected("a delete command places no probe", errno=errno.EINVAL)

    def _record_probe(
        self, spec: ProbeSpec, where: _Where, fetcher: ArgFetcher, handler: LineHandler | None
    ) -> PlacedSpec:
        """An entry spec as an optimized record probe: its events come from the ring, made
        by the reader (or, where the site keeps its trap, at the trap) ready to hand over."""
        sink = self.sink
        # Events of optimized probes wait in their ring; one made at a trap comes after them.
        drain = self.proc.records.drain_rings

        def on_hit(kp: Kprobe, event: Event) -> None:
            drain()  # at a trap: the records written before it go first
            if handler is None:
                sink(event)
            else:
                handler(kp, event)

        kp = Kprobe(symbol=where.symbol, offset=where.offset, addr=where.addr, optimize=True)
        kp.async_handler = on_hit
        fast = self._fast_probe(spec, fetcher, where.path)
        if handler is None and self.batch is not None:
            fast.batch = self.batch(spec)  # the sink's events, as rows where they can be
        depth = self.stack_depth
        if depth is not None:  # walked in the detour; at a trap, by the trap tier
            user_stack = self.proc.stacks.user_stack
            fast.stack_depth, fast.trap_stack = depth, lambda regs: user_stack(regs, depth)
            fast.count_sink = self.stack_counts if handler is None else None
        self.proc.records.prepare(kp, fast)
        return PlacedSpec(spec, kp)

    def _trap_probe(
        self, spec: ProbeSpec, where: _Where, fetcher: ArgFetcher, handler: LineHandler | None
    ) -> PlacedSpec:
        """An entry spec on traps: its event made in the handler."""
        group, event, pid = spec.effective_group, spec.effective_event, self.proc.pid
        sink, memory, comm, cpu, symbolize = (
            self.sink,
            self.memory,
            self.comm,
            self.cpu,
            self.symbolize,
        )
        drain = self.proc.records.drain_rings
        depth, user_stack = self.stack_depth, self.proc.stacks.user_stack

        def pre_handler(kp: Kprobe, regs: Any) -> None:
            drain()
            tid = regs.tid
            ip = regs.ip
            made = Event(
                group, event, pid, tid, comm(tid), cpu(tid), _now(), ip, symbolize(ip),
                fetcher.fetch(regs, memory),
                stack=None if depth is None else user_stack(regs, depth),
            )  # fmt: skip
            if handler is None:
                sink(made)
            else:
                handler(kp, made)

        kp = Kprobe(
            symbol=where.symbol, offset=where.offset, addr=where.addr, pre_handler=pre_handler
        )
        return PlacedSpec(spec, kp)

    def _return_probe(
        self, spec: ProbeSpec, where: _Where, fetcher: ArgFetcher, handler: LineHandler | None
    ) -> PlacedSpec:
        """A return spec: a kretprobe whose entry handler keeps the time and entry args."""
        if self.count_only:
            # Its returns are the count (``nhit``): the program's trampoline counts them
            # where the entry takes a jump, the trap tier's return handler where it does not.
            rp = Kretprobe(
                symbol=where.symbol,
                offset=where.offset,
                addr=where.addr,
                maxactive=spec.maxactive,
                optimize=self.optimize and handler is None,
            )
            return PlacedSpec(spec, rp, counts_in_place=True)
        group, event, pid = spec.effective_group, spec.effective_event, self.proc.pid
        sink, memory, comm, cpu, symbolize = (
            self.sink,
            self.memory,
            self.comm,
            self.cpu,
            self.symbolize,
        )
        drain = self.proc.records.drain_rings
        entry_time: dict[int, tuple[float, tuple[ArgValue, ...]]] = {}
        depth, user_stack = self.stack_depth, self.proc.stacks.user_stack

        def entry_handler(ri: KretprobeInstance, regs: Any) -> None:
            at_entry = fetcher.entry(regs, memory) if fetcher.has_entry_args else ()
            entry_time[id(ri)] = (_now(), at_entry)

        def on_return(ri: KretprobeInstance, regs: Any) -> None:
            drain()
            start, at_entry = entry_time.pop(id(ri), (0.0, ()))
            tid = regs.tid
            ret = ri.ret_addr
            func_ip = rp.addr or 0
            made = Event(
                group, event, pid, tid, comm(tid), cpu(tid), _now(), ret, symbolize(ret),
                fetcher.fetch(regs, memory, at_entry), is_return=True,
                func=symbolize(func_ip).split("+")[0], func_ip=func_ip, entry_timestamp=start,
                stack=None if depth is None else user_stack(regs, depth, ip=ret),
            )  # fmt: skip
            if handler is None:
                sink(made)
            else:
                handler(ri, made)

        aggregates = self._aggregates_in_place(fetcher)
        records = self.optimize and not aggregates
        rp = Kretprobe(
            symbol=where.symbol,
            offset=where.offset,
            addr=where.addr,
            handler=on_return,
            entry_handler=entry_handler,
            maxactive=spec.maxactive,
            optimize=(aggregates or records) and handler is None,
        )
        if rp.optimize:
            rp.handlers_on_traps_only = True
            rp.duration_unit = self.durations_unit or 1
            rp.value_bits = self.retval_bits
            rp.linear = self.linear if aggregates else None
        if rp.optimize and records:
            self._record_returns(rp, spec, where, fetcher)
        return PlacedSpec(spec, rp, entry_time=entry_time)

    def _record_returns(
        self, rp: Kretprobe, spec: ProbeSpec, where: _Where, fetcher: ArgFetcher
    ) -> None:
        """``rp``'s returns as records its trampoline writes (fast/returns.py), where its
        entry takes a jump: the reader makes their events, the trap tier's own (its handlers
        above make them where the entry keeps its int3)."""
        sink = self.sink

        def on_record(_rp: Kretprobe, event: Event) -> None:
            sink(event)

        rp.async_handler = on_record
        fast = self._fast_probe(spec, fetcher, where.path)
        fast.stack_depth = self.stack_depth  # the caller's stack, walked by the trampoline
        if self.batch is not None:
            fast.batch = self.batch(spec)  # the sink's events, as rows where they can be
        self.proc.records.prepare_return(rp, fast)

    def _fast_probe(self, spec: ProbeSpec, fetcher: ArgFetcher, path: str | None) -> FastProbe:
        """What the fast reader needs of ``spec`` to make its records into events."""
        resolvers = (self._resolve_data, self._file_address(path or _SELF))
        return FastProbe(
            spec, fetcher, False, self.memory, resolvers, self.proc.pid,
            spec.effective_group, spec.effective_event,
        )  # fmt: skip

    def _aggregates_in_place(self, fetcher: ArgFetcher) -> bool:
        """A return spec the program aggregates itself: ``latency``'s (no fetch-arg), or
        ``hist -H``'s (its one fetch-arg, ``$retval``: the command checked it); into linear
        buckets only where the program can."""
        if self.linear is not None:
            from kprobes.arch.x86_64.retstack import Linear  # return probes' code: on use

            try:
                Linear(*self.linear)
            except InternalError:
                return False  # each return an event: the command aggregates them
        if self.retval_bits:
            return len(fetcher.args) == 1
        return bool(self.durations_unit) and not fetcher.args

    def place(self, specs: Sequence[ProbeSpec]) -> list[PlacedSpec]:
        """Register every spec, all or nothing, in one stop of the program: its entry and
        return probes go live together (``trace 'work' 'r work'`` once began with hundreds
        of entries per thread that had no return, the return probe being armed a stop
        later)."""
        built = [self.build(spec) for spec in specs]
        self._register(built)
        return built

    def add(self, text: str, handler: LineHandler | None = None) -> Kprobe | Kretprobe:
        """Place the probe ``text`` describes (a probe line), its events to ``handler``."""
        spec = parse(text)
        if spec.is_delete:
            raise SpecError("a delete command places no probe", column=0, text=text)
        placed = self.build(spec, handler)
        self._register([placed])
        self.lines.append((placed.probe, text, handler))
        return placed.probe

    def _register(self, built: Sequence[PlacedSpec]) -> None:
        kprobes = [p.probe for p in built if isinstance(p.probe, Kprobe)]
        kretprobes = [p.probe for p in built if isinstance(p.probe, Kretprobe)]
        with self.proc.batch():
            self.proc.register_kprobes(kprobes)
            try:
                self.proc.register_kretprobes(kretprobes)
            except BaseException:
                self.proc.unregister_kprobes(kprobes)
                raise
        self.placed += built

    def remove(self, placed: Sequence[PlacedSpec]) -> None:
        """Unregister what ``place`` placed (a rollback), in one stop of the program."""
        kprobes = [p.probe for p in placed if isinstance(p.probe, Kprobe)]
        kretprobes = [p.probe for p in placed if isinstance(p.probe, Kretprobe)]
        with self.proc.batch():
            self.proc.unregister_kretprobes(kretprobes)
            self.proc.unregister_kprobes(kprobes)
        gone = {id(p) for p in placed}
        self.placed = [p for p in self.placed if id(p) not in gone]

    def close(self) -> None:
        self.cpu.close()
