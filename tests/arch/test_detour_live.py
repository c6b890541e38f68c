"""Detours run for real: tests/programs/detour_harness.c patches one of its own functions with
the jump and the detour built here, calls it from 1 and 4 threads, and the test reads the
shared area (a file both map; the harness maps the ring's first bytes again after its end,
as the tool has the program do) while the threads run.

Checked: the function's results never change (the harness checks each call), the count is
exact, records + drops = calls, every record is complete and consistent with the call's
arguments (rdi = i, rsi = ~i, rdx = 3i, rcx = the thread's index), in order per thread, names
its thread by the fs base the thread reports (pthread_self()) and its CPU by the one the
thread was pinned to; records without the registers are one slot; and a small ring under four
writers and a concurrent reader, with records that run past its end, drops hits but never
tears a record.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from elf_bytes import Function, functions, symbols
from iced_x86 import Decoder, Mnemonic, Register
from support import cpu_flags

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.abi import FETCH_FAULT_MAGIC
from kprobes.arch.x86_64.detour import Action, CountAction, FlagsSave, build_detour
from kprobes.arch.x86_64.jumpopt import Region, find_region
from kprobes.arch.x86_64.record import CpuId, RecordAction, ThreadId
from kprobes.arch.x86_64.regs import REG_INDEX, REGS_SIZE
from kprobes.linux import ptrace

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
CPU_IDS = [
    *([CpuId.RDPID] if "rdpid" in cpu_flags() else []),
    *([CpuId.RDTSCP] if "rdtscp" in cpu_flags() else []),
]
BEST_CPU_ID = CPU_IDS[0] if CPU_IDS else CpuId.NONE


# Where each function of the harness is probed: its entry, or a label inside.
PROBE_SYMBOL = {
    "work": "work",
    "work_fp": "work_fp",
    "work_flags": "work_flags_probe",
    "inspect": "inspect",
}
ARITH_FLAGS = 0x8D5  # OF SF ZF AF PF CF


@dataclass(frozen=True, slots=True)
class Harness:
    exe: Path
    funcs: dict[str, Function]
    symbols: dict[str, int]


def build_harness(out: Path) -> Harness:
    exe = out / "detour_harness"
    flags = ["-O1", "-g", "-Wall", "-Werror", "-pthread", "-fcf-protection=branch"]
    subprocess.run(["gcc", *flags, "-o", str(exe), str(SOURCE)], check=True, timeout=60)
    return Harness(exe, functions(exe), symbols(exe))


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return build_harness(tmp_path_factory.mktemp("detour"))


@dataclass
class Run:
    proc: subprocess.Popen[str]
    func: int
    probe: int
    page: int
    area: int
    region: Region
    addrs: dict[str, int]  # what the harness's first line names: gap, bus, bias


@dataclass(frozen=True, slots=True)
class Worker:
    """One of the harness's threads, as it reported itself."""

    fsbase: int
    cpu: int  # pinned to; -1 if not pinned
    addrs: dict[str, int]  # edge, outer, inner, str, name


@dataclass(frozen=True, slots=True)
class Finished:
    workers: dict[int, Worker]
    fixups: int

    @property
    def fsbases(self) -> dict[int, int]:
        return {t: w.fsbase for t, w in self.workers.items()}


@dataclass
class Area:
    """A shared area as the tool makes one: a memfd (shmem, not a file on a disk, whose pages
    would fault in through the filesystem), and the tool's mapping of it: the file once, no
    mirror. The harness opens it as /proc/self/fd/FD, the descriptor passed to it."""

    fd: int
    layout: sa.AreaLayout
    mm: mmap.mmap

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    @property
    def view(self) -> memoryview:
        return memoryview(self.mm)


def create_area(layout: sa.AreaLayout) -> Area:
    fd = os.memfd_create("detour-area")
    os.ftruncate(fd, layout.size)
    area = Area(fd, layout, mmap.mmap(fd, layout.size))
    sa.init_area(area.view, layout)
    return area


@pytest.fixture
def new_area() -> Iterator[Callable[[sa.AreaLayout], Area]]:
    made: list[Area] = []

    def make(layout: sa.AreaLayout) -> Area:
        made.append(create_area(layout))
        return made[-1]

    yield make
    for area in made:
        os.close(area.fd)


def launch(h: Harness, func: str, area: Area, threads: int, calls: int, *extra: str) -> Run:
    options = [f"mirror={sa.MIRROR}", f"magic={FETCH_FAULT_MAGIC:x}", *extra]
    proc = subprocess.Popen(
        [str(h.exe), func, area.path, str(threads), str(calls), *options],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(area.fd,),
    )
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[0::2] == ["func", "page", "area", "gap", "bus", "bias"], words
    addrs = {k: int(v, 16) for k, v in zip(words[0::2], words[1::2], strict=True)}
    fn = addrs["func"]
    f = h.funcs[func]
    probe = fn + h.symbols[PROBE_SYMBOL[func]] - f.addr
    region = find_region(f.code, fn, probe, f.size)
    assert isinstance(region, Region), region
    return Run(proc, fn, probe, addrs["page"], addrs["area"], region, addrs)


def install(run: Run, action: Action, flags: FlagsSave = FlagsSave.LAHF) -> None:
    detour = build_detour(run.page, run.region, action, flags=flags)
    assert run.proc.stdin is not None
    offset = run.probe - run.func
    run.proc.stdin.write(f"{detour.code.hex()}\n{offset:x} {detour.patch.hex()}\n")
    run.proc.stdin.close()


def finish(run: Run) -> Finished:
    """Wait for the harness; its threads as they reported themselves, and its fixups."""
    assert run.proc.stdout is not None
    out = run.proc.stdout.read()
    assert run.proc.wait(timeout=60) == 0, out
    lines = out.splitlines()
    assert lines[-1] == "ok", out
    workers = {}
    for line in lines[:-2]:
        what, index, fsbase, *rest = line.split()
        assert what == "thread", line
        fields = dict(kv.split("=") for kv in rest)
        cpu = int(fields.pop("cpu"))
        addrs = {k: int(v, 16) for k, v in fields.items()}
        workers[int(index)] = Worker(int(fsbase, 16), cpu, addrs)
    what, fixups = lines[-2].split()
    assert what == "fixups", out
    return Finished(workers, int(fixups))


def drain(run: Run, area: Area, *, spin: bool = False) -> tuple[list[sa.Record], int]:
    """Read the ring while the harness runs, then what is left: (records, drops). With
    ``spin`` the reader never sleeps, to meet the writers inside their records."""
    view = area.view
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
    records: list[sa.Record], run: Run, fsbases: dict[int, int], calls: int
) -> dict[int, list[int]]:
    """Every record consistent with its call; the calls' i per thread, in ticket order."""
    by_thread: dict[int, list[int]] = {t: [] for t in fsbases}
    fsbase_index = {fs: t for t, fs in fsbases.items()}
    tickets = [r.ticket for r in records]
    assert tickets == sorted(tickets) and len(set(tickets)) == len(tickets)
    for r in records:
        i = r.reg("rdi")
        assert 0 <= i < calls
        assert (r.probe, r.reg("rip")) == (PROBE_ID, run.probe)
        assert r.reg("rsi") == ~i & MASK and r.reg("rdx") == 3 * i
        thread = fsbase_index[r.thread]
        if run.probe == run.func:
            assert r.reg("rcx") == thread  # the thread's index, passed as t
            assert r.reg("rsp") % 16 == 8  # just after a call
        else:  # work_flags, after `mov rcx, rdi; shl rcx, 62; add rcx, rcx`
            assert r.reg("rcx") == (i << 63) & MASK
            assert r.reg("eflags") & ARITH_FLAGS == add_flags((i << 62) & MASK)
        assert r.reg("eflags") & 0x2  # the reserved bit, always set
        assert r.tsc != 0
        assert 0 <= r.cpu < os.cpu_count()  # type: ignore[operator]
        assert len(r.data) == 3 * sa.SLOT - sa.REC_HEADER - sa.REGS_BLOCK  # no captures
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
    harness: Harness,
    new_area: Callable[[sa.AreaLayout], Area],
    func: str,
    threads: int,
    locked: bool,
    flags: FlagsSave,
) -> None:
    layout = sa.AreaLayout(ncounters=4, capacity=128)
    area = new_area(layout)
    calls = 200_000
    run = launch(harness, func, area, threads, calls)
    install(run, CountAction(run.area + layout.counter_offset(2), locked=locked), flags)
    finish(run)
    view = area.view
    assert sa.read_counter(view, 2) == threads * calls
    assert [sa.read_counter(view, i) for i in (0, 1, 3)] == [0, 0, 0]


@pytest.mark.parametrize("thread_id", THREAD_IDS, ids=lambda t: t.name)
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("threads", [1, 4])
def test_record_every_call(
    harness: Harness,
    new_area: Callable[[sa.AreaLayout], Area],
    func: str,
    threads: int,
    thread_id: ThreadId,
) -> None:
    calls = 10_000
    layout = sa.AreaLayout(ncounters=0, capacity=1 << 17)  # room for every call
    area = new_area(layout)
    run = launch(harness, func, area, threads, calls)
    flags = FlagsSave.PUSHF if thread_id is ThreadId.FS0 else FlagsSave.LAHF
    action = RecordAction(PROBE_ID, layout.ring_at(run.area), thread_id, cpu_id=BEST_CPU_ID)
    install(run, action, flags)
    records, dropped = drain(run, area)
    done = finish(run)
    assert dropped == 0 and len(records) == threads * calls
    by_thread = check_records(records, run, done.fsbases, calls)
    assert all(seen == list(range(calls)) for seen in by_thread.values())
    assert done.fixups == 0


@pytest.mark.parametrize("threads", [1, 4])
def test_lean_records(
    harness: Harness, new_area: Callable[[sa.AreaLayout], Area], threads: int
) -> None:
    """Without the registers: one slot a record, the header alone; and the counter."""
    calls = 20_000
    layout = sa.AreaLayout(ncounters=1, capacity=1 << 17)
    area = new_area(layout)
    run = launch(harness, "work", area, threads, calls)
    action = RecordAction(
        PROBE_ID,
        layout.ring_at(run.area),
        THREAD_IDS[-1],
        with_regs=False,
        cpu_id=BEST_CPU_ID,
        counter=run.area + layout.counter_offset(0),
    )
    assert action.slots == 1
    install(run, action)
    records, dropped = drain(run, area)
    done = finish(run)
    assert dropped == 0 and len(records) == threads * calls
    assert [r.ticket for r in records] == list(range(threads * calls))
    assert sa.read_counter(area.view, 0) == threads * calls
    per_thread = {fs: 0 for fs in done.fsbases.values()}
    last_tsc = dict.fromkeys(per_thread, 0)
    for r in records:
        assert (r.probe, r.regs, r.data) == (PROBE_ID, None, bytes(sa.SLOT - sa.REC_HEADER))
        assert 0 <= r.cpu < os.cpu_count()  # type: ignore[operator]
        per_thread[r.thread] += 1  # a KeyError names a thread that is none of them
        assert r.tsc > last_tsc[r.thread]  # a thread's records, in the order of its calls
        last_tsc[r.thread] = r.tsc
    assert list(per_thread.values()) == [calls] * threads


@pytest.mark.parametrize("cpu_id", CPU_IDS, ids=lambda c: c.name)
def test_cpu_is_the_one_the_thread_runs_on(
    harness: Harness, new_area: Callable[[sa.AreaLayout], Area], cpu_id: CpuId
) -> None:
    calls, threads = 5_000, 4
    layout = sa.AreaLayout(ncounters=0, capacity=1 << 16)
    area = new_area(layout)
    run = launch(harness, "work", area, threads, calls, "pin")
    ring = layout.ring_at(run.area)
    install(run, RecordAction(PROBE_ID, ring, THREAD_IDS[-1], with_regs=False, cpu_id=cpu_id))
    records, _ = drain(run, area)
    done = finish(run)
    cpu_of = {w.fsbase: w.cpu for w in done.workers.values()}
    assert all(cpu >= 0 for cpu in cpu_of.values())
    assert len(records) == threads * calls
    assert all(r.cpu == cpu_of[r.thread] for r in records)
    assert len(set(cpu_of.values())) == min(threads, len(os.sched_getaffinity(0)))


def test_no_cpu_reads_the_mask(harness: Harness, new_area: Callable[[sa.AreaLayout], Area]) -> None:
    """Without rdpid or rdtscp the cpu field says so: META_CPU_MASK (reader.py: cpu -1)."""
    layout = sa.AreaLayout(ncounters=0, capacity=1 << 10)
    area = new_area(layout)
    run = launch(harness, "work", area, 1, 100)
    ring = layout.ring_at(run.area)
    install(run, RecordAction(PROBE_ID, ring, with_regs=False, cpu_id=CpuId.NONE))
    records, _ = drain(run, area)
    finish(run)
    assert len(records) == 100 and {r.cpu for r in records} == {sa.META_CPU_MASK}


@pytest.mark.parametrize(("pace", "calls"), [(0, 400_000), (300, 150_000), (3000, 50_000)])
def test_small_ring_drops_never_tears(
    harness: Harness, new_area: Callable[[sa.AreaLayout], Area], pace: int, calls: int
) -> None:
    # pace 0: the writers outrun the reader and mostly drop (the drop path under contention);
    # 300 and 3000: the reader keeps up at times and reads records right behind their
    # writers. Records of 3 slots in 128: two in 128 run past the ring's end, through the
    # mirror.
    threads = 4
    layout = sa.AreaLayout(ncounters=0, capacity=128)
    area = new_area(layout)
    run = launch(harness, "work", area, threads, calls, f"pace={pace}")
    action = RecordAction(PROBE_ID, layout.ring_at(run.area), THREAD_IDS[-1], cpu_id=BEST_CPU_ID)
    assert action.slots == 3
    install(run, action)
    records, dropped = drain(run, area, spin=True)
    done = finish(run)
    assert len(records) + dropped == threads * calls
    assert dropped > 0 and len(records) > 0
    check_records(records, run, done.fsbases, calls)
    if pace:
        assert any(r.ticket % 128 > 125 for r in records)  # some ran past the end
    # The header's own account agrees: every ticket taken was read.
    words = area.view.cast("Q")
    assert words[sa.OFF_HEAD // 8] == words[sa.OFF_TAIL // 8] == 3 * len(records)
    assert words[sa.OFF_DROPS // 8] == dropped


# offsetof(struct user, u_debugreg): DR0 .. DR7, written with PTRACE_POKEUSER.
USER_DEBUGREG = 848
DR7_L0_EXECUTE = 1  # DR0 enabled for this thread, break on execution (RW0 = LEN0 = 0)


def test_a_head_read_before_the_reader_moved_on_is_no_drop(
    harness: Harness, new_area: Callable[[sa.AreaLayout], Area]
) -> None:
    """A producer loads head, the others reserve and commit, the reader reads their records
    and moves tail past the head the first one loaded; then it loads tail. Its ring is not
    full: it must retry with the new head, not count a drop. The interleaving is made exact
    with a hardware breakpoint (no byte of the detour changed) on the instruction after the
    head's load, in one thread of the harness, held there while the other one writes."""
    calls, threads = 20_000, 2
    layout = sa.AreaLayout(ncounters=0, capacity=1 << 16)  # never full: 40,000 slots
    area = new_area(layout)
    run = launch(harness, "work", area, threads, calls, "pace=20000")
    action = RecordAction(
        PROBE_ID, layout.ring_at(run.area), THREAD_IDS[-1], with_regs=False, cpu_id=BEST_CPU_ID
    )
    detour = build_detour(run.page, run.region, action)
    retry = next(
        i.ip
        for i in Decoder(64, detour.code, ip=run.page)
        if i.mnemonic == Mnemonic.LEA and i.op0_register == Register.RCX
    )
    install(run, action)
    view = area.view
    words = view.cast("Q")
    while words[sa.OFF_HEAD // 8] < 100:  # the threads are calling
        time.sleep(0.001)
    pid = run.proc.pid
    victim = min(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    regs = bytearray(REGS_SIZE)
    buf = ptrace.StructBuffer(regs)
    dr0 = ptrace.bind_requests(victim, buf, USER_DEBUGREG)
    dr7 = ptrace.bind_requests(victim, buf, USER_DEBUGREG + 7 * 8)
    records: list[sa.Record] = []
    try:
        # Step 1: hold the victim right after its load of head (rax).
        ptrace.seize(victim, 0)
        ptrace.interrupt(victim)
        ptrace.waitpid(victim, 0)
        assert dr0.poke_user(ptrace.Word(retry)) == 0
        assert dr7.poke_user(ptrace.Word(DR7_L0_EXECUTE)) == 0
        ptrace.cont(victim)
        _, status = ptrace.waitpid(victim, 0)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTRAP
        assert dr0.getregs() == 0 and dr7.poke_user(ptrace.Word(0)) == 0
        words_of = memoryview(regs).cast("Q")
        assert words_of[REG_INDEX["rip"]] == retry
        head_loaded = words_of[REG_INDEX["rax"]]
        # Step 2: the other thread writes, the reader reads past that head.
        dropped = 0
        while words[sa.OFF_TAIL // 8] <= head_loaded + action.slots:
            batch = sa.read_records(view)
            records += batch.records
            dropped += batch.dropped
        # Step 3: the victim goes on, loads tail, and must find room.
        ptrace.detach(victim)
    except BaseException:
        run.proc.kill()
        raise
    more, dropped_later = drain(run, area)
    done = finish(run)
    records += more
    dropped += dropped_later
    assert dropped == 0 and len(records) == threads * calls
    fsbase_of = set(done.fsbases.values())
    assert {r.thread for r in records} == fsbase_of
