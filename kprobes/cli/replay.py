"""A record file read back into the events ``trace`` would have had: ``script``'s and
``report``'s source.

Each process of the file gets the reader a live run has (``RingReader``, process/fast/
reader.py), with no program behind it: its sites, threads and clock are the file's
(``SITE``, ``THRD``, ``CLCK``), each ``RING`` chunk is handed to ``deliver_blocks`` as
the live reader hands a read, and so every record goes the way it would have gone live:
through the decoder generated for its probe and the output's line (the batch path) where
the output takes rows, else through the per-event path (``Event`` values to ``sink``).
The bytes are then ``trace``'s by construction, the same code on the same records with the
same clock; ``EVNT`` chunks (the trap tier's events, the kernel's) go to ``sink`` in their
place in the file.

What the file does not hold cannot be asked for: a symbol a fetch-arg needs that the
recorder did not resolve is an error; an address a value holds (``:symbol``) is named from
the file mapped there (``MODS``: path and build-id) while it is still that file, else
printed in hex, and ``changed`` lists the files that are not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import IO, Any

from kprobes.arch.x86_64 import ring_block
from kprobes.arch.x86_64.stackwalk import WalkResult
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.core.table import ProbeSite, ProbeTable
from kprobes.errors import ProbeError, RecordFileError, SymbolNotFound, TargetError
from kprobes.linux.tsc import TscClock
from kprobes.model import Event, StackFrame, UserStack
from kprobes.output.recfile import (
    CLCK,
    END,
    EVNT,
    META,
    MODS,
    RING,
    SITE,
    THRD,
    Chunk,
    event_of,
    iter_chunks,
    modules_of,
    ring_blocks,
    site_of,
)
from kprobes.process.fast.batch import BatchOutput
from kprobes.process.fast.probe import FastProbe
from kprobes.process.fast.reader import RecordSite, RingReader
from kprobes.process.fast.tee import ModuleInfo, SiteInfo
from kprobes.process.fetch.evaluate import ArgFetcher, Memory
from kprobes.process.stacks import STOP_MARKERS
from kprobes.spec import ProbeSpec
from kprobes.symbols.elf import ElfImage, build_id
from kprobes.values import dataclass

Sink = Callable[[Event], None]
Batches = Callable[[ProbeSpec], BatchOutput | None]


@dataclass(frozen=True, slots=True)
class _Where:
    """A recorded site's place, as ``core.probes.Location`` reads it."""

    addr: int
    display: str
    module_name: str = ""


def _replayed(answers: dict[Any, int], what: str) -> Callable[[Any], int]:
    def resolve(key: Any) -> int:
        try:
            return answers[key]
        except KeyError:
            raise SymbolNotFound(f"the record file does not say where {what} {key} is") from None

    return resolve


def _not_live(addr: int, size: int) -> bytes:
    raise TargetError("a record file's events have no program to read")


class _Process:
    """One recorded process: a ring reader with the file's sites, threads and clock."""

    def __init__(self, pid: int, sink: Sink, batches: Batches | None) -> None:
        self.pid = pid
        self.sink = sink
        self.batches = batches
        self.table = ProbeTable()
        self.fast: dict[int, FastProbe] = {}  # id(Kprobe) → its FastProbe
        self.comms: dict[int, str] = {}
        self.locations: dict[int, str] = {}  # the sites' texts, as the recorder made them
        self.modules: list[ModuleInfo] = []
        self.main: str | None = None  # the program's own file (its frames have no [module])
        self.images: dict[str, ElfImage | None] = {}  # None: gone or changed
        self.changed: set[str] = set()  # files whose build-id is not the recording's
        self.reader = RingReader(
            self.table, list, self.symbolize, self.comm, self.fast_of, self.walked
        )

    def symbolize(self, addr: int) -> str:
        """``func+0xoff/0xsize`` as ``Symbolizer`` names it live: a site's text as
        recorded, else from the mapped file if it is still the one recorded (its
        build-id), else the hex address."""
        text = self.locations.get(addr)
        if text is not None:
            return text
        module = next((m for m in self.modules if m.start <= addr < m.end), None)
        image = None if module is None else self._image(module)
        found = None if image is None or module is None else image.function_at(addr - module.bias)
        if found is None:
            return f"0x{addr:x}"
        symbol, offset = found
        text = self.locations[addr] = f"{symbol.name}+{offset:#x}/{max(symbol.size, 1):#x}"
        return text

    def walked(self, ip: int, walk: WalkResult) -> UserStack:
        """A stack walked in the program, named as ``trace -U`` names it live
        (process/stacks.py's ``Backtraces.walked``): each frame by the function holding it
        (a return address's call: the byte before it), ``[module]`` for a library's."""
        frames = [self._frame(ip, ip), *(self._frame(addr, addr - 1) for addr in walk.returns)]
        return UserStack(tuple(frames), STOP_MARKERS.get(walk.stop.name.lower(), ""))

    def _frame(self, addr: int, at: int) -> StackFrame:
        module = next((m for m in self.modules if m.start <= at < m.end), None)
        if module is None:
            return StackFrame(addr)
        lib = "" if module.path == self.main else os.path.basename(module.path)
        image = self._image(module)
        found = None if image is None else image.function_at(at - module.bias)
        if found is None:
            return StackFrame(addr, module=lib)
        symbol, offset = found
        return StackFrame(addr, symbol.name, offset + addr - at, symbol.size, lib)

    def _image(self, module: ModuleInfo) -> ElfImage | None:
        path = module.path
        if path not in self.images:
            self.images[path] = None
            if build_id(path) != module.build_id:
                self.changed.add(path)
            else:
                with contextlib.suppress(ProbeError):
                    self.images[path] = ElfImage.open(path)
        return self.images[path]

    def comm(self, tid: int) -> str:
        return self.comms.get(tid, "")

    def fast_of(self, kp: Kprobe | Kretprobe) -> FastProbe | None:
        return self.fast.get(id(kp))

    def site(self, info: SiteInfo) -> None:
        self.locations[info.addr] = info.location
        site = ProbeSite(self.table, info.addr, _Where(info.addr, info.location))
        memory = Memory(_not_live, _not_live, self.symbolize, self.comm)
        for p in info.probes:
            resolvers = (_replayed(dict(p.data), "@"), _replayed(dict(p.files), "offset"))
            fetcher = ArgFetcher(p.spec, *resolvers)
            fp = FastProbe(p.spec, fetcher, False, memory, resolvers, p.pid, p.group, p.event)
            fp.stack_depth = info.stack_depth or None
            if self.batches is not None:
                fp.batch = self.batches(p.spec)
            if p.spec.is_return:  # records of returns: to the return probe whose entry it is
                rp = Kretprobe(addr=info.addr, async_handler=self._deliver)
                self.fast[id(rp)] = fp
                site.probes.append(rp.kp)
                continue
            kp = Kprobe(addr=info.addr, async_handler=self._deliver)
            self.fast[id(kp)] = fp
            site.probes.append(kp)
        site.refresh()
        is_return = any(p.spec.is_return for p in info.probes)  # written by a trampoline
        self.reader.sites[info.rid] = RecordSite(
            site, info.plan, info.with_regs, info.stack_depth, is_return=is_return
        )

    def _deliver(self, kp: Kprobe | Kretprobe, ev: Event) -> None:
        self.sink(ev)

    def clock(self, segments: list[list[Any]]) -> None:
        """More of the clock's segments: the clock is extended in place (the decoders made
        so far hold its ``seconds``)."""
        more = [(int(s), float(n), float(p)) for s, n, p in segments]
        if self.reader.clock is None:
            self.reader.clock = TscClock.from_segments(more)
        else:
            self.reader.clock.extend(more)

    def ring(self, blocks: list[ring_block.Block], offset: int) -> None:
        if self.reader.clock is None:
            raise RecordFileError("the file is damaged: records before their clock", offset)
        self.reader.deliver_blocks(blocks)
        exc = self.table.take_error()
        if exc is not None:
            raise exc


class Replay:
    """A record file's events, in the order ``trace`` would have printed them: ``sink``
    takes each event, ``batches`` (if given) the output of a spec's records as rows."""

    def __init__(self, sink: Sink, batches: Batches | None = None) -> None:
        self.sink = sink
        self.batches = batches
        self.end: dict[str, Any] | None = None  # the recording's END chunk, once read
        self.processes: dict[int, _Process] = {}

    @property
    def changed(self) -> list[str]:
        """Files mapped in the recording that are gone or another now (build-id)."""
        return sorted({path for proc in self.processes.values() for path in proc.changed})

    def _process(self, pid: int) -> _Process:
        proc = self.processes.get(pid)
        if proc is None:
            proc = self.processes[pid] = _Process(pid, self.sink, self.batches)
        return proc

    def read(self, chunks: Iterator[Chunk]) -> None:
        """Every chunk after ``META`` (``open_file`` read it) to its place."""
        for chunk in chunks:
            tag = chunk.tag
            if tag == RING:
                pid, blocks = ring_blocks(chunk)
                self._process(pid).ring(blocks, chunk.offset)
                continue
            if tag not in (SITE, THRD, MODS, CLCK, EVNT, END):
                continue  # a later version's addition
            try:
                value = chunk.json()
                if tag == EVNT:
                    self.sink(event_of(value))
                elif tag == END:
                    self.end = value
                elif tag == SITE:
                    self._process(value["pid"]).site(site_of(value))
                elif tag == MODS:
                    proc = self._process(value["pid"])
                    proc.modules, proc.main = modules_of(value), value.get("main")
                elif tag == THRD:
                    proc = self._process(value["pid"])
                    proc.reader.threads[value["thread"]] = value["tid"]
                    proc.comms[value["tid"]] = value["comm"]
                else:
                    self._process(value["pid"]).clock(value["segments"])
            except (ValueError, KeyError, TypeError) as exc:
                raise RecordFileError(
                    f"the file is damaged: a {tag} chunk: {exc}", chunk.offset
                ) from exc


def open_file(f: IO[bytes]) -> tuple[dict[str, Any], Iterator[Chunk]]:
    """A record file's ``META`` and the chunks after it."""
    chunks = iter_chunks(f)
    first = next(chunks, None)
    if first is None or first.tag != META:
        raise RecordFileError("the file has no session description (META) first", 16)
    try:
        return first.json(), chunks
    except ValueError as exc:
        raise RecordFileError(f"the file is damaged: META: {exc}", first.offset) from exc


@contextlib.contextmanager
def reading(path: str) -> Iterator[IO[bytes]]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise TargetError(f"{path}: {exc.strerror}", errno=exc.errno) from exc
    with f:
        yield f
