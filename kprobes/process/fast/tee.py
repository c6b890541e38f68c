"""The rings' records handed on as they lie, with what formats them later: ``kprobes record``.

``trace`` turns each record into text as it reads it (reader.py, batch.py): a microsecond an
event at best, while a hot function writes one every 30-150 ns. ``record`` does not decode:
each read of the rings (``RingReader`` with its ``tee`` set) goes whole to a ``RecordSink``
(the record file, output/recfile.py), and only what a later reader cannot know is added,
each the first time a block needs it:

- a record id's site: its address and location text, its capture plan, and each probe's
  spec, names, and the answers its symbols gave (``@sym`` and file offsets), so that the
  very decoders ``trace`` uses can be made again from the file without the program;
- the threads the records name (thread pointer → tid, and the thread's name, read now:
  it may be gone when the file is read), looked up as the reader would (``tid_of``);
- the clock's segments (ticks → seconds), as the reader has them;
- the files mapped (path, place, build-id) and which is the program's own, with each new
  site (and, once records carry stacks walked in the program, with each read that finds
  them changed), for the addresses a record holds (``:symbol``, a stack's return
  addresses) that the file's reader must name.

Rejected: decoding the records into a compact form while recording (the per-record Python
this avoids), and copying the ring's bytes without the commit check (a record still being
written would be taken half-made).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kprobes.arch.x86_64 import ring_block
from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import CapturePlan
from kprobes.errors import ProbeError
from kprobes.process.fast.batch import plan_decoder
from kprobes.process.fast.reader import RecordSite, RingReader, record_targets
from kprobes.process.fetch.evaluate import ArgFetcher
from kprobes.spec import ProbeSpec
from kprobes.symbols.elf import build_id
from kprobes.symbols.maps import Module
from kprobes.values import dataclass


@dataclass(frozen=True, slots=True)
class ProbeInfo:
    """One probe of a recorded site: its spec, event names and process, and what its symbols
    answered while it was prepared (``data``: ``@sym`` → address; ``files``: a file offset
    of the spec's file → address), the resolvers a reader of the file replays."""

    spec: ProbeSpec
    group: str
    event: str
    pid: int  # the process its events are of
    data: tuple[tuple[str, int], ...]
    files: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class SiteInfo:
    """A record id's site: where it is, its ``%pS`` text, what its records capture, whether
    they carry the registers, and its probes (those with a handler, in order)."""

    rid: int
    addr: int
    location: str
    plan: CapturePlan
    with_regs: bool
    probes: tuple[ProbeInfo, ...]
    stack_depth: int = 0  # its records hold a stack walked in the program (0: none)


@dataclass(frozen=True, slots=True)
class ModuleInfo:
    """A file mapped in the process: its path, where (``bias``: runtime address less the
    file's), and its build-id (None if it has none), which tells a reader of the record
    whether the file at ``path`` is still the one that was mapped."""

    path: str
    start: int
    end: int
    bias: int
    build_id: str | None


class RecordSink(Protocol):
    """Where a process's records and what formats them go (the record file)."""

    def site(self, pid: int, info: SiteInfo) -> None: ...

    def thread(self, pid: int, thread: int, tid: int, comm: str) -> None: ...

    def modules(self, pid: int, modules: Sequence[ModuleInfo], main: str | None) -> None: ...

    def clock(self, pid: int, segments: Sequence[tuple[int, float, float]]) -> None: ...

    def ring(self, pid: int, blocks: Sequence[ring_block.Block]) -> None: ...


class _Recorded:
    """A resolver that keeps each answer it gives."""

    def __init__(self, resolve: Callable[[Any], int]) -> None:
        self.resolve = resolve
        self.answers: dict[Any, int] = {}

    def __call__(self, key: Any) -> int:
        value = self.answers[key] = self.resolve(key)
        return value


class RecordTee:
    """A ``RingTee`` for one process's reader: each read's blocks to ``sink``, after what
    they need that the sink was not given yet."""

    def __init__(
        self,
        reader: RingReader,
        pid: int,
        sink: RecordSink,
        modules: Callable[[], Sequence[Module]] | None = None,
        main: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.reader = reader
        self.pid = pid
        self.sink = sink
        # The files mapped now (and the program's own): given with each new site, and with
        # each read once records carry stacks (libraries mapped later name their frames).
        self._modules = modules
        self._main = main
        self._main_path = self._program_file()  # learnt now: the program may end first
        self._stacks = False
        self._written_modules: tuple[ModuleInfo, ...] = ()
        self._build_ids: dict[str, str | None] = {}
        self._sites: dict[int, tuple[RecordSite, tuple[int, ...]]] = {}  # rid → as written
        self._threads: dict[int, int] = {}  # thread pointer → tid, as written
        self._segments = 0  # clock segments written

    def take(self, blocks: Sequence[ring_block.Block]) -> None:
        if not any(block.count for block in blocks):
            return
        for block in blocks:
            for run in block.runs:
                self._note_site(run.probe)
            self._note_threads(block)
        if self._stacks:
            self._note_modules()
        clock = self.reader.clock
        if clock is not None:
            segments = clock.segments
            if len(segments) > self._segments:
                self.sink.clock(self.pid, segments[self._segments :])
                self._segments = len(segments)
        self.sink.ring(self.pid, blocks)

    def _note_site(self, rid: int) -> None:
        rs = self.reader.sites.get(rid)
        if rs is None:
            return
        active = tuple(record_targets(rs))
        key = tuple(map(id, active))
        known = self._sites.get(rid)
        if known is not None and known[0] is rs and known[1] == key:
            return
        self._sites[rid] = (rs, key)
        probes = []
        for kp in active:
            fp = self.reader.fast_of(kp)
            if fp is None:
                continue
            data, files = _Recorded(fp.resolvers[0]), _Recorded(fp.resolvers[1])
            try:  # what the decoders ask of the symbols, asked now
                ArgFetcher(fp.spec, data, files)
                plan_decoder(fp.spec, (data, files), rs.plan, rs.site.addr)
            except (ProbeError, OSError):
                pass  # a reader of the file will find it missing, and say so
            probes.append(
                ProbeInfo(
                    fp.spec,
                    fp.group,
                    fp.event,
                    fp.pid,
                    tuple((str(k), v) for k, v in data.answers.items()),
                    tuple((int(k), v) for k, v in files.answers.items()),
                )
            )
        self._note_modules()
        addr = rs.site.addr
        location = self.reader.symbolize(addr)
        info = SiteInfo(rid, addr, location, rs.plan, rs.with_regs, tuple(probes), rs.stack_depth)
        self._stacks = self._stacks or bool(rs.stack_depth)
        self.sink.site(self.pid, info)

    def _note_modules(self) -> None:
        """The files mapped now, if they changed: what names the addresses the records hold
        (a ``:symbol`` value) when the file is read."""
        if self._modules is None:
            return
        ids = self._build_ids
        infos = []
        for m in self._modules():
            if m.path not in ids:
                ids[m.path] = build_id(m.path)
            infos.append(ModuleInfo(m.path, m.start, m.end, m.bias, ids[m.path]))
        if tuple(infos) != self._written_modules:
            self._written_modules = tuple(infos)
            self._main_path = self._program_file() or self._main_path
            self.sink.modules(self.pid, infos, self._main_path)

    def _program_file(self) -> str | None:
        """The program's own file (its frames are named without ``[module]``), while it
        lives (None once it is gone)."""
        try:
            return self._main()
        except (ProbeError, OSError):
            return None

    def _note_threads(self, block: ring_block.Block) -> None:
        """Every thread pointer of ``block`` named (a hot loop's block has one: its words
        compared as bytes)."""
        words = memoryview(block.data).cast("Q")
        seen: set[int] = set()
        for run in block.runs:
            column = words[run.start // 8 + 2 : run.end // 8 : run.slots * (sa.SLOT // 8)]
            raw = column.tobytes()
            if raw == raw[:8] * (len(raw) // 8):
                seen.add(column[0])
            else:
                seen.update(column.tolist())
        words.release()
        reader, written = self.reader, self._threads
        for thread in seen:
            tid = reader.tid_of(thread)
            if written.get(thread) != tid:
                written[thread] = tid
                self.sink.thread(self.pid, thread, tid, reader.comm(tid) if tid else "")
