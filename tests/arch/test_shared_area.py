"""The shared area's layout and its reader, against a producer written in Python that follows
the detour's protocol step by step (reserve, fill, commit), so that every interleaving the
reader must survive can be set up exactly: a record reserved but not committed, a stale
record of the previous lap, a full ring."""

from __future__ import annotations

import struct

import pytest

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.errors import InternalError

MASK = (1 << 64) - 1


class Producer:
    """The record action's protocol, in Python, on a bytearray area."""

    def __init__(self, buf: bytearray, layout: sa.AreaLayout) -> None:
        self.buf, self.layout = buf, layout

    def word(self, offset: int) -> int:
        return int(struct.unpack_from("<Q", self.buf, offset)[0])

    def set_word(self, offset: int, value: int) -> None:
        struct.pack_into("<Q", self.buf, offset, value & MASK)

    def reserve(self) -> int | None:
        head, tail = self.word(sa.OFF_HEAD), self.word(sa.OFF_TAIL)
        if head - tail >= self.layout.capacity:
            self.set_word(sa.OFF_DROPS, self.word(sa.OFF_DROPS) + 1)
            return None
        self.set_word(sa.OFF_HEAD, head + 1)
        return head

    def fill(self, ticket: int, i: int, *, probe: int = 5, thread: int = 0x7F00) -> None:
        rec = self.layout.record_offset(ticket)
        self.set_word(rec + sa.REC_PROBE, probe)
        self.set_word(rec + sa.REC_THREAD, thread)
        self.set_word(rec + sa.REC_TSC, 1000 + i)
        self.set_word(rec + sa.REC_RIP, 0x401000)
        self.set_word(rec + sa.REC_EFLAGS, 0x246)
        self.set_word(rec + sa.REC_RSP, 0x7FFC_0000 - 8 * i)
        for k, name in enumerate(sa.GPR_ORDER):
            self.set_word(rec + sa.rec_gpr(name), i * 100 + k)
        self.buf[rec + sa.RECORD_FIXED : rec + self.layout.record_size] = bytes([i & 0xFF]) * (
            self.layout.record_size - sa.RECORD_FIXED
        )

    def commit(self, ticket: int) -> None:
        self.set_word(self.layout.record_offset(ticket) + sa.REC_COMMIT, ticket + 1)

    def hit(self, i: int) -> int | None:
        ticket = self.reserve()
        if ticket is not None:
            self.fill(ticket, i)
            self.commit(ticket)
        return ticket


def make(capacity: int = 8, ncounters: int = 3) -> tuple[bytearray, sa.AreaLayout, Producer]:
    layout = sa.AreaLayout(ncounters, capacity)
    buf = bytearray(layout.size)
    sa.init_area(buf, layout)
    return buf, layout, Producer(buf, layout)


def calls(batch: sa.Batch) -> list[int]:
    return [r.tsc - 1000 for r in batch.records]


# ---- layout -----------------------------------------------------------------------------------


def test_layout() -> None:
    layout = sa.AreaLayout(ncounters=3, capacity=8)
    assert layout.counters_offset == 4096
    assert [layout.counter_offset(i) for i in range(3)] == [4096, 4160, 4224]
    assert layout.ring_offset == 8192
    assert layout.size == 8192 + 4096  # 8 records of 192 bytes, rounded to a page
    assert layout.record_offset(0) == layout.record_offset(8) == 8192
    assert layout.record_offset(3) == 8192 + 3 * 192
    ring = layout.ring_at(0x7F00_0000_0000)
    assert (ring.head, ring.tail, ring.drops) == (
        0x7F00_0000_0040,
        0x7F00_0000_0080,
        0x7F00_0000_00C0,
    )
    assert ring.ring == 0x7F00_0000_2000 and (ring.capacity, ring.record_size) == (8, 192)
    assert sa.AreaLayout(0, 1).ring_offset == 4096
    assert sa.AreaLayout(64, 2).ring_offset == 8192
    assert sa.AreaLayout(65, 2).ring_offset == 12288


def test_record_fields() -> None:
    assert sa.RECORD_FIXED == 176 and sa.RECORD_SIZE == 192
    assert [sa.rec_gpr(r) for r in ("r15", "rax", "rdi")] == [56, 136, 168]
    # the fixed fields and sa.Record's fields, in one order
    assert list(sa.Record.__dataclass_fields__)[7:22] == list(sa.GPR_ORDER)


@pytest.mark.parametrize(
    ("capacity", "record_size", "ncounters"),
    [(0, 192, 0), (12, 192, 0), (8, 100, 0), (8, 200, 0), (8, 192, -1)],
)
def test_bad_layouts(capacity: int, record_size: int, ncounters: int) -> None:
    with pytest.raises(InternalError):
        sa.AreaLayout(ncounters, capacity, record_size)


def test_header_round_trip_and_bad_magic() -> None:
    buf, layout, _ = make()
    assert sa.layout_of(buf) == layout
    with pytest.raises(InternalError, match="not a kprobes shared area"):
        sa.read_records(bytearray(layout.size))
    with pytest.raises(InternalError):
        sa.init_area(bytearray(100), layout)
    with pytest.raises(InternalError, match="does not match"):
        sa.layout_of(buf[: layout.size - 4096])


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


def test_records_in_order_with_their_fields() -> None:
    buf, _, p = make()
    for i in range(5):
        p.hit(i)
    batch = sa.read_records(memoryview(buf))
    assert calls(batch) == [0, 1, 2, 3, 4] and batch.dropped == 0 and not batch.pending
    r = batch.records[2]
    assert (r.ticket, r.probe, r.thread, r.rip, r.eflags, r.rsp) == (
        2, 5, 0x7F00, 0x401000, 0x246, 0x7FFC_0000 - 16,
    )  # fmt: skip
    assert (r.r15, r.rbp, r.rax, r.rdi) == (200, 204, 210, 214)
    assert r.extra == b"\x02" * 16
    assert p.word(sa.OFF_TAIL) == 5
    assert sa.read_records(buf).records == ()  # released: not read twice


def test_stops_at_a_record_being_written() -> None:
    buf, _, p = make()
    p.hit(0)
    t1 = p.reserve()  # reserved, being written
    assert t1 == 1
    p.hit(2)  # a later writer finished first
    batch = sa.read_records(buf)
    assert calls(batch) == [0] and batch.pending
    p.fill(t1, 1)
    assert sa.read_records(buf) == sa.Batch((), 0, True)  # filled, not yet committed
    p.commit(t1)
    batch = sa.read_records(buf)
    assert calls(batch) == [1, 2] and not batch.pending


def test_full_ring_drops_and_reports_them_once() -> None:
    buf, _, p = make(capacity=4)
    tickets = [p.hit(i) for i in range(7)]
    assert tickets == [0, 1, 2, 3, None, None, None]
    batch = sa.read_records(buf)
    assert calls(batch) == [0, 1, 2, 3] and batch.dropped == 3
    assert [p.hit(i) for i in range(10, 12)] == [4, 5]
    batch = sa.read_records(buf)
    assert calls(batch) == [10, 11] and batch.dropped == 0
    assert p.word(sa.OFF_DROPS) == 3


def test_stale_record_of_the_previous_lap_is_not_read() -> None:
    buf, _, p = make(capacity=4)
    for i in range(4):
        p.hit(i)
    assert calls(sa.read_records(buf)) == [0, 1, 2, 3]
    # ticket 4 reuses slot 0, which still holds ticket 0's committed record
    t = p.reserve()
    assert t == 4
    p.fill(t, 40)  # even filled: its commit word still says ticket 0
    assert sa.read_records(buf) == sa.Batch((), 0, True)
    p.commit(t)
    assert calls(sa.read_records(buf)) == [40]


def test_limit() -> None:
    buf, _, p = make(capacity=8)
    for i in range(6):
        p.hit(i)
    batch = sa.read_records(buf, limit=4)
    assert calls(batch) == [0, 1, 2, 3] and batch.pending
    assert calls(sa.read_records(buf, limit=4)) == [4, 5]


def test_wraps_many_laps() -> None:
    buf, _, p = make(capacity=4)
    seen: list[int] = []
    dropped = 0
    for i in range(1000):
        p.hit(i)
        if i % 7 == 0:
            batch = sa.read_records(buf)
            seen += calls(batch)
            dropped += batch.dropped
    batch = sa.read_records(buf)
    seen += calls(batch)
    dropped += batch.dropped
    assert seen == sorted(seen) and len(seen) + dropped == 1000
    assert [r.ticket for r in batch.records] == list(
        range(len(seen) - len(batch.records), len(seen))
    )


def test_works_on_an_mmap() -> None:
    import mmap

    layout = sa.AreaLayout(1, 4)
    mm = mmap.mmap(-1, layout.size)
    sa.init_area(memoryview(mm), layout)
    p = Producer(bytearray(mm[:]), layout)
    p.hit(9)
    mm[:] = bytes(p.buf)
    assert calls(sa.read_records(memoryview(mm))) == [9]
    assert struct.unpack_from("<Q", mm, sa.OFF_TAIL)[0] == 1
