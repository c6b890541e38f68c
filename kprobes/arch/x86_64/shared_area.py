"""The shared area: what optimized probes write in the program and the tool reads, and its reader.

One mapping (a memfd mapped in both the program and the tool) holds three parts::

    0       header      one page: layout words, then the ring's counters, each on its own
                        cache line so that producers, the reader and drops do not share one
    4096    counters    one 8-byte counter per probe, 64 bytes apart (no false sharing
                        between probes hit on different CPUs)
    ring    records     ``capacity`` (a power of two) fixed-size records

**Reservation (multi-producer).** A producer takes ticket ``t = head`` only if the ring has
room (``head - tail < capacity``) with ``lock cmpxchg head, t+1``, retried when another
producer won; the record for ticket ``t`` lives at index ``t % capacity``. When the ring is
full it increments ``drops`` and writes nothing. This is perf's reservation
(``perf_output_begin()``: a cmpxchg loop on ``head`` against the reader's ``data_tail``, a
``lost`` count on failure). Rejected: ``lock xadd head`` (a blind increment). A ticket taken
on a full ring cannot be given back, and its slot is still the reader's, so nothing can be
written for it: the reader, arriving at that ticket, cannot tell a dropped ticket from one
whose record is still being written, and waits forever. Fixing that needs a second locked
instruction per hit (a per-slot compare-and-swap that the reader may win to skip the ticket);
the cmpxchg loop costs one locked instruction, like xadd, when uncontended.

**Commit (publication).** Each record's first word is its commit word: the producer writes
every other field first and ``t + 1`` there last, with plain stores. x86 is TSO: stores
become visible in program order, and loads are not reordered with older loads, so a reader
that loads the commit word, sees ``t + 1`` and then loads the fields sees them complete. The
word carries the ticket, not a flag, so a record of the previous lap (``t + 1 - capacity``)
or a fresh zeroed slot never reads as committed, and no one has to clear it.

**Release.** The reader copies the records it returns and only then stores the new ``tail``
(one aligned 8-byte store, through a ``memoryview`` of words: ``struct.pack_into`` writes
byte by byte). A producer that loads that ``tail`` may overwrite those slots: its later
stores cannot pass its load, and the reader's loads came before its store. So no record is
ever overwritten while it is read, and reads never tear.

A record reserved and never committed (its producer longjmp'ed out of a signal handler in
the middle of the detour) stops the reader there for good; ``Batch.pending`` says the reader
waits, and the tool, at a full stop with no thread inside a detour, can tell it is abandoned.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kprobes.errors import InternalError

MAGIC: Final = int.from_bytes(b"KPRBAREA", "little")
VERSION: Final = 1
PAGE: Final = 4096
CACHE_LINE: Final = 64

# Header words (byte offsets). The first line is written once, by the tool, before use.
OFF_MAGIC: Final = 0
OFF_VERSION: Final = 8  # u32; the record size is the u32 at 12
OFF_CAPACITY: Final = 16
OFF_NCOUNTERS: Final = 24
OFF_COUNTERS: Final = 32
OFF_RING: Final = 40
OFF_HEAD: Final = 64  # producers: the next ticket
OFF_TAIL: Final = 128  # the reader: the first ticket not yet consumed
OFF_DROPS: Final = 192  # producers: hits not recorded because the ring was full
OFF_DROPS_READ: Final = 256  # the reader: drops already reported

COUNTER_STRIDE: Final = CACHE_LINE

# Record fields (byte offsets into a record).
REC_COMMIT: Final = 0
REC_PROBE: Final = 8
REC_THREAD: Final = 16
REC_TSC: Final = 24
REC_RIP: Final = 32
REC_EFLAGS: Final = 40
REC_RSP: Final = 48
REC_GPRS: Final = 56
# The general registers in struct user_regs_struct order (r15 first), rsp apart.
GPR_ORDER: Final = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10",
    "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
)  # fmt: skip
RECORD_FIXED: Final = REC_GPRS + 8 * len(GPR_ORDER)  # 176: the rest is left for fetch-args
RECORD_SIZE: Final = 192

_FIXED: Final = struct.Struct(f"<{RECORD_FIXED // 8}Q")
_HEADER: Final = struct.Struct("<QIIQQQQ")


def rec_gpr(name: str) -> int:
    """The offset of general register ``name`` ("rax", ...; not "rsp") in a record."""
    return REC_GPRS + 8 * GPR_ORDER.index(name)


@dataclass(frozen=True, slots=True)
class AreaLayout:
    """Where everything is in a shared area of ``ncounters`` counters and a ring of records."""

    ncounters: int
    capacity: int
    record_size: int = RECORD_SIZE

    def __post_init__(self) -> None:
        cap = self.capacity
        if cap <= 0 or cap & (cap - 1) or cap >= 1 << 31:
            raise InternalError(f"ring capacity {cap} is not a power of two below 2**31")
        size = self.record_size
        if size < RECORD_FIXED or size % CACHE_LINE or size >= 1 << 31:
            raise InternalError(f"record size {size} is not a multiple of 64 of at least 192")
        if self.ncounters < 0:
            raise InternalError(f"{self.ncounters} counters")

    @property
    def counters_offset(self) -> int:
        return PAGE

    @property
    def ring_offset(self) -> int:
        counters_end = PAGE + self.ncounters * COUNTER_STRIDE
        return (counters_end + PAGE - 1) & ~(PAGE - 1)

    @property
    def size(self) -> int:
        """Bytes to map (a whole number of pages)."""
        ring_end = self.ring_offset + self.capacity * self.record_size
        return (ring_end + PAGE - 1) & ~(PAGE - 1)

    def counter_offset(self, index: int) -> int:
        if not 0 <= index < self.ncounters:
            raise InternalError(f"counter {index} of {self.ncounters}")
        return PAGE + index * COUNTER_STRIDE

    def record_offset(self, ticket: int) -> int:
        return self.ring_offset + (ticket & (self.capacity - 1)) * self.record_size

    def ring_at(self, base: int) -> RingAddrs:
        """The absolute addresses a record action needs, for the area mapped at ``base``."""
        return RingAddrs(
            head=base + OFF_HEAD,
            tail=base + OFF_TAIL,
            drops=base + OFF_DROPS,
            ring=base + self.ring_offset,
            capacity=self.capacity,
            record_size=self.record_size,
        )


@dataclass(frozen=True, slots=True)
class RingAddrs:
    """The ring as the program sees it: absolute addresses in the program's mapping."""

    head: int
    tail: int
    drops: int
    ring: int
    capacity: int
    record_size: int


@dataclass(frozen=True, slots=True)
class Record:
    """One hit, as its detour wrote it. ``thread`` is the thread's fs base (its thread
    pointer); ``tsc`` is the time stamp counter; registers are those at the probe point."""

    ticket: int
    probe: int
    thread: int
    tsc: int
    rip: int
    eflags: int
    rsp: int
    r15: int
    r14: int
    r13: int
    r12: int
    rbp: int
    rbx: int
    r11: int
    r10: int
    r9: int
    r8: int
    rax: int
    rcx: int
    rdx: int
    rsi: int
    rdi: int
    extra: bytes  # the record's bytes after the fixed fields (fetch-args, later)


# Built from the unpacked words in field order (mypy cannot count a starred tuple).
_make_record: Final[Callable[..., Record]] = Record


@dataclass(frozen=True, slots=True)
class Batch:
    """What one read returns: the complete records since the last read, in reservation order,
    ``dropped`` hits lost to a full ring since the last read, and ``pending``: a reserved
    record is still being written, and the next read starts with it."""

    records: tuple[Record, ...]
    dropped: int
    pending: bool


def init_area(buffer: memoryview | bytearray, layout: AreaLayout) -> None:
    """Write the header of a fresh, zero-filled area (before any detour uses it)."""
    if len(buffer) < layout.size:
        raise InternalError(f"area of {len(buffer)} bytes, the layout needs {layout.size}")
    _HEADER.pack_into(
        buffer,
        OFF_MAGIC,
        MAGIC,
        VERSION,
        layout.record_size,
        layout.capacity,
        layout.ncounters,
        layout.counters_offset,
        layout.ring_offset,
    )


def layout_of(buffer: memoryview | bytearray) -> AreaLayout:
    """The layout an area's header describes; InternalError if it is not one of ours."""
    magic, version, record_size, capacity, ncounters, _, ring = _HEADER.unpack_from(buffer, 0)
    if magic != MAGIC or version != VERSION:
        raise InternalError(f"not a kprobes shared area (magic {magic:#x}, version {version})")
    layout = AreaLayout(ncounters, capacity, record_size)
    if ring != layout.ring_offset or len(buffer) < layout.size:
        raise InternalError("the shared area's header does not match its size")
    return layout


def read_counter(buffer: memoryview | bytearray, index: int) -> int:
    """Probe counter ``index`` (one aligned 8-byte load)."""
    offset = layout_of(buffer).counter_offset(index)
    return int(memoryview(buffer).cast("B").cast("Q")[offset // 8])


def read_records(buffer: memoryview | bytearray, *, limit: int | None = None) -> Batch:
    """The complete records written since the last read, and the drops, and release them.

    ``buffer`` is the whole area (writable: the reader's ``tail`` and ``drops_read`` live in
    its header, so this function keeps no state of its own). At most ``limit`` records, and
    never more than the ring holds. Never returns a record that is not fully written.
    """
    layout = layout_of(buffer)
    mv = memoryview(buffer).cast("B")
    words = mv.cast("Q")
    size = layout.record_size
    tail = int(words[OFF_TAIL // 8])
    most = layout.capacity if limit is None else min(limit, layout.capacity)
    records: list[Record] = []
    # Step 1: copy committed records in ticket order; stop at the first one not committed.
    ticket = tail
    while len(records) < most:
        offset = layout.record_offset(ticket)
        if words[(offset + REC_COMMIT) // 8] != ticket + 1:
            break
        record = bytes(mv[offset : offset + size])  # after the commit word's load
        fields = _FIXED.unpack_from(record, 0)
        records.append(_make_record(ticket, *fields[1:], record[RECORD_FIXED:]))
        ticket += 1
    pending = words[OFF_HEAD // 8] > ticket
    # Step 2: release the slots (after the copies) and account the drops.
    words[OFF_TAIL // 8] = ticket
    drops = int(words[OFF_DROPS // 8])
    dropped = drops - int(words[OFF_DROPS_READ // 8])
    words[OFF_DROPS_READ // 8] = drops
    return Batch(tuple(records), dropped, pending)
