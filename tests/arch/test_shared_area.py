"""The shared area's layout and its reader, against a producer written in Python that follows
the record action's protocol step by step (reserve k slots, fill, commit), so that every
interleaving the reader must survive can be set up exactly: records of different sizes, one
that runs past the ring's end, a record reserved but not committed, stale words of earlier
laps, a full ring. The last test maps a real memfd twice, as the program does (the ring's
first bytes again after its end), and reads it through the tool's own mapping."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct

import pytest

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.regs import REG_INDEX
from kprobes.errors import InternalError

MASK = (1 << 64) - 1
PROBE, THREAD, CPU = 5, 0x7F00_1234_5000, 1
CAP = sa.MIRROR // sa.SLOT  # the smallest ring: 128 slots


def regs_of(i: int) -> tuple[int, ...]:
    """A registers block for call ``i``: rip, eflags, rsp, then r15 .. rdi."""
    gprs = [i * 100 + k for k in range(len(sa.GPR_ORDER))]
    return (0x401000, 0x246, 0x7FFC_0000 - 8 * i, *gprs)


def payload(i: int, n: int) -> bytes:
    """``n`` bytes of captures for call ``i``: each byte says which call and where."""
    return bytes((i * 7 + j) & 0xFF for j in range(n))


class Producer:
    """The record action's protocol, in Python, on the area's bytes.

    The program writes a record as one run of bytes, and its mapping of the ring's first
    ``MIRROR`` bytes after the ring's end puts the bytes past the end at the start; a bytearray
    has no mirror, so ``write`` wraps at the ring's end, which is what the mirror makes the
    stores do."""

    def __init__(self, buf: bytearray | memoryview, layout: sa.AreaLayout) -> None:
        self.buf, self.layout = buf, layout

    def word(self, offset: int) -> int:
        return int(struct.unpack_from("<Q", self.buf, offset)[0])

    def set_word(self, offset: int, value: int) -> None:
        struct.pack_into("<Q", self.buf, offset, value & MASK)

    def reserve(self, k: int = 1) -> int | None:
        """Tickets t .. t+k-1 (t returned), or a drop when the ring has no room for k."""
        head, tail = self.word(sa.OFF_HEAD), self.word(sa.OFF_TAIL)
        if head + k - tail > self.layout.capacity:
            self.set_word(sa.OFF_DROPS, self.word(sa.OFF_DROPS) + 1)
            return None
        self.set_word(sa.OFF_HEAD, head + k)
        return head

    def write(self, ticket: int, pos: int, data: bytes) -> None:
        """``data`` at byte ``pos`` of the record of ``ticket``, wrapping at the ring's end."""
        ring, nbytes = self.layout.ring_offset, self.layout.ring_bytes
        start = (ticket % self.layout.capacity) * sa.SLOT + pos
        for j in range(0, len(data), 8):
            at = (start + j) % nbytes
            self.buf[ring + at : ring + at + len(data[j : j + 8])] = data[j : j + 8]

    def fill(
        self,
        ticket: int,
        k: int,
        i: int,
        *,
        regs: bool = False,
        data: bytes = b"",
        cpu: int = CPU,
        probe: int = PROBE,
    ) -> None:
        meta = probe | k << sa.META_SLOTS_SHIFT | cpu << sa.META_CPU_SHIFT
        meta |= sa.META_REGS if regs else 0
        self.write(ticket, sa.REC_META, struct.pack("<3Q", meta, THREAD + i, 1000 + i))
        at = sa.REC_HEADER
        if regs:
            self.write(ticket, at, struct.pack(f"<{len(sa.REG_ORDER)}Q", *regs_of(i)))
            at += sa.REGS_BLOCK
        self.write(ticket, at, data)

    def commit(self, ticket: int) -> None:
        self.write(ticket, sa.REC_COMMIT, struct.pack("<Q", sa.COMMIT_TAG | (ticket + 1)))

    def hit(self, i: int, *, regs: bool = False, data: bytes = b"") -> int | None:
        k = sa.slots_for(sa.REC_HEADER + (sa.REGS_BLOCK if regs else 0) + len(data))
        ticket = self.reserve(k)
        if ticket is not None:
            self.fill(ticket, k, i, regs=regs, data=data)
            self.commit(ticket)
        return ticket

    def advance(self, tickets: int) -> None:
        """Move head and tail on by ``tickets`` one-slot records, read as they come."""
        for n in range(tickets):
            self.hit(0)
            if n % 64 == 63 or n == tickets - 1:
                assert sa.read_records(self.buf).dropped == 0


def make(capacity: int = CAP, ncounters: int = 3) -> tuple[bytearray, sa.AreaLayout, Producer]:
    layout = sa.AreaLayout(ncounters, capacity)
    buf = bytearray(layout.size)
    sa.init_area(buf, layout)
    return buf, layout, Producer(buf, layout)


def calls(batch: sa.Batch) -> list[int]:
    return [r.tsc - 1000 for r in batch.records]


# ---- layout -----------------------------------------------------------------------------------


def test_layout() -> None:
    layout = sa.AreaLayout(ncounters=3, capacity=128)
    assert layout.counters_offset == 4096
    assert [layout.counter_offset(i) for i in range(3)] == [4096, 4160, 4224]
    assert layout.ring_offset == 8192 and layout.ring_bytes == 128 * 64
    assert layout.size == 8192 + 8192
    assert layout.map_size == layout.size + sa.MIRROR == 8192 + 2 * 8192
    assert layout.record_offset(0) == layout.record_offset(128) == 8192
    assert layout.record_offset(3) == layout.record_offset(131) == 8192 + 3 * 64
    ring = layout.ring_at(0x7F00_0000_0000)
    assert (ring.head, ring.tail, ring.drops, ring.ring, ring.capacity) == (
        0x7F00_0000_0040,
        0x7F00_0000_0080,
        0x7F00_0000_00C0,
        0x7F00_0000_2000,
        128,
    )
    assert sa.AreaLayout(0, 128).ring_offset == 4096
    assert sa.AreaLayout(64, 128).ring_offset == 8192
    assert sa.AreaLayout(65, 128).ring_offset == 12288
    counters_only = sa.AreaLayout(5, 0)
    assert counters_only.map_size == counters_only.size == 8192  # no ring, no mirror
    with pytest.raises(InternalError, match="no ring"):
        counters_only.ring_at(0)
    with pytest.raises(InternalError):
        layout.counter_offset(3)


def test_record_fields() -> None:
    assert (sa.REC_COMMIT, sa.REC_META, sa.REC_THREAD, sa.REC_TSC, sa.REC_HEADER) == (
        0, 8, 16, 24, 32,
    )  # fmt: skip
    assert sa.COMMIT_TAG == 0x4B50 << 48 and sa.COMMIT_TAG & sa.META_REGS == 0
    assert sa.REGS_BLOCK == 144 and sa.MAX_SLOTS == 128
    assert [sa.rec_reg(r) for r in ("rip", "eflags", "rsp", "r15", "rax", "rdi")] == [
        32, 40, 48, 56, 136, 168,
    ]  # fmt: skip
    # the general registers in struct user_regs_struct order, as the tool's Regs keeps them
    assert list(sa.GPR_ORDER) == sorted(sa.GPR_ORDER, key=REG_INDEX.__getitem__)
    assert [REG_INDEX[r] for r in sa.GPR_ORDER] == list(range(15))


@pytest.mark.parametrize(
    ("nbytes", "slots"), [(0, 1), (1, 1), (64, 1), (65, 2), (176, 3), (8192, 128)]
)
def test_slots_for(nbytes: int, slots: int) -> None:
    assert sa.slots_for(nbytes) == slots


def test_slots_for_refuses_more_than_the_mirror() -> None:
    with pytest.raises(InternalError, match="exceeds 8192"):
        sa.slots_for(sa.MIRROR + 1)


@pytest.mark.parametrize(
    ("capacity", "ncounters"),
    [(12, 0), (64, 0), (96, 0), (1 << 31, 0), (128, -1)],
    ids=["not-a-power-of-two", "smaller-than-the-mirror", "not-either", "too-big", "counters"],
)
def test_bad_layouts(capacity: int, ncounters: int) -> None:
    with pytest.raises(InternalError):
        sa.AreaLayout(ncounters, capacity)


def test_header_round_trip_and_bad_headers() -> None:
    buf, layout, _ = make()
    assert sa.layout_of(buf) == layout
    with pytest.raises(InternalError, match="not a kprobes shared area"):
        sa.read_records(bytearray(layout.size))
    with pytest.raises(InternalError):
        sa.init_area(bytearray(100), layout)
    with pytest.raises(InternalError, match="does not match"):
        sa.layout_of(buf[: layout.size - 4096])
    for offset, value in ((sa.OFF_VERSION, 1), (sa.OFF_VERSION + 4, 192)):  # version, slot
        bad = bytearray(buf)
        struct.pack_into("<I", bad, offset, value)
        with pytest.raises(InternalError, match="not a kprobes shared area"):
            sa.layout_of(bad)


def test_a_table_of_stack_ids_lies_between_the_counters_and_the_ring() -> None:
    layout = sa.AreaLayout(ncounters=3, capacity=128, stack_entries=4, stack_stride=1040)
    assert layout.stacks_offset == 8192 and layout.stacks_bytes == 8192  # 4160, in pages
    assert layout.ring_offset == 16384
    buf = bytearray(layout.size)
    sa.init_area(buf, layout)
    assert sa.layout_of(buf) == layout
    for entries, stride in ((3, 1040), (4, 0), (4, 1036), (1 << 24, 64)):
        with pytest.raises(InternalError):
            sa.AreaLayout(0, 0, entries, stride)


def test_counters() -> None:
    buf, layout, p = make()
    p.set_word(layout.counter_offset(1), 12345)
    assert [sa.read_counter(buf, i) for i in range(3)] == [0, 12345, 0]
    with pytest.raises(InternalError):
        sa.read_counter(buf, 3)


# ---- reading ------------------------------------------------------------------------------------


def test_empty() -> None:
    buf, _, _ = make()
    assert sa.read_records(buf) == sa.Batch((), 0, False)


def test_records_of_different_sizes_in_order_with_their_fields() -> None:
    buf, _, p = make()
    shapes = [(False, 0), (True, 0), (False, 40), (True, 300), (False, 32), (True, 1000)]
    for i, (regs, n) in enumerate(shapes):
        p.hit(i, regs=regs, data=payload(i, n))
    batch = sa.read_records(memoryview(buf))
    assert calls(batch) == list(range(6)) and batch.dropped == 0 and not batch.pending
    # header 32, registers 144, captures: 1, 3, 2, 8, 1, 19 slots
    assert [r.ticket for r in batch.records] == [0, 1, 4, 6, 14, 15]
    for i, ((regs, n), r) in enumerate(zip(shapes, batch.records, strict=True)):
        assert (r.probe, r.cpu, r.thread, r.tsc) == (PROBE, CPU, THREAD + i, 1000 + i)
        assert r.regs == (regs_of(i) if regs else None)
        size = sa.slots_for(sa.REC_HEADER + sa.REGS_BLOCK * regs + n) * sa.SLOT
        assert len(r.data) == size - sa.REC_HEADER - sa.REGS_BLOCK * regs  # all its slots
        assert r.data[:n] == payload(i, n)
    r = batch.records[3]
    assert (r.reg("rip"), r.reg("eflags"), r.reg("rsp")) == (0x401000, 0x246, 0x7FFC_0000 - 24)
    assert (r.reg("r15"), r.reg("rax"), r.reg("rdi")) == (300, 310, 314)
    with pytest.raises(InternalError, match="no registers"):
        batch.records[0].reg("rip")
    assert p.word(sa.OFF_TAIL) == 34  # 1 + 3 + 2 + 8 + 1 + 19 slots
    assert sa.read_records(buf).records == ()  # released: not read twice


@pytest.mark.parametrize("cpu", [0, 63, 4095, sa.META_CPU_MASK])
def test_meta_word(cpu: int) -> None:
    buf, _, p = make()
    t = p.reserve(3)
    assert t == 0
    p.fill(t, 3, 0, regs=True, cpu=cpu, probe=0x7FFF_FFFF)
    p.commit(t)
    (r,) = sa.read_records(buf).records
    assert (r.probe, r.cpu, r.regs is not None, len(r.data)) == (0x7FFF_FFFF, cpu, True, 16)


@pytest.mark.parametrize("start", [CAP - 5, CAP - 4, CAP - 1, 3 * CAP - 1])
def test_a_record_past_the_ring_end_is_read_in_two_pieces(start: int) -> None:
    buf, layout, p = make()
    p.advance(start)
    data = payload(9, 200)  # 32 + 144 + 200 bytes: 6 slots
    t = p.hit(9, regs=True, data=data)
    assert t == start
    after = p.hit(10, data=payload(10, 8))
    # the record's first slot is near the end, its others at the start of the ring
    first, end = layout.record_offset(start), layout.ring_offset + layout.ring_bytes
    assert buf[first : first + 8] == struct.pack("<Q", sa.COMMIT_TAG | (start + 1))
    wrapped = 6 * sa.SLOT - (end - first)
    assert wrapped > 0
    assert layout.record_offset(after) == layout.ring_offset + wrapped
    batch = sa.read_records(buf)
    assert calls(batch) == [9, 10] and [r.ticket for r in batch.records] == [start, start + 6]
    r = batch.records[0]
    assert r.regs == regs_of(9) and r.data[:200] == data and len(r.data) == 6 * 64 - 176
    assert batch.records[1].data[:8] == payload(10, 8)


def test_a_record_that_ends_at_the_ring_end_and_one_at_its_start() -> None:
    buf, layout, p = make()
    p.advance(CAP - 3)
    assert p.hit(1, regs=True) == CAP - 3  # 3 slots: the last three
    assert p.hit(2, regs=True) == CAP  # slot 0
    batch = sa.read_records(buf)
    assert calls(batch) == [1, 2] and all(r.regs for r in batch.records)
    assert layout.record_offset(CAP) == layout.ring_offset


def test_stops_at_a_record_being_written() -> None:
    buf, _, p = make()
    p.hit(0)
    t1 = p.reserve(4)  # reserved, being written
    assert t1 == 1
    p.hit(2, regs=True)  # a later writer finished first
    batch = sa.read_records(buf)
    assert calls(batch) == [0] and batch.pending
    p.fill(t1, 4, 1, regs=True, data=payload(1, 50))
    assert sa.read_records(buf) == sa.Batch((), 0, True)  # filled, not yet committed
    p.commit(t1)
    batch = sa.read_records(buf)
    assert calls(batch) == [1, 2] and not batch.pending
    assert [r.ticket for r in batch.records] == [1, 5]
    assert batch.records[0].data[:50] == payload(1, 50)


def test_a_word_of_an_older_longer_record_is_not_a_commit() -> None:
    buf, layout, p = make()
    # Ticket 0: a record of 3 slots whose registers put ticket CAP + 2's number (without the
    # tag) as the first word of slot 2, exactly where that ticket's commit word will be.
    t0 = p.reserve(3)
    assert t0 == 0
    p.fill(t0, 3, 0, regs=True)
    stale = CAP + 2
    pos = 2 * sa.SLOT  # r8 in the registers block
    assert pos == sa.rec_reg("r8")
    p.write(t0, pos, struct.pack("<Q", stale + 1))
    p.commit(t0)
    assert sa.read_records(buf).records[0].reg("r8") == stale + 1
    p.advance(CAP - 1)  # tickets 3 .. CAP + 1, one slot each, read
    t = p.reserve()
    assert t == stale and layout.record_offset(t) == layout.record_offset(2)
    assert p.word(layout.record_offset(t)) == t + 1  # the old record's word, still there
    assert sa.read_records(buf) == sa.Batch((), 0, True)
    p.fill(t, 1, 77)
    p.commit(t)
    assert calls(sa.read_records(buf)) == [77]


def test_a_stale_commit_of_the_previous_lap_is_not_read() -> None:
    buf, _, p = make()
    p.advance(CAP)  # every slot holds a committed record of lap 0
    t = p.reserve()
    assert t == CAP  # slot 0 again: its commit word says ticket 0
    p.fill(t, 1, 40)  # even filled: its commit word is not this ticket's
    assert sa.read_records(buf) == sa.Batch((), 0, True)
    p.commit(t)
    assert calls(sa.read_records(buf)) == [40]


def test_full_ring_drops_and_reports_them_once() -> None:
    buf, _, p = make()
    big = [p.hit(i, regs=True) for i in range(44)]  # 3 slots each: 42 fit in 128
    assert big[:42] == list(range(0, 126, 3)) and big[42:] == [None, None]
    assert p.hit(100) == 126 and p.hit(101) == 127  # one slot each still fits
    assert p.hit(102) is None
    batch = sa.read_records(buf)
    assert calls(batch) == [*range(42), 100, 101] and batch.dropped == 3
    assert not batch.pending
    assert [p.hit(i, regs=True) for i in (200, 201)] == [128, 131]
    batch = sa.read_records(buf)
    assert calls(batch) == [200, 201] and batch.dropped == 0
    assert p.word(sa.OFF_DROPS) == p.word(sa.OFF_DROPS_READ) == 3


def test_a_reservation_needs_room_for_all_its_slots() -> None:
    _, _, p = make()
    p.advance(10)
    for i in range(CAP - 2):
        p.hit(i)
    assert p.reserve(3) is None  # two slots free: not three
    assert p.reserve(2) == 10 + CAP - 2
    assert p.word(sa.OFF_HEAD) - p.word(sa.OFF_TAIL) == CAP


def test_limit() -> None:
    buf, _, p = make()
    for i in range(6):
        p.hit(i, regs=i % 2 == 0)
    batch = sa.read_records(buf, limit=4)
    assert calls(batch) == [0, 1, 2, 3] and batch.pending
    batch = sa.read_records(buf, limit=4)
    assert calls(batch) == [4, 5] and not batch.pending


def test_a_record_that_says_it_has_no_slots_is_an_internal_error() -> None:
    buf, _, p = make()
    t = p.reserve()
    assert t is not None
    p.fill(t, 0, 0)  # a meta word that no detour writes
    p.commit(t)
    with pytest.raises(InternalError, match="0 slots"):
        sa.read_records(buf)


def test_many_laps_of_records_of_random_sizes() -> None:
    buf, _, p = make()
    rng = random.Random(7)
    seen: list[sa.Record] = []
    dropped = hits = 0
    sizes: dict[int, int] = {}
    for i in range(5000):
        n = rng.choice([0, 0, 8, 24, 100, 500, 1500])
        regs = rng.random() < 0.3
        sizes[i] = n
        hits += 1
        p.hit(i, regs=regs, data=payload(i, n))
        if rng.random() < 0.05:
            batch = sa.read_records(buf)
            seen += batch.records
            dropped += batch.dropped
            assert not batch.pending
    batch = sa.read_records(buf)
    seen += batch.records
    dropped += batch.dropped
    got = [r.tsc - 1000 for r in seen]
    assert got == sorted(got) and len(got) + dropped == hits and dropped > 0
    assert p.word(sa.OFF_TAIL) > 20 * CAP  # many laps
    tickets = [r.ticket for r in seen]
    assert tickets == sorted(tickets)
    for r, i in zip(seen, got, strict=True):
        assert r.thread == THREAD + i and r.data[: sizes[i]] == payload(i, sizes[i])
        assert r.regs is None or r.regs == regs_of(i)


# ---- the program's mapping and the tool's ---------------------------------------------------

_MAP_FIXED = 0x10


def test_a_real_mirror_mapping() -> None:
    """The program's view: the file, then the ring's first MIRROR bytes again (one memfd
    mapped twice, as memory.py has the program do); a record written as one run of bytes
    past the ring's end lands at its start, and the tool, which maps the file once, reads it
    in two pieces."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    layout = sa.AreaLayout(1, CAP)
    fd = os.memfd_create("kprobes-test-area")
    try:
        os.ftruncate(fd, layout.size)
        rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
        base = libc.mmap(None, layout.map_size, rw, shared, fd, 0)
        assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        mirror = libc.mmap(base + layout.size, sa.MIRROR, rw, shared | _MAP_FIXED, fd,
                           layout.ring_offset)  # fmt: skip
        assert mirror == base + layout.size, ctypes.get_errno()
        program = memoryview((ctypes.c_char * layout.map_size).from_address(base)).cast("B")
        tool = mmap.mmap(fd, layout.size)
        try:
            sa.init_area(memoryview(tool), layout)
            p = Producer(program, layout)
            p.advance(CAP - 2)
            t = p.reserve(5)
            assert t == CAP - 2
            # The program's stores: one run of bytes from the record's first slot on.
            at = layout.record_offset(t)
            head = struct.pack("<4Q", 0, PROBE | 5 << 32 | CPU << 48, THREAD, 1234)
            body = head + payload(3, 5 * sa.SLOT - 32)
            program[at + 8 : at + 5 * sa.SLOT] = body[8:]
            program[at : at + 8] = struct.pack("<Q", sa.COMMIT_TAG | (t + 1))
            ring = layout.ring_offset
            assert tool[ring : ring + 3 * sa.SLOT] == body[2 * sa.SLOT :]  # through the mirror
            batch = sa.read_records(memoryview(tool))
            (r,) = batch.records
            assert (r.ticket, r.probe, r.thread, r.tsc, r.cpu) == (t, PROBE, THREAD, 1234, CPU)
            assert r.data == payload(3, 5 * sa.SLOT - 32)
            assert struct.unpack_from("<Q", program, sa.OFF_TAIL)[0] == CAP + 3
        finally:
            del program
            tool.close()
            libc.munmap(base, layout.map_size)
    finally:
        os.close(fd)


def test_skip_releases_committed_records_and_stops_at_one_being_written() -> None:
    layout = sa.AreaLayout(ncounters=0, capacity=sa.MAX_SLOTS * 2)
    buf = bytearray(layout.size)
    sa.init_area(buf, layout)
    words = memoryview(buf).cast("Q")

    def commit(ticket: int, k: int) -> None:
        at = (layout.record_offset(ticket)) // 8
        words[at + 1] = 7 | k << sa.META_SLOTS_SHIFT
        words[at] = sa.COMMIT_TAG | (ticket + 1)

    commit(0, 1)
    commit(1, 3)
    words[sa.OFF_HEAD // 8] = 4 + 2 + 1  # ticket 4 (2 slots) reserved, not committed; 6 too
    commit(6, 1)
    assert sa.skip_records(buf) == 2
    assert words[sa.OFF_TAIL // 8] == 4  # stopped at the record being written
    assert sa.read_records(buf).pending
    commit(4, 2)
    assert sa.skip_records(buf) == 2 and words[sa.OFF_TAIL // 8] == 7
    assert sa.read_records(buf).records == ()


def test_skip_counts_long_runs_across_the_ring_end_as_the_reader_would() -> None:
    # The fast path compares whole stretches of commit words: runs of one-slot records
    # past the ring's end, with multi-slot records between them and one still being
    # written, must give the reader's own count and stop where it stops.
    rng = random.Random(17)
    cap = 1 << 13
    layout = sa.AreaLayout(ncounters=0, capacity=cap)
    buf = bytearray(layout.size)
    sa.init_area(buf, layout)
    words = memoryview(buf).cast("Q")
    start = cap - 3000  # the run crosses the ring's end
    words[sa.OFF_TAIL // 8] = start
    ticket, sizes = start, []
    while ticket < start + cap - sa.MAX_SLOTS:
        k = 1 if rng.random() < 0.97 else rng.randint(2, sa.MAX_SLOTS)
        sizes.append((ticket, k))
        ticket += k
    writing = sizes[len(sizes) * 3 // 4][0]  # this one is reserved, not committed yet
    for t, k in sizes:
        at = layout.record_offset(t) // 8
        words[at + 1] = 7 | k << sa.META_SLOTS_SHIFT
        if t != writing:
            words[at] = sa.COMMIT_TAG | (t + 1)
    words[sa.OFF_HEAD // 8] = ticket
    copy = bytearray(buf)
    want = len(sa.read_records(copy).records)  # the reader's count, on a copy
    assert writing - start > 3000  # past the ring's end
    assert want == sum(1 for t, _ in sizes if t < writing)
    assert sa.skip_records(buf) == want
    assert words[sa.OFF_TAIL // 8] == writing
