"""The shared area: what optimized probes write in the program and the tool reads, and its reader.

One memfd, mapped in both the program and the tool, holds three parts::

    0       header      one page: layout words, then the ring's counters, each on its own
                        cache line so that producers, the reader and drops do not share one
    4096    counters    one 8-byte counter per probe, 64 bytes apart (no false sharing
                        between probes hit on different CPUs)
    stacks  stack ids   ``stack_entries`` entries of ``stack_stride`` bytes, where
                        ``stackcount`` counts hits by stack in the program (stackids.py);
                        none in an area made without them
    ring    slots       ``capacity`` (a power of two) 64-byte slots

**Records take as many slots as they need.** A count-and-argument record (the common trace)
is one slot; a record with the registers for a Python handler, or a string, takes more. The
program maps the first ``MIRROR`` bytes of the ring a second time right after its end, so a
record that starts near the end is written as one run of bytes with no wrap in the detour's
code; the tool reads the two pieces. Rejected: one fixed record size (every trace record
pays for the largest: 512 bytes for a string, eight times the memory and the reader's
copying), and a padding record at the end of the ring (a second reservation in the detour).

**Reservation (multi-producer).** A record of ``k`` slots takes tickets ``t .. t+k-1`` with
``lock cmpxchg head, t+k`` when the ring has room (``t + k - tail <= capacity``), retried
when another producer won; it starts in slot ``t % capacity``. When the ring is full it
increments ``drops`` and writes nothing. This is perf's reservation (``perf_output_begin()``:
a cmpxchg loop on ``head`` against the reader's ``data_tail``, a ``lost`` count on failure).
Rejected: ``lock xadd head`` (a blind increment). A ticket taken on a full ring cannot be
given back, and its slot is still the reader's, so nothing can be written for it: the reader,
arriving at that ticket, cannot tell a dropped ticket from one whose record is still being
written, and waits forever.

**Commit (publication).** A record's first word is its commit word: the producer writes every
other field first and ``COMMIT_TAG | t + 1`` there last, with plain stores. x86 is TSO:
stores become visible in program order, and loads are not reordered with older loads, so a
reader that loads the commit word, sees the value it expects and then loads the fields sees
them complete. The word carries the ticket, so a record of an earlier lap or a fresh zeroed
slot never reads as committed, and no one has to clear it; the tag in its top bits keeps a
word in the middle of an older, longer record (an argument that happens to equal ``t + 1``)
from reading as a commit.

**Release.** The reader copies the records it returns and only then stores the new ``tail``
(one aligned 8-byte store, through a ``memoryview`` of words: ``struct.pack_into`` writes
byte by byte). A producer that loads that ``tail`` may overwrite those slots: its later
stores cannot pass its load, and the reader's loads came before its store. So no record is
ever overwritten while it is read, and reads never tear.

**Waiting for room (``--block``).** A producer that finds the ring full may wait instead of
dropping, while the reader says it reads: ``block_until`` holds a TSC deadline that the reader
pushes forward each time it reads (a *lease*: ``set_lease``). The producer retries while
``rdtsc`` is below it, and drops and counts once it is not. A reader that dies, is stopped,
or stops reading (its output blocked) stops renewing it, and every waiting producer goes on
when it runs out: no thread ever waits for a reader that is gone. 0, the word's value in a
fresh area, never lets a producer wait. Rejected: a bound per record alone (a dead reader
would cost the program that bound on every hit); a futex the reader wakes (a syscall in the
detour, which a program's seccomp filter may forbid).

A record reserved and never committed (its producer longjmp'ed out of a signal handler in
the middle of the detour) stops the reader there for good; ``Batch.pending`` says the reader
waits, and the tool, at a full stop with no thread inside a detour, can tell it is abandoned.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

from kprobes.errors import InternalError
from kprobes.values import dataclass

MAGIC: Final = int.from_bytes(b"KPRBAREA", "little")
VERSION: Final = 3  # 3: the stack ids' table (its entries and stride in the header)
PAGE: Final = 4096
CACHE_LINE: Final = 64
SLOT: Final = 64  # bytes per ring slot
MIRROR: Final = 2 * PAGE  # ring bytes mapped again after its end: the largest record
MAX_SLOTS: Final = MIRROR // SLOT

# Header words (byte offsets). The first line is written once, by the tool, before use.
OFF_MAGIC: Final = 0
OFF_VERSION: Final = 8  # u32; the slot size is the u32 at 12
OFF_CAPACITY: Final = 16
OFF_NCOUNTERS: Final = 24
OFF_COUNTERS: Final = 32
OFF_RING: Final = 40
OFF_HEAD: Final = 64  # producers: the next ticket
OFF_TAIL: Final = 128  # the reader: the first ticket not yet consumed
OFF_DROPS: Final = 192  # producers: hits not recorded because the ring was full
OFF_DROPS_READ: Final = 256  # the reader: drops already reported
OFF_BLOCK_UNTIL: Final = 320  # the reader: producers may wait for room until this TSC
OFF_STACKS_LOST: Final = 384  # producers: hits not counted by stack, the table was full

COUNTER_STRIDE: Final = CACHE_LINE

# Record fields (byte offsets into a record).
REC_COMMIT: Final = 0  # COMMIT_TAG | ticket + 1, written last
REC_META: Final = 8  # probe id (bits 0-31) | slots (32-47) | cpu (48-62) | registers (63)
REC_THREAD: Final = 16  # the thread pointer (fs base)
REC_TSC: Final = 24
REC_HEADER: Final = 32  # then the registers if the record has them, then the captures
COMMIT_TAG: Final = 0x4B50 << 48
META_SLOTS_SHIFT: Final = 32
META_CPU_SHIFT: Final = 48
META_CPU_MASK: Final = 0x7FFF
META_REGS: Final = 1 << 63
# The registers block: rip, eflags, rsp, then the general registers in struct
# user_regs_struct order (r15 first).
GPR_ORDER: Final = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10",
    "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
)  # fmt: skip
REG_ORDER: Final = ("rip", "eflags", "rsp", *GPR_ORDER)
REGS_BLOCK: Final = 8 * len(REG_ORDER)  # 144

_HEADER: Final = struct.Struct("<QIIQQQQII")
_REC_HEADER: Final = struct.Struct("<4Q")
_REGS: Final = struct.Struct(f"<{len(REG_ORDER)}Q")


def rec_reg(name: str) -> int:
    """The offset of register ``name`` ("rip", "eflags", "rsp", "rax", ...) in a record that
    has the registers block."""
    return REC_HEADER + 8 * REG_ORDER.index(name)


def slots_for(nbytes: int) -> int:
    """Slots a record of ``nbytes`` takes; InternalError past the largest record."""
    k = max(1, (nbytes + SLOT - 1) // SLOT)
    if k > MAX_SLOTS:
        raise InternalError(f"a record of {nbytes} bytes exceeds {MAX_SLOTS * SLOT}")
    return k


@dataclass(frozen=True, slots=True)
class AreaLayout:
    """Where everything is in a shared area of ``ncounters`` counters, a table of
    ``stack_entries`` stack ids of ``stack_stride`` bytes each (0: none) and a ring of
    ``capacity`` slots (0: no ring, counters only)."""

    ncounters: int
    capacity: int
    stack_entries: int = 0
    stack_stride: int = 0

    def __post_init__(self) -> None:
        cap = self.capacity
        if cap and (cap & (cap - 1) or cap * SLOT < MIRROR or cap >= 1 << 31):
            raise InternalError(
                f"ring capacity {cap} is not 0 or a power of two of at least {MIRROR // SLOT}"
            )
        if self.ncounters < 0:
            raise InternalError(f"{self.ncounters} counters")
        n, stride = self.stack_entries, self.stack_stride
        if n < 0 or n & (n - 1) or n >= 1 << 24 or (n and (stride <= 0 or stride % 8)):
            raise InternalError(f"a stack table of {n} entries of {stride} bytes")

    @property
    def counters_offset(self) -> int:
        return PAGE

    @property
    def stacks_offset(self) -> int:
        counters_end = PAGE + self.ncounters * COUNTER_STRIDE
        return (counters_end + PAGE - 1) & ~(PAGE - 1)

    @property
    def stacks_bytes(self) -> int:
        return (self.stack_entries * self.stack_stride + PAGE - 1) & ~(PAGE - 1)

    @property
    def ring_offset(self) -> int:
        return self.stacks_offset + self.stacks_bytes

    @property
    def ring_bytes(self) -> int:
        return self.capacity * SLOT

    @property
    def size(self) -> int:
        """Bytes of the file (a whole number of pages); the tool maps this much."""
        return self.ring_offset + self.ring_bytes

    @property
    def map_size(self) -> int:
        """Bytes the program maps: the file, then the ring's first ``MIRROR`` bytes again."""
        return self.size + (MIRROR if self.capacity else 0)

    def counter_offset(self, index: int) -> int:
        if not 0 <= index < self.ncounters:
            raise InternalError(f"counter {index} of {self.ncounters}")
        return PAGE + index * COUNTER_STRIDE

    def record_offset(self, ticket: int) -> int:
        return self.ring_offset + (ticket & (self.capacity - 1)) * SLOT

    def ring_at(self, base: int) -> RingAddrs:
        """The absolute addresses a record action needs, for the area mapped at ``base``."""
        if not self.capacity:
            raise InternalError("this area has no ring")
        return RingAddrs(
            head=base + OFF_HEAD,
            tail=base + OFF_TAIL,
            drops=base + OFF_DROPS,
            block_until=base + OFF_BLOCK_UNTIL,
            ring=base + self.ring_offset,
            capacity=self.capacity,
        )


@dataclass(frozen=True, slots=True)
class RingAddrs:
    """The ring as the program sees it: absolute addresses in the program's mapping."""

    head: int
    tail: int
    drops: int
    block_until: int
    ring: int
    capacity: int  # slots


@dataclass(frozen=True, slots=True)
class Record:
    """One hit, as its detour wrote it. ``thread`` is the thread's fs base (its thread
    pointer); ``tsc`` the time stamp counter and ``cpu`` the CPU (``rdtscp``); ``regs`` the
    registers at the probe point in ``REG_ORDER``, if the probe asked for them; ``data`` the
    captured fetch-args (capture.py reads them)."""

    ticket: int
    probe: int
    cpu: int
    thread: int
    tsc: int
    regs: tuple[int, ...] | None
    data: bytes

    def reg(self, name: str) -> int:
        if self.regs is None:
            raise InternalError("this record has no registers")
        return self.regs[REG_ORDER.index(name)]


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
        SLOT,
        layout.capacity,
        layout.ncounters,
        layout.counters_offset,
        layout.ring_offset,
        layout.stack_entries,
        layout.stack_stride,
    )


def layout_of(buffer: memoryview | bytearray) -> AreaLayout:
    """The layout an area's header describes; InternalError if it is not one of ours."""
    magic, version, slot, capacity, ncounters, _, ring, entries, stride = _HEADER.unpack_from(
        buffer, 0
    )
    if magic != MAGIC or version != VERSION or slot != SLOT:
        raise InternalError(f"not a kprobes shared area (magic {magic:#x}, version {version})")
    layout = AreaLayout(ncounters, capacity, entries, stride)
    if ring != layout.ring_offset or len(buffer) < layout.size:
        raise InternalError("the shared area's header does not match its size")
    return layout


def read_counter(buffer: memoryview | bytearray, index: int) -> int:
    """Probe counter ``index`` (one aligned 8-byte load)."""
    offset = layout_of(buffer).counter_offset(index)
    return int(memoryview(buffer).cast("B").cast("Q")[offset // 8])


def read_counters(buffer: memoryview | bytearray, indexes: Iterable[int]) -> list[int]:
    """Probe counters ``indexes``, in order, the header read once (a sweep of thousands of
    probes reads them all)."""
    layout = layout_of(buffer)
    words = memoryview(buffer).cast("B").cast("Q")
    try:
        return [int(words[layout.counter_offset(i) // 8]) for i in indexes]
    finally:
        words.release()  # no export left behind: the area's mapping may be closed later


def set_lease(buffer: memoryview | bytearray, tsc: int) -> None:
    """Let producers that find the ring full wait for room until the TSC reads ``tsc`` (0:
    never wait). One aligned 8-byte store."""
    words = memoryview(buffer).cast("B").cast("Q")
    try:
        words[OFF_BLOCK_UNTIL // 8] = tsc
    finally:
        words.release()


def decode_record(ticket: int, raw: bytes) -> Record:
    """A record's fields from its bytes (all its slots, the commit word first)."""
    _, meta, thread, tsc = _REC_HEADER.unpack_from(raw, 0)
    cpu = (meta >> META_CPU_SHIFT) & META_CPU_MASK
    if meta & META_REGS:
        regs: tuple[int, ...] | None = _REGS.unpack_from(raw, REC_HEADER)
        data = raw[REC_HEADER + REGS_BLOCK :]
    else:
        regs, data = None, raw[REC_HEADER:]
    return Record(ticket, meta & 0xFFFF_FFFF, cpu, thread, tsc, regs, data)


def read_records(buffer: memoryview | bytearray, *, limit: int | None = None) -> Batch:
    """The complete records written since the last read, and the drops, and release them.

    ``buffer`` is the whole area (writable: the reader's ``tail`` and ``drops_read`` live in
    its header, so this function keeps no state of its own). At most ``limit`` records.
    Never returns a record that is not fully written.
    """
    layout = layout_of(buffer)
    mv = memoryview(buffer).cast("B")
    words = mv.cast("Q")
    cap = layout.capacity
    ring, ring_end = layout.ring_offset, layout.size
    tail = int(words[OFF_TAIL // 8])
    most = cap if limit is None else min(limit, cap)
    records: list[Record] = []
    # Step 1: copy committed records in ticket order; stop at the first one not committed.
    ticket = tail
    while len(records) < most:
        offset = ring + (ticket & (cap - 1)) * SLOT
        if words[offset // 8] != COMMIT_TAG | (ticket + 1):
            break
        k = (int(words[offset // 8 + 1]) >> META_SLOTS_SHIFT) & 0xFFFF
        if not 0 < k <= MAX_SLOTS:
            raise InternalError(f"record {ticket} says it takes {k} slots")
        end = offset + k * SLOT
        if end <= ring_end:  # after the commit word's load
            raw = bytes(mv[offset:end])
        else:
            raw = bytes(mv[offset:ring_end]) + bytes(mv[ring : ring + end - ring_end])
        records.append(decode_record(ticket, raw))
        ticket += k
    pending = words[OFF_HEAD // 8] > ticket
    # Step 2: release the slots (after the copies) and account the drops.
    words[OFF_TAIL // 8] = ticket
    drops = int(words[OFF_DROPS // 8])
    dropped = drops - int(words[OFF_DROPS_READ // 8])
    words[OFF_DROPS_READ // 8] = drops
    return Batch(tuple(records), dropped, pending)


def fill(buffer: memoryview | bytearray) -> float:
    """The share of the ring written and not read yet (1.0: full, the next record drops)."""
    words = memoryview(buffer).cast("B").cast("Q")
    cap = layout_of(buffer).capacity
    return min(int(words[OFF_HEAD // 8]) - int(words[OFF_TAIL // 8]), cap) / cap


def skip_records(buffer: memoryview | bytearray) -> int:
    """Release the committed records unread (the reader no longer wants them), as
    ``read_records`` would, without copying them; how many. It stops, as the reader does, at
    a record still being written: moving the tail past it would let the ring lap under its
    producer, whose late commit would then stop the reader for good."""
    layout = layout_of(buffer)
    words = memoryview(buffer).cast("B").cast("Q")
    cap, ring = layout.capacity, layout.ring_offset
    ticket = tail = int(words[OFF_TAIL // 8])
    head = int(words[OFF_HEAD // 8])
    ticket, skipped = _skip_one_slot_run(words, ring // 8, cap, ticket, head)
    while ticket < head:
        index = (ring + (ticket & (cap - 1)) * SLOT) // 8
        if words[index] != COMMIT_TAG | (ticket + 1):
            break
        k = (int(words[index + 1]) >> META_SLOTS_SHIFT) & 0xFFFF
        if not 0 < k <= MAX_SLOTS:
            raise InternalError(f"record {ticket} says it takes {k} slots")
        ticket += k
        skipped += 1
    if ticket != tail:
        words[OFF_TAIL // 8] = ticket
    return skipped


def _skip_one_slot_run(
    words: memoryview, ring: int, cap: int, ticket: int, head: int
) -> tuple[int, int]:
    """The fast part of ``skip_records``: the longest run of committed one-slot records from
    ``ticket``, found by comparing whole stretches of commit words in C (a busy program's
    32 MiB backlog is 500,000 records, seconds for the loop). A record of k slots carries
    its commit word only in its first slot, so a slot followed by a slot that holds the
    next ticket's commit word is a one-slot record; the last slot of a run is left to the
    loop, which reads its size. Returns (the ticket after the run, records in it)."""
    start = ticket
    stride = SLOT // 8
    while head - ticket > 1:
        index = ticket & (cap - 1)
        n = min(head - ticket, 4096)  # a stretch at a time
        first = ring + index * stride
        upto = min(n, cap - index)  # to the ring's end, then on from its start
        found = words[first : first + upto * stride : stride].tolist()
        if upto < n:
            found += words[ring : ring + (n - upto) * stride : stride].tolist()
        want = range(COMMIT_TAG + ticket + 1, COMMIT_TAG + ticket + 1 + n)
        if found == list(want):
            ticket += n - 1  # the last: the loop, or the next stretch, looks at it again
            continue
        matched = next(i for i, (w, e) in enumerate(zip(found, want, strict=True)) if w != e)
        ticket += max(matched - 1, 0)
        break
    return ticket, ticket - start
