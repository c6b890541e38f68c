"""The record file: what ``kprobes record`` writes and ``kprobes script`` reads.

A header, then chunks, each ``tag (4 ASCII bytes), crc32 of the payload (u32), payload
length (u64)`` and the payload; little-endian throughout. The records of the rings go in as
they lay there (``RING``, binary), everything else as one JSON object a chunk: the session
(``META``), a record id's site (``SITE``), a thread (``THRD``), the files mapped
(``MODS``), the clock's segments
(``CLCK``), an event the trap tier made (``EVNT``) and the session's end (``END ``).
docs/record-format.md is the reference; ``VERSION`` changes with any change a reader of
an older version would misread.

**Damage** is found where it starts: a chunk whose header is cut, whose payload is shorter
than it says, or whose crc does not match raises ``RecordFileError`` with the offset, after
every chunk before it has been handed over; a file without ``END `` was cut short (the
recorder was killed), which the reader says too. A chunk of an unknown tag is skipped (a
later minor addition), never guessed at.

Rejected: pickle (not a format: a file that runs code when read), one JSON line per record
(the per-record Python ``record`` exists to avoid), perf.data's layout (its sample records
describe the kernel's events, not ours).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any, Final

from kprobes.arch.x86_64 import ring_block
from kprobes.arch.x86_64.capture import Bytes, Capture, CapturePlan, Const, Reg, String, Value, Word
from kprobes.errors import ProbeError, RecordFileError
from kprobes.model import ArgValue, Event, EventArg, StackFrame, UserStack
from kprobes.process.fast.tee import ModuleInfo, ProbeInfo, SiteInfo
from kprobes.spec import parse
from kprobes.spec.render import render
from kprobes.values import dataclass

MAGIC: Final = b"KPRBDATA"
VERSION: Final = 2  # 2: stacks walked in the program (SITE stack_depth, MODS main)
READS: Final = (1, 2)  # versions this reader reads (1 has no stacks in its records)
_HEADER: Final = struct.Struct("<8sII")  # magic, version, 0
_CHUNK: Final = struct.Struct("<4sIQ")  # tag, crc32 of the payload, its length
_RING: Final = struct.Struct("<IHH")  # pid, blocks, 0
_BLOCK: Final = struct.Struct("<QQQ")  # first ticket, drops since the last read, bytes

META, SITE, THRD, MODS, CLCK, RING = "META", "SITE", "THRD", "MODS", "CLCK", "RING"
EVNT, END = "EVNT", "END "


class RecordWriter:
    """Writes a record file; the ``RecordSink`` of every process's tee (tee.py)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.records = 0  # the rings' records written
        out.write(_HEADER.pack(MAGIC, VERSION, 0))

    def _chunk(self, tag: str, *parts: bytes | memoryview) -> None:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        length = sum(len(part) for part in parts)
        self.out.write(_CHUNK.pack(tag.encode(), crc, length))
        for part in parts:
            self.out.write(part)

    def json(self, tag: str, value: dict[str, Any]) -> None:
        self._chunk(tag, json.dumps(value, separators=(",", ":")).encode())

    def site(self, pid: int, info: SiteInfo) -> None:
        self.json(SITE, {"pid": pid, **site_to_json(info)})

    def thread(self, pid: int, thread: int, tid: int, comm: str) -> None:
        self.json(THRD, {"pid": pid, "thread": thread, "tid": tid, "comm": comm})

    def modules(self, pid: int, modules: Sequence[ModuleInfo], main: str | None) -> None:
        rows = [[m.path, m.start, m.end, m.bias, m.build_id] for m in modules]
        self.json(MODS, {"pid": pid, "modules": rows, "main": main})

    def clock(self, pid: int, segments: Sequence[tuple[int, float, float]]) -> None:
        self.json(CLCK, {"pid": pid, "segments": [list(s) for s in segments]})

    def ring(self, pid: int, blocks: Sequence[ring_block.Block]) -> None:
        self.records += sum(block.count for block in blocks)
        parts: list[bytes | memoryview] = [_RING.pack(pid, len(blocks), 0)]
        for block in blocks:
            parts += [_BLOCK.pack(block.first, block.dropped, len(block.data)), block.data]
        self._chunk(RING, *parts)

    def event(self, ev: Event) -> None:
        self.json(EVNT, event_to_json(ev))


@dataclass(frozen=True, slots=True)
class Chunk:
    tag: str
    offset: int  # of its header in the file
    payload: bytes
    is_cut: bool = False  # the file ends inside it: ``payload`` is what there is

    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.payload)
        return value


def iter_chunks(f: IO[bytes]) -> Iterator[Chunk]:
    """The chunks of a record file, in order; RecordFileError where the file is damaged
    (after the chunks before), or cut short (no ``END ``: after them all)."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[:8] != MAGIC:
        raise RecordFileError("not a kprobes record file (no KPRBDATA header)", 0)
    _, version, _ = _HEADER.unpack(head)
    if version not in READS:
        raise RecordFileError(
            f"a record file of version {version}; this kprobes reads versions 1 to {VERSION}", 8
        )
    offset = _HEADER.size
    while True:
        raw = f.read(_CHUNK.size)
        if not raw:
            raise RecordFileError("the file ends without its END chunk: it was cut short", offset)
        if len(raw) < _CHUNK.size:
            raise RecordFileError("the file is cut short in a chunk's header", offset)
        tag_bytes, crc, length = _CHUNK.unpack(raw)
        payload = f.read(length)
        if len(payload) < length:
            if tag_bytes == RING.encode():  # its whole records are still good
                yield Chunk(RING, offset, payload, is_cut=True)
            raise RecordFileError(
                f"the file is cut short: a chunk of {length:,} bytes has {len(payload):,}",
                offset,
            )
        if zlib.crc32(payload) != crc:
            raise RecordFileError("the file is damaged: a chunk's checksum does not match", offset)
        tag = tag_bytes.decode("ascii", errors="replace")
        yield Chunk(tag, offset, payload)
        if tag == END:
            return
        offset += _CHUNK.size + length


def ring_blocks(chunk: Chunk) -> tuple[int, list[ring_block.Block]]:
    """A ``RING`` chunk's process and blocks (one a ring, as one read took them); of a cut
    chunk, the whole records it has."""
    data, cut = chunk.payload, chunk.is_cut
    try:
        pid, count, _ = _RING.unpack_from(data, 0)
        at = _RING.size
        blocks = []
        for _ in range(count):
            if cut and at + _BLOCK.size > len(data):
                break
            first, dropped, nbytes = _BLOCK.unpack_from(data, at)
            at += _BLOCK.size
            body = data[at : at + nbytes]
            if len(body) != nbytes and not cut:
                raise ValueError("a block longer than its chunk")
            at += nbytes
            runs = ring_block.runs_of(body, cut=cut)
            body = body[: runs[-1].end if runs else 0]
            blocks.append(ring_block.Block(body, first, runs, dropped, pending=False))
    except (struct.error, ValueError, ProbeError) as exc:
        raise RecordFileError(f"the file is damaged: a RING chunk: {exc}", chunk.offset) from exc
    return pid, blocks


# -- values as JSON ----------------------------------------------------------------------


def _src(s: Reg | Const | Word) -> list[Any]:
    match s:
        case Reg(name):
            return ["reg", name]
        case Const(value):
            return ["const", value]
        case Word(capture, index):
            return ["word", capture, index]


def _src_of(v: list[Any]) -> Reg | Const | Word:
    match v:
        case ["reg", str(name)]:
            return Reg(name)
        case ["const", int(value)]:
            return Const(value)
        case ["word", int(capture), int(index)]:
            return Word(capture, index)
    raise ValueError(f"not a capture's source: {v!r}")


def _capture(c: Capture) -> list[Any]:
    match c:
        case Value(reg):
            return ["value", reg.name]
        case Bytes(base, offset, size, elem):
            return ["bytes", _src(base), offset, size, elem]
        case String(base, offset, limit):
            return ["string", _src(base), offset, limit]
    raise ValueError(f"not a capture: {c!r}")


def _capture_of(v: list[Any]) -> Capture:
    match v:
        case ["value", str(name)]:
            return Value(Reg(name))
        case ["bytes", base, int(offset), int(size), int(elem)]:
            return Bytes(_src_of(base), offset, size, elem)
        case ["string", base, int(offset), int(limit)]:
            return String(_src_of(base), offset, limit)
    raise ValueError(f"not a capture: {v!r}")


def site_to_json(info: SiteInfo) -> dict[str, Any]:
    return {
        "rid": info.rid,
        "addr": info.addr,
        "location": info.location,
        "with_regs": info.with_regs,
        "stack_depth": info.stack_depth,
        "plan": [_capture(c) for c in info.plan.captures],
        "probes": [
            {
                "spec": render(p.spec),
                "group": p.group,
                "event": p.event,
                "pid": p.pid,
                "data": [list(pair) for pair in p.data],
                "files": [list(pair) for pair in p.files],
            }
            for p in info.probes
        ],
    }


def site_of(value: dict[str, Any]) -> SiteInfo:
    plan = CapturePlan()
    for c in value["plan"]:
        plan.add(_capture_of(c))
    probes = tuple(
        ProbeInfo(
            parse(p["spec"]),
            p["group"],
            p["event"],
            p["pid"],
            tuple((str(k), int(v)) for k, v in p["data"]),
            tuple((int(k), int(v)) for k, v in p["files"]),
        )
        for p in value["probes"]
    )
    return SiteInfo(
        value["rid"], value["addr"], value["location"], plan, value["with_regs"], probes,
        int(value.get("stack_depth", 0)),
    )  # fmt: skip


def _value_of(v: Any) -> ArgValue:
    return tuple(_value_of(x) for x in v) if isinstance(v, list) else v


def event_to_json(ev: Event) -> dict[str, Any]:
    """An event as the trap tier made it (its registers are not kept: the command line's
    events have none)."""
    out: dict[str, Any] = ev._asdict()
    out["args"] = [[a.name, a.type, a.value] for a in ev.args]
    out.pop("regs")
    if ev.stack is not None:
        frames = [[f.addr, f.func, f.offset, f.size, f.module] for f in ev.stack.frames]
        out["stack"] = {"frames": frames, "stop": ev.stack.stop}
    return out


def event_of(value: dict[str, Any]) -> Event:
    args = tuple(EventArg(n, t, _value_of(v)) for n, t, v in value.pop("args"))
    stack = value.pop("stack")
    if stack is not None:
        frames = tuple(StackFrame(*f) for f in stack["frames"])
        stack = UserStack(frames, stack["stop"])
    return Event(**value, args=args, stack=stack)


def modules_of(value: dict[str, Any]) -> list[ModuleInfo]:
    return [ModuleInfo(str(p), int(s), int(e), int(b), i) for p, s, e, b, i in value["modules"]]
