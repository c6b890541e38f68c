"""process/fast/columns.py against batch.py's decoder: the same bytes for the same records.

The fast reader reads a run of records of plain values as columns (a thread's line made
once, each microsecond's text once); where it cannot, it hands the records to batch.py's
per-event decoder. Here both decode made blocks of records, over what makes the difference:
threads and CPUs changing (runs long and short, a CPU unknown, a thread pointer unknown),
ticks dense and sparse, out of order, past the clock segment's end, clocks whose float
arithmetic rounds coarsely (an uptime of 100 days) and ticks landing on every side of a
microsecond's edge; and with ``bisect`` made to guess wrong, so that the checks that make
the microseconds exact do the work. tests/test_trace_rows.py does the same on live records.
"""

from __future__ import annotations

import bisect
import random
import struct
from collections.abc import Callable
from typing import Any

import pytest

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import CapturePlan, Reg, Value
from kprobes.output.rows import json_line, text_line
from kprobes.process.fast import columns
from kprobes.process.fast.batch import LineFormat, plan_decoder
from kprobes.process.fast.columns import ColumnDecoder, ColumnFormat
from kprobes.spec import parse

SPECS = {  # every value a register's word cut to a type, or a constant (JSON: no char)
    False: r"p work a=%di:s64 b=%si:u32 c=%dx d=%cx:s8 e=%di:char h=%r8:x16 k=\7 w=%ip"
    " x=%r9:s32 y=%si:u16 z=%dx:s16 q=%cx:x8 r=%r8:u8 v=%r9:x32 u=%di:u64",
    True: r"p work a=%di:s64 b=%si:u32 c=%dx d=%cx:s8 h=%r8:x16 k=\7 w=%ip x=%r9:s32",
}
REGS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
SITE = 0x401126
THREADS = {0x7F00_0000_1000: 101, 0x7F00_0000_2000: 0, 0x7F00_0000_3000: None}  # None: unknown
COMMS = {101: "target", 0: "", 7: 'we"ird{x}', 99: "late"}


def decoders(as_json: bool) -> tuple[Callable[..., Any], Callable[..., Any], int]:
    """batch.py's decoder and columns.py's of ``SPECS[as_json]``, and the records' size."""
    plan = CapturePlan()
    for reg in REGS:
        plan.add(Value(Reg(reg)))
    made = plan_decoder(parse(SPECS[as_json]), (lambda _s: 0, lambda _o: 0), plan, SITE)
    assert made is not None
    comm = lambda tid: COMMS.get(tid, "")  # noqa: E731
    layout = made.layout("kprobes", "p_work_0", 42, comm)
    args = (layout.names, layout.types, layout.plain, layout.comm)
    line = json_line("kprobes/p_work_0", 42, *args) if as_json else text_line("p_work_0", *args)
    assert line is not None and line.template is not None
    t = line.template
    slots = -(-(sa.REC_HEADER + 8 * len(REGS)) // sa.SLOT)
    out = []
    for fmt in (None, ColumnFormat(t.line, t.show, t.stamp)):
        threads = {k: v for k, v in THREADS.items() if v is not None}
        fmt_line = LineFormat(line.expr, line.setup, line.context, line.names, print, "", fmt)
        out.append(
            made.compile(
                fmt_line,
                slots,
                threads,
                lambda tp, threads=threads: threads.setdefault(tp, 99),  # type: ignore[misc]
                lambda tick: (5e9 + tick / 3.0) / 1e9,  # another segment
                comm,
            )
        )
    assert not isinstance(out[0], ColumnDecoder) and isinstance(out[1], ColumnDecoder)
    return out[0], out[1], slots * sa.SLOT


def block(rng: random.Random, n: int, size: int, first: int) -> memoryview:
    """``n`` records from tick ``first``: threads and CPUs in runs, ticks of a few shapes."""
    record = struct.Struct(f"<4Q{len(REGS)}Q{size - sa.REC_HEADER - 8 * len(REGS)}x")
    shape = rng.choice(["dense", "sparse", "mixed", "edges"])
    switch = rng.choice([0.0, 0.01, 0.2])  # how often the thread or CPU changes
    thread, cpu = rng.choice(list(THREADS)), rng.choice([0, 1, sa.META_CPU_MASK])
    tick, data = first, []
    for _ in range(n):
        if rng.random() < switch:
            thread, cpu = rng.choice(list(THREADS)), rng.choice([0, 1, sa.META_CPU_MASK])
        match shape:
            case "dense":
                tick += rng.randrange(0, 40)
            case "sparse":
                tick += rng.randrange(0, 6000)
            case "mixed":
                tick += rng.choice([0, 1, 2, 30, 2400, 9000]) - (rng.random() < 0.01) * 3000
            case _:
                tick += rng.choice([1, 2399, 2400, 2401, 1199, 1200])
        meta = 1 | (size // sa.SLOT) << sa.META_SLOTS_SHIFT | cpu << sa.META_CPU_SHIFT
        values = [rng.getrandbits(64) for _ in REGS]
        data.append(record.pack(sa.COMMIT_TAG, meta, thread, tick, *values))
    return memoryview(b"".join(data))


CLOCKS = [  # (the segment's ns at its start, ticks per ns)
    (83000e9, 2.4),
    (83254.9999995e9, 1.0),
    (8.64e15 + 0.5, 2.4),  # 100 days up: a float's ulp there is 1 ns
    (1e9, 2.9999999),
    (123456.7891e9, 0.7),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_columns_print_what_the_per_event_decoder_prints(as_json: bool) -> None:
    per_event, by_columns, size = decoders(as_json)
    rng = random.Random(21)
    taken = [0]
    piece = ColumnDecoder._piece

    def spy(self: Any, view: Any, n: int, *args: Any) -> Any:
        text = piece(self, view, n, *args)
        taken[0] += text is not None
        return text

    ColumnDecoder._piece = spy  # type: ignore[method-assign]
    try:
        for i in range(300):
            ns, per = CLOCKS[i % len(CLOCKS)]
            start = rng.randrange(10**9, 10**14)
            view = block(rng, rng.choice([1, 15, 16, 17, 300, 1024]), size, start)
            end = rng.choice([float("inf"), start + rng.randrange(0, 10**6)])
            at = (start, ns, per, end, SITE, rng.choice(["work+0x0/0x19", ""]))
            assert by_columns(view, *at) == per_event(view, *at), f"block {i}"
    finally:
        ColumnDecoder._piece = piece  # type: ignore[method-assign]
    assert taken[0] >= 50  # many blocks went the column way


def test_wrong_guesses_of_a_microseconds_end_are_corrected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guess of where a microsecond ends (``bisect_left`` on a tick computed from the
    clock's rate) is only a start: each edge is checked by computing the timestamps there."""
    rng = random.Random(7)
    real = bisect.bisect_left

    def wrong(ticks: list[int], tick: int, lo: int) -> int:
        return min(len(ticks), max(lo, real(ticks, tick, lo) + rng.randrange(-5, 6)))

    monkeypatch.setattr(columns, "bisect_left", wrong)
    per_event, by_columns, size = decoders(False)
    for i in range(100):
        ns, per = CLOCKS[i % len(CLOCKS)]
        start = rng.randrange(10**9, 10**14)
        view = block(rng, 1024, size, start)
        at = (start, ns, per, float("inf"), SITE, "work+0x0/0x19")
        assert by_columns(view, *at) == per_event(view, *at), f"block {i}"
