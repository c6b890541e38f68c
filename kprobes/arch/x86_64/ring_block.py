"""The ring read as one block of bytes: the batch reader's side of the shared area.

``shared_area.read_records`` copies each record into a ``Record`` of its own, which is what a
Python handler wants and costs a microsecond a record. A reader that formats whole batches
(process/fast/batch.py) wants the records as they lie in the ring instead: ``read_block``
finds the committed records from the tail (a run of one-slot records by comparing whole
stretches of commit words, as ``skip_records`` does; larger records one by one), copies them
with one or two slices (the ring wraps once at most), releases them, and says how they are
laid out: ``runs`` of consecutive records alike (one probe, one size, registers or not), each
a contiguous stretch of the block that ``struct.iter_unpack`` reads in one call.

The protocol (commit words, the tail stored after the copy, drops) is shared_area.py's, and
``Block.records()`` turns a block into the same ``Record`` values ``read_records`` returns,
for the records the batch path leaves to the handlers.
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Iterable
from typing import Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.errors import InternalError
from kprobes.values import dataclass

# A record's kind, from its meta word: the probe, the slots and the registers bit (the CPU
# bits cleared).
KIND_MASK: Final = ~(sa.META_CPU_MASK << sa.META_CPU_SHIFT) & ((1 << 64) - 1)


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive records of one kind (``meta``, its CPU bits cleared), from
    byte ``start`` of the block, ``slots`` slots each."""

    meta: int
    start: int
    count: int
    slots: int

    @property
    def probe(self) -> int:
        return self.meta & 0xFFFF_FFFF

    @property
    def has_regs(self) -> bool:
        return bool(self.meta & sa.META_REGS)

    @property
    def end(self) -> int:
        return self.start + self.count * self.slots * sa.SLOT


@dataclass(frozen=True, slots=True)
class Block:
    """What one read returns: the records back to back from ticket ``first``, how they are
    laid out, the drops since the last read, and ``pending`` (as ``Batch.pending``)."""

    data: bytes
    first: int
    runs: tuple[Run, ...]
    dropped: int
    pending: bool

    @property
    def count(self) -> int:
        return sum(run.count for run in self.runs)

    def records(self, runs: tuple[Run, ...] | None = None) -> list[sa.Record]:
        """The records of ``runs`` (all of them by default) as ``read_records`` gives them."""
        out = []
        data = self.data
        for run in self.runs if runs is None else runs:
            size = run.slots * sa.SLOT
            ticket = self.first + run.start // sa.SLOT
            for at in range(run.start, run.end, size):
                out.append(sa.decode_record(ticket, data[at : at + size]))
                ticket += run.slots
        return out


def read_block(buffer: memoryview | bytearray, *, limit: int | None = None) -> Block:
    """The complete records written since the last read (at most ``limit``), and the drops,
    as one block; they are released. Never returns a record that is not fully written."""
    layout = sa.layout_of(buffer)
    mv = memoryview(buffer).cast("B")
    words = mv.cast("Q")
    cap, ring = layout.capacity, layout.ring_offset
    tail = int(words[sa.OFF_TAIL // 8])
    head = int(words[sa.OFF_HEAD // 8])
    most = cap if limit is None else min(limit, cap)
    # Step 1: find the committed records, in ticket order, and the slots of each.
    sizes: list[int] = []
    ticket = tail
    while len(sizes) < most:
        bound = min(head, ticket + most - len(sizes))
        ticket, n = _one_slot_run(words, ring // 8, cap, ticket, bound)
        sizes += itertools.repeat(1, n)
        if len(sizes) >= most:
            break
        index = (ring + (ticket & (cap - 1)) * sa.SLOT) // 8
        if words[index] != sa.COMMIT_TAG | (ticket + 1):
            break
        k = (int(words[index + 1]) >> sa.META_SLOTS_SHIFT) & 0xFFFF
        if not 0 < k <= sa.MAX_SLOTS:
            raise InternalError(f"record {ticket} says it takes {k} slots")
        sizes.append(k)
        ticket += k
    # Step 2: copy them (two pieces where the ring wraps), then release them.
    start = ring + (tail & (cap - 1)) * sa.SLOT
    nbytes = (ticket - tail) * sa.SLOT
    upto = min(nbytes, ring + cap * sa.SLOT - start)
    data = bytes(mv[start : start + upto])
    if upto < nbytes:
        data += bytes(mv[ring : ring + nbytes - upto])
    pending = words[sa.OFF_HEAD // 8] > ticket
    words[sa.OFF_TAIL // 8] = ticket
    drops = int(words[sa.OFF_DROPS // 8])
    dropped = drops - int(words[sa.OFF_DROPS_READ // 8])
    words[sa.OFF_DROPS_READ // 8] = drops
    words.release()
    mv.release()
    return Block(data, tail, _runs(data, sizes), dropped, pending)


def runs_of(data: bytes, *, cut: bool = False) -> tuple[Run, ...]:
    """The runs of a block's bytes read back (a record file's): each record's size from its
    meta word, all at once where every record is one slot. InternalError if they do not
    tile the bytes; with ``cut`` (the bytes end in the middle of a record), the runs of the
    whole records before it."""
    n = len(data) // sa.SLOT
    if len(data) % sa.SLOT and not cut:
        raise InternalError(f"{len(data)} bytes are not a whole number of slots")
    words = memoryview(data)[: n * sa.SLOT].cast("Q")
    metas = words[1 :: sa.SLOT // 8].tobytes()
    words.release()
    lanes = metas[4::8] + metas[5::8]  # the slots field's two bytes of every meta word
    if lanes == b"\x01" * n + b"\x00" * n:
        return _runs(data[: n * sa.SLOT], [1] * n)
    sizes = []
    at = 0
    while at < n:
        k = (int.from_bytes(data[at * sa.SLOT + 8 : at * sa.SLOT + 16], "little") >> 32) & 0xFFFF
        if not 0 < k <= sa.MAX_SLOTS:
            raise InternalError(f"a record says it takes {k} slots")
        if at + k > n:
            if cut:
                break
            raise InternalError(f"a record of {k} slots is cut short")
        sizes.append(k)
        at += k
    return _runs(data[: at * sa.SLOT], sizes)


def _one_slot_run(
    words: memoryview, ring: int, cap: int, ticket: int, head: int
) -> tuple[int, int]:
    """``shared_area._skip_one_slot_run`` with a stretch of commit words compared at once:
    read as one integer (8-byte words, little-endian) against ``low * ONES + STEPS``, the
    words ``low, low + 1, ...`` packed the same way (no Python int per slot). The same rule:
    a slot followed by the next ticket's commit word is a one-slot record; the run's last
    slot is left to the caller. Returns (the ticket after the run, records in it).

    The stretches grow from 8 slots to 4096, doubling while they match, so that a run costs
    in proportion to its length: records of two slots or more (a stack walked in the
    program) have no run, and a first stretch of 4096 cost ~60 µs each of them."""
    start = ticket
    stride = sa.SLOT // 8
    span = _FIRST_STRETCH
    while head - ticket > 1:
        index = ticket & (cap - 1)
        n = min(head - ticket, cap - index, span)  # a stretch, to the ring's end at most
        span = min(span * 2, _LAST_STRETCH)
        first = ring + index * stride
        low = sa.COMMIT_TAG + ticket + 1
        if n > 1 and words[first + stride] != low + 1:
            break  # the next slot holds no commit word: no run here (a larger record)
        found = words[first : first + n * stride : stride].tobytes()
        ones, steps = _progression(n)
        if int.from_bytes(found, "little") == low * ones + steps:
            ticket += n - 1  # the last: the caller, or the next stretch, looks at it again
            if index + n < cap:
                continue
            ticket += 1  # the ring's last slot: the next stretch starts with its successor
            if words[ring] == sa.COMMIT_TAG + ticket + 1:
                continue
            ticket -= 1
            break
        want = array.array("Q", range(low, low + n)).tobytes()
        matched = next(i for i in range(n) if found[8 * i : 8 * i + 8] != want[8 * i : 8 * i + 8])
        ticket += max(matched - 1, 0)
        break
    return ticket, ticket - start


_FIRST_STRETCH: Final = 8
_LAST_STRETCH: Final = 4096


@functools.lru_cache(maxsize=64)
def _progression(n: int) -> tuple[int, int]:
    """``n`` 8-byte words read as one little-endian integer: all ones, and 0, 1, 2, ...;
    ``low * ONES + STEPS`` is then ``low, low + 1, ...`` (no carry: each word < 2**64)."""
    ones = int.from_bytes(array.array("Q", [1] * n).tobytes(), "little")
    return ones, int.from_bytes(array.array("Q", range(n)).tobytes(), "little")


def _runs(data: bytes, sizes: list[int]) -> tuple[Run, ...]:
    """The block's records grouped into runs of one kind."""
    if not sizes:
        return ()
    words = memoryview(data).cast("Q")
    stride = sa.SLOT // 8
    if len(sizes) * sa.SLOT == len(data):  # every record one slot: their meta words at once
        metas = words[1::stride]
        if _is_one_kind(metas.tobytes()):  # the common case, a hot probe's block: one run
            meta = metas[0] & KIND_MASK
            words.release()
            return (Run(meta, 0, len(sizes), (meta >> sa.META_SLOTS_SHIFT) & 0xFFFF),)
        kinds: Iterable[int] = map(KIND_MASK.__and__, metas.tolist())
    else:
        starts = itertools.accumulate(sizes[:-1], initial=0)
        kinds = (words[s * stride + 1] & KIND_MASK for s in starts)
    runs = []
    at = 0
    for meta, group in itertools.groupby(kinds):
        count = len(list(group))
        slots = (meta >> sa.META_SLOTS_SHIFT) & 0xFFFF
        runs.append(Run(meta, at, count, slots))
        at += count * slots * sa.SLOT
    words.release()
    if at != len(data):
        raise InternalError("the records' sizes do not add up to the block they were read in")
    return tuple(runs)


_TOP_BIT: Final = bytes(b & 0x80 for b in range(256))


def _is_one_kind(metas: bytes) -> bool:
    """Whether the packed meta words ``metas`` all say one probe, one size and registers or
    not (their CPUs may differ): each byte of a kind's bits compared across the words."""
    if metas == metas[:8] * (len(metas) // 8):  # one CPU too: one comparison
        return True
    for lane in range(6):  # the probe id and the slots: bytes 0-5
        column = metas[lane::8]
        if column.count(column[:1]) != len(column):
            return False
    top = metas[7::8].translate(_TOP_BIT)  # the registers bit, beside the CPU's top bits
    return top.count(top[:1]) == len(top)
