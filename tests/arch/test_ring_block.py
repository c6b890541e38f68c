"""The batch reader's view of the ring (ring_block.py) against the per-record reader
(``shared_area.read_records``): two areas fed the same hits by the protocol's Python
producer (test_shared_area.py), one read each way at the same moments, must give the same
records, drops, waiting and tail, through laps of records of random sizes, CPUs and probes,
records left half-written for a while, and limits."""

from __future__ import annotations

import random

import pytest
from test_shared_area import CAP, Producer, make, payload

from kprobes.arch.x86_64 import ring_block
from kprobes.arch.x86_64 import shared_area as sa


def _hit(p: Producer, ticket: int, k: int, i: int, regs: bool, n: int, cpu: int, probe: int):
    p.fill(ticket, k, i, regs=regs, data=payload(i, n), cpu=cpu, probe=probe)
    p.commit(ticket)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_same_records_as_the_per_record_reader(seed: int) -> None:
    capacity = 4 * CAP
    (buf1, _, p1), (buf2, _, p2) = make(capacity), make(capacity)
    rng = random.Random(seed)
    held: list[tuple[int, int, int, bool, int, int, int]] = []  # reserved, not committed
    for i in range(6000):
        n = rng.choice([0, 0, 0, 0, 8, 24, 8, 100, 500])
        regs = rng.random() < 0.1
        k = sa.slots_for(sa.REC_HEADER + (sa.REGS_BLOCK if regs else 0) + n)
        cpu = rng.choice([1, 1, 1, 1, 0, sa.META_CPU_MASK])
        probe = rng.choice([5, 5, 5, 6])
        t1, t2 = p1.reserve(k), p2.reserve(k)
        assert t1 == t2
        if t1 is not None:
            hit = (t1, k, i, regs, n, cpu, probe)
            if rng.random() < 0.01:
                held.append(hit)  # committed later: the readers wait for it
            else:
                _hit(p1, *hit)
                _hit(p2, *hit)
        if held and rng.random() < 0.05:
            hit = held.pop(0)
            _hit(p1, *hit)
            _hit(p2, *hit)
        if rng.random() < 0.03:
            limit = rng.choice([None, 1, 7, 64, 1000])
            batch = sa.read_records(buf1, limit=limit)
            block = ring_block.read_block(buf2, limit=limit)
            assert block.records() == list(batch.records)
            assert (block.dropped, block.pending) == (batch.dropped, batch.pending)
            assert p1.word(sa.OFF_TAIL) == p2.word(sa.OFF_TAIL)
            for run in block.runs:  # each run: one probe, one size, registers or not
                metas = {r.probe for r in block.records((run,))}
                assert metas == {run.probe} and run.count > 0
    assert p1.word(sa.OFF_TAIL) > 10 * capacity  # many laps


def test_a_hot_probes_block_is_one_run_whatever_its_cpus() -> None:
    buf, _, p = make(4 * CAP)
    for i in range(300):
        t = p.reserve(1)
        assert t is not None
        _hit(p, t, 1, i, False, 8, i % 3, 5)
    block = ring_block.read_block(buf)
    assert len(block.runs) == 1 and block.count == 300
    assert [r.cpu for r in block.records()] == [i % 3 for i in range(300)]


class _Counted:
    """The ring's words, counting the words read (a slice's, or one)."""

    def __init__(self, words: memoryview) -> None:
        self.words, self.read = words, 0

    def __getitem__(self, key: int | slice) -> object:
        got = self.words[key]
        self.read += len(got) if isinstance(key, slice) else 1
        return got


def test_a_run_costs_in_proportion_to_its_length() -> None:
    """Records of two slots (a stack walked in the program) have no one-slot run: finding
    that reads a few commit words, not a stretch of 4096 each (~60 µs a record); a run of
    one-slot records is read in stretches that grow with it."""
    capacity = 64 * CAP
    buf, layout, p = make(capacity)
    for i in range(2000):  # 2000 two-slot records
        t = p.reserve(2)
        assert t is not None
        _hit(p, t, 2, i, False, 100, 1, 5)
    for i in range(300):  # then a run of 300 one-slot records, and one of two slots
        t = p.reserve(1)
        assert t is not None
        _hit(p, t, 1, i, False, 8, 1, 6)
    t = p.reserve(2)
    assert t is not None
    _hit(p, t, 2, 0, False, 100, 1, 5)
    head = p.word(sa.OFF_HEAD)
    words = _Counted(memoryview(buf).cast("Q"))
    ring = layout.ring_offset // 8
    for ticket in range(0, 4000, 2):
        assert ring_block._one_slot_run(words, ring, capacity, ticket, head) == (ticket, 0)  # type: ignore[arg-type]
    assert words.read <= 8 * 2000
    words.read = 0
    assert ring_block._one_slot_run(words, ring, capacity, 4000, head) == (4300, 300)  # type: ignore[arg-type]
    assert words.read <= 4 * 300
    block = ring_block.read_block(buf)
    assert [(r.probe, r.count, r.slots) for r in block.runs] == [
        (5, 2000, 2),
        (6, 300, 1),
        (5, 1, 2),
    ]
