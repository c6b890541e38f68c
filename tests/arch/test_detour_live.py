"""Detours run for real: tests/programs/detour_harness.c patches one of its own functions with
the jump and the detour built here, calls it from 1 and 4 threads, and the test reads the
shared area (a file both map) while the threads run.

Checked: the function's results never change (the harness checks each call), the count is
exact, records + drops = calls, every record is complete and consistent with the call's
arguments (rdi = i, rsi = ~i, rdx = 3i, rcx = the thread's index), in order per thread, and
a small ring under four writers and a concurrent reader drops hits but never tears a record.
"""

from __future__ import annotations

import mmap
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from elf_bytes import Function, functions, symbols

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.detour import (
    Action,
    CountAction,
    FlagsSave,
    RecordAction,
    ThreadId,
    build_detour,
)
from kprobes.arch.x86_64.jumpopt import Region, find_region

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "programs" / "detour_harness.c"
MASK = (1 << 64) - 1
AT_HWCAP2 = 26
HWCAP2_FSGSBASE = 1 << 1
PROBE_ID = 42


def has_fsgsbase() -> bool:
    """Whether the kernel lets user space use rdfsbase (AT_HWCAP2, Linux 5.9+)."""
    auxv = Path("/proc/self/auxv").read_bytes()
    for key, value in struct.iter_unpack("<QQ", auxv):
        if key == AT_HWCAP2:
            return bool(value & HWCAP2_FSGSBASE)
    return False


THREAD_IDS = [ThreadId.FS0, *([ThreadId.FSBASE] if has_fsgsbase() else [])]


# Where each function of the harness is probed: its entry, or a label inside.
PROBE_SYMBOL = {"work": "work", "work_fp": "work_fp", "work_flags": "work_flags_probe"}
ARITH_FLAGS = 0x8D5  # OF SF ZF AF PF CF


@dataclass(frozen=True, slots=True)
class Harness:
    exe: Path
    funcs: dict[str, Function]
    symbols: dict[str, int]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    exe = tmp_path_factory.mktemp("detour") / "detour_harness"
    flags = ["-O1", "-g", "-Wall", "-pthread", "-fcf-protection=branch"]
    subprocess.run(["gcc", *flags, "-o", str(exe), str(SOURCE)], check=True, timeout=60)
    return Harness(exe, functions(exe), symbols(exe))


@dataclass
class Run:
    proc: subprocess.Popen[str]
    func: int
    probe: int
    page: int
    area: int
    region: Region


@pytest.fixture
def area_file(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "area"


def create_area(path: Path, layout: sa.AreaLayout) -> mmap.mmap:
    with path.open("wb") as f:
        f.truncate(layout.size)
    with path.open("r+b") as f:
        mm = mmap.mmap(f.fileno(), layout.size)
    sa.init_area(memoryview(mm), layout)
    return mm


def launch(h: Harness, func: str, area: Path, threads: int, calls: int, *extra: str) -> Run:
    proc = subprocess.Popen(
        [str(h.exe), func, str(area), str(threads), str(calls), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[0::2] == ["func", "page", "area"], words
    fn, page, base = (int(w, 16) for w in words[1::2])
    f = h.funcs[func]
    probe = fn + h.symbols[PROBE_SYMBOL[func]] - f.addr
    region = find_region(f.code, fn, probe, f.size)
    assert isinstance(region, Region), region
    return Run(proc, fn, probe, page, base, region)


def install(run: Run, action: Action, flags: FlagsSave = FlagsSave.LAHF) -> None:
    detour = build_detour(run.page, run.region, action, flags=flags)
    assert run.proc.stdin is not None
    offset = run.probe - run.func
    run.proc.stdin.write(f"{detour.code.hex()}\n{offset:x} {detour.patch.hex()}\n")
    run.proc.stdin.close()


def finish(run: Run) -> dict[int, int]:
    """Wait for the harness; the fs base of each of its threads, by index."""
    assert run.proc.stdout is not None
    out = run.proc.stdout.read()
    assert run.proc.wait(timeout=60) == 0, out
    lines = out.splitlines()
    assert lines[-1] == "ok", out
    threads = {}
    for line in lines[:-1]:
        _, index, fsbase = line.split()
        threads[int(index)] = int(fsbase, 16)
    return threads


def drain(run: Run, mm: mmap.mmap, *, spin: bool = False) -> tuple[list[sa.Record], int]:
    """Read the ring while the harness runs, then what is left: (records, drops). With
    ``spin`` the reader never sleeps, to meet the writers inside their records."""
    view = memoryview(mm)
    records: list[sa.Record] = []
    dropped = 0
    while run.proc.poll() is None:
        batch = sa.read_records(view)
        records += batch.records
        dropped += batch.dropped
        if not batch.records and not spin:
            time.sleep(0.0002)
    while True:
        batch = sa.read_records(view)
        records += batch.records
        dropped += batch.dropped
        if not batch.records:
            assert not batch.pending
            return records, dropped


def add_flags(x: int) -> int:
    """OF SF ZF AF PF CF after ``add x, x`` (64-bit)."""
    total = x + x
    r = total & MASK
    cf, zf, sf = total >> 64, r == 0, r >> 63
    of = (x >> 63) != sf
    pf = bin(r & 0xFF).count("1") % 2 == 0
    af = ((x ^ x ^ r) >> 4) & 1
    return cf | pf << 2 | af << 4 | zf << 6 | sf << 7 | of << 11


def check_records(
    records: list[sa.Record], run: Run, threads: dict[int, int], calls: int
) -> dict[int, list[int]]:
    """Every record consistent with its call; the calls' i per thread, in ticket order."""
    by_thread: dict[int, list[int]] = {t: [] for t in threads}
    fsbase_index = {fs: t for t, fs in threads.items()}
    tickets = [r.ticket for r in records]
    assert tickets == sorted(tickets) and len(set(tickets)) == len(tickets)
    for r in records:
        i = r.rdi
        assert 0 <= i < calls
        assert (r.probe, r.rip) == (PROBE_ID, run.probe)
        assert r.rsi == ~i & MASK and r.rdx == 3 * i
        thread = fsbase_index[r.thread]
        if run.probe == run.func:
            assert r.rcx == thread  # the thread's index, passed as t
            assert r.rsp % 16 == 8  # just after a call
        else:  # work_flags, after `mov rcx, rdi; shl rcx, 62; add rcx, rcx`
            assert r.rcx == (i << 63) & MASK
            assert r.eflags & ARITH_FLAGS == add_flags((i << 62) & MASK)
        assert r.eflags & 0x2  # the reserved bit, always set
        assert r.tsc != 0
        assert len(r.extra) == sa.RECORD_SIZE - sa.RECORD_FIXED
        by_thread[thread].append(i)
    for calls_seen in by_thread.values():
        assert calls_seen == sorted(set(calls_seen))  # in order, none twice
    return by_thread


FUNCS = ["work", "work_fp", "work_flags"]


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize(
    ("threads", "locked", "flags"),
    [(1, True, FlagsSave.LAHF), (4, True, FlagsSave.LAHF), (1, False, FlagsSave.LAHF),
     (4, True, FlagsSave.PUSHF)],
    ids=["1-locked", "4-locked", "1-unlocked", "4-locked-pushf"],
)  # fmt: skip
def test_count(
    harness: Harness, area_file: Path, func: str, threads: int, locked: bool, flags: FlagsSave
) -> None:
    layout = sa.AreaLayout(ncounters=4, capacity=16)
    mm = create_area(area_file, layout)
    calls = 200_000
    run = launch(harness, func, area_file, threads, calls)
    install(run, CountAction(run.area + layout.counter_offset(2), locked=locked), flags)
    finish(run)
    view = memoryview(mm)
    assert sa.read_counter(view, 2) == threads * calls
    assert [sa.read_counter(view, i) for i in (0, 1, 3)] == [0, 0, 0]


@pytest.mark.parametrize("thread_id", THREAD_IDS, ids=lambda t: t.name)
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("threads", [1, 4])
def test_record_every_call(
    harness: Harness, area_file: Path, func: str, threads: int, thread_id: ThreadId
) -> None:
    calls = 20_000
    layout = sa.AreaLayout(ncounters=0, capacity=1 << 17)  # room for every call
    mm = create_area(area_file, layout)
    run = launch(harness, func, area_file, threads, calls)
    flags = FlagsSave.PUSHF if thread_id is ThreadId.FS0 else FlagsSave.LAHF
    install(run, RecordAction(PROBE_ID, layout.ring_at(run.area), thread_id), flags)
    records, dropped = drain(run, mm)
    fsbases = finish(run)
    assert dropped == 0 and len(records) == threads * calls
    by_thread = check_records(records, run, fsbases, calls)
    assert all(seen == list(range(calls)) for seen in by_thread.values())


@pytest.mark.parametrize("pace", [0, 3000])
def test_small_ring_drops_never_tears(harness: Harness, area_file: Path, pace: int) -> None:
    # pace 0: the writers outrun the reader and drop; pace 3000: the reader keeps up at times
    # and reads records right behind their writers.
    calls, threads = (200_000, 4) if pace == 0 else (250_000, 4)
    layout = sa.AreaLayout(ncounters=0, capacity=16)
    mm = create_area(area_file, layout)
    run = launch(harness, "work", area_file, threads, calls, f"pace={pace}")
    thread_id = THREAD_IDS[-1]
    install(run, RecordAction(PROBE_ID, layout.ring_at(run.area), thread_id))
    records, dropped = drain(run, mm, spin=True)
    fsbases = finish(run)
    assert len(records) + dropped == threads * calls
    assert dropped > 0 and len(records) > 0
    check_records(records, run, fsbases, calls)
    # The header's own account agrees: every ticket taken was read.
    words = memoryview(mm).cast("Q")
    assert words[sa.OFF_HEAD // 8] == words[sa.OFF_TAIL // 8] == len(records)
    assert words[sa.OFF_DROPS // 8] == dropped
