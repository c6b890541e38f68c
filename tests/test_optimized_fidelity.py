"""Optimized count probes are as faithful as traps (issue 12): real code, every boundary.

A count probe with ``optimize=True`` is placed as an int3 and becomes a jump to a detour in the
program (process/fast/optimizer.py). Here every instruction boundary of real code gets one, and the
program must not notice: its output is byte-identical to an unprobed run's, and every probe's
``nhit`` equals the kernel's own uprobe count at the same address (the reference tool).

**Placement.** A probe strictly inside another one's region (the instructions its jump
displaces) keeps that other one on its int3, so the boundaries are split into *passes*, one
run each: in a pass no probe lies inside the region of another, so every site that
``jumpopt.find_region`` accepts must be optimized, and the sites it refuses (a jump into the
region, a call in it, the function's end...) are int3 probes of the same run. Each boundary is
probed in exactly one pass, and each accepted one is optimized there.

1. fidelity.c's functions and libc's qsort/qsort_r (test_fidelity.py's program and sites),
   built as test_fidelity.py builds it (the switch's jump table refuses every site of hand())
   and without jump tables (``fidelity-nojt``: hand()'s pushf/popf, rip-relative stores and
   loop in detours).
2. libc's malloc and free in a zstd that compresses in a worker thread, on a private copy of
   libc that the kernel's run and ours load (one job, as in test_kernel_counts.py, so that
   the calls do not depend on the threads' timing).
3. hammer.c's mix() (flags live across regions, the red zone, rip-relative operands, a loop)
   hammered by 8 threads while the optimization is switched off and on, probes are disabled
   and enabled, and a probe inside an optimized region is registered and unregistered.
4. The tool SIGKILLed while the jumps fire, or held in the middle of a stop of the world
   that writes or removes jumps (tests/drivers/optimize_until_killed.py).
5. C++ (coldpad.cpp, g++ -O2): a function with catch clauses and a cleanup, whose landing
   pads are entered by the unwinder and whose cold part jumps back into it; and a
   hand-written landing pad inside a region, which must keep the jump out.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import support
from elftools.elf.elffile import ELFFile
from kernel_reference import KernelReference, RefProbe
from test_fidelity import ARGS, EXE_FUNCTIONS, LIBC_FUNCTIONS, STDIN, Site, kernel_counts, sites_of

import kprobes
from kprobes.arch.x86_64.jumpopt import Refusal, find_region

pytestmark = pytest.mark.ptrace

DRIVERS = Path(__file__).resolve().parent / "drivers"
REPO = DRIVERS.parent.parent
ZSTD = shutil.which("zstd")


# -- placement ------------------------------------------------------------------------------


def region_ends(sites: Sequence[Site]) -> list[int | None]:
    """The link-time end of the region ``find_region`` gives each site from the file's bytes,
    with what the optimizer passes it (the function's other parts, ``foo.cold`` and
    ``foo.cold.N``, and the file's landing pads), or None where it refuses the site."""
    functions: dict[tuple[Path, str], list[tuple[int, bytes]]] = {}
    pads: dict[Path, set[int]] = {}
    out: list[int | None] = []
    for s in sites:
        key = (s.path, s.function)
        if key not in functions:
            functions[key] = function_parts(s.path, s.function, s.spec.startswith("libc:"))
            pads.setdefault(s.path, landing_pads(s.path))
        (start, body), *fragments = functions[key]
        region = find_region(
            body, start, s.vaddr, len(body), fragments=fragments, entries=pads[s.path]
        )
        out.append(None if isinstance(region, Refusal) else region.end)
    return out


def function_parts(path: Path, name: str, dynamic: bool) -> list[tuple[int, bytes]]:
    """(link-time address, bytes) of function ``name``, then of its other parts (gcc's
    ``foo.cold`` and ``foo.cold.N``; for such a part, ``foo`` and the others)."""
    table = support.nm_symbols(path, dynamic=dynamic)
    base = name.partition(".cold")[0]
    others = [
        sym
        for other, sym in table.items()
        if other != name and (other == base or other.startswith(f"{base}.cold")) and sym.size
    ]
    return [
        (sym.value, support.file_bytes(path, sym.value, sym.size)) for sym in [table[name], *others]
    ]


def landing_pads(path: Path) -> set[int]:
    """The link-time address of every landing pad in ``path``: where the unwinder enters a
    function from outside, read from the LSDA of each FDE that has one."""
    pads: set[int] = set()
    with open(path, "rb") as f:
        elf = ELFFile(f)
        table = elf.get_section_by_name(".gcc_except_table")
        if table is None:
            return pads
        data, base = table.data(), table["sh_addr"]
        for entry in elf.get_dwarf_info().EH_CFI_entries():
            lsda = getattr(entry, "lsda_pointer", None)
            if lsda is not None:
                start = entry.header["initial_location"]
                pads.update(start + pad for pad in call_site_pads(data, lsda - base) if pad)
    return pads


def call_site_pads(data: bytes, at: int) -> list[int]:
    """The landing pad of each entry of the call-site table of the LSDA at ``data[at:]``, as
    an offset from the function's start (0: none), in the form gcc writes: no LPStart of its
    own, call sites in uleb128."""

    def uleb() -> int:
        nonlocal at
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    assert data[at] == 0xFF, "an LPStart of its own"
    has_types = data[at + 1] != 0xFF
    at += 2
    if has_types:
        uleb()  # where the type table is
    assert data[at] == 0x01, "call sites not in uleb128"
    at += 1
    length = uleb()
    end = at + length
    pads = []
    while at < end:
        _start, _length, pad, _action = uleb(), uleb(), uleb(), uleb()
        pads.append(pad)
    return pads


def split_in_passes(sites: Sequence[Site], ends: Sequence[int | None]) -> list[list[int]]:
    """Indices of ``sites`` in passes: each site once, none inside the region of another
    accepted site of its pass (greedy, in address order: a site goes in the first pass whose
    last region ends at or before it)."""
    left = sorted(range(len(sites)), key=lambda i: (str(sites[i].path), sites[i].vaddr))
    passes = []
    while left:
        chosen, rest = [], []
        path, until = None, 0
        for i in left:
            if sites[i].path != path:
                path, until = sites[i].path, 0
            if sites[i].vaddr < until:
                rest.append(i)
                continue
            chosen.append(i)
            until = ends[i] or until
        passes.append(chosen)
        left = rest
    return passes


@dataclass(frozen=True, slots=True)
class PassRun:
    """One run of the program with the probes of one pass."""

    indices: list[int]  # of the sites
    stdout: bytes
    exit_code: int | None
    nhit: list[int]
    is_optimized: list[bool]  # in list() once every probe was placed (zstd: at its exit)
    why: list[str]  # why_not_optimized, likewise


def probes_for(sites: Sequence[Site], indices: Sequence[int]) -> list[kprobes.Kprobe]:
    return [
        kprobes.Kprobe(symbol=sites[i].spec, offset=sites[i].offset, optimize=True) for i in indices
    ]


def run_gated_pass(
    exe: Path, args: Sequence[str], stdin: bytes, sites: Sequence[Site], indices: list[int],
    tmp: Path,
) -> PassRun:  # fmt: skip
    """A program that says "ready" on stderr, then reads ``stdin`` and does its work: the
    probes' states are read while it waits."""
    out, err = tmp / "stdout", tmp / "stderr"
    kps = probes_for(sites, indices)
    stdin_r, stdin_w = os.pipe()
    try:
        with open(out, "wb") as fout, open(err, "wb") as ferr:
            proc = kprobes.spawn([str(exe), *args], stdin=stdin_r, stdout=fout, stderr=ferr)
    finally:
        os.close(stdin_r)
    try:
        notices: list[str] = []
        proc.on_notice = notices.append
        proc.register_kprobes(kps)
        deadline = time.monotonic() + 30
        while b"ready\n" not in err.read_bytes() or any(kp.is_pending for kp in kps):
            assert time.monotonic() < deadline, "the probes were not placed within 30 s"
            assert not proc.run(timeout=0.01), ("the program ended", notices)
        listing = {entry.addr: entry for entry in proc.list()}
        entries = [listing[kp.addr] for kp in kps if kp.addr is not None]
        assert len(entries) == len(kps)
        os.write(stdin_w, stdin)
        os.close(stdin_w)
        stdin_w = -1
        assert proc.run(timeout=60), "the probed program did not finish within 60 s"
    finally:
        if stdin_w >= 0:
            os.close(stdin_w)
        support.cleanup_proc(proc)
    return PassRun(
        indices,
        out.read_bytes(),
        proc.exit_code,
        [kp.nhit for kp in kps],
        [e.is_optimized for e in entries],
        [e.why_not_optimized for e in entries],
    )


def by_site(runs: Sequence[PassRun], n: int) -> tuple[list[int], list[bool], list[str]]:
    """nhit, is_optimized and why, per site, from the pass that probed it."""
    nhit, optimized, why = [-1] * n, [False] * n, [""] * n
    for run in runs:
        for k, i in enumerate(run.indices):
            nhit[i], optimized[i], why[i] = run.nhit[k], run.is_optimized[k], run.why[k]
    return nhit, optimized, why


def assert_placement(
    sites: Sequence[Site], ends: Sequence[int | None], runs: Sequence[PassRun]
) -> None:
    """Every boundary probed once; every accepted one optimized, every refused one not (and
    saying why)."""
    probed = sorted(i for run in runs for i in run.indices)
    assert probed == list(range(len(sites)))
    _, optimized, why = by_site(runs, len(sites))
    wrong = [
        (s.spec, hex(s.offset), s.text, why[i])
        for i, s in enumerate(sites)
        if optimized[i] != (ends[i] is not None) or (not optimized[i] and not why[i])
    ]
    assert wrong == []


# -- 1. fidelity.c, every boundary ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fidelity:
    exe: Path
    sites: list[Site]
    ends: list[int | None]
    runs: list[PassRun]
    kernel: support.UprobeRun
    unprobed: bytes


@pytest.fixture(scope="module", params=["fidelity", "fidelity-nojt"])
def fidelity(request: Any, build: Any, tmp_path_factory: Any) -> Fidelity:
    if support.tracefs_root() is None:
        pytest.skip("tracefs with uprobe_events is not available (needs root)")
    exe: Path = build(request.param)
    libc = support.libc_path(exe)
    sites = sites_of(exe, EXE_FUNCTIONS, libc=False) + sites_of(libc, LIBC_FUNCTIONS, libc=True)
    ends = region_ends(sites)
    runs = []
    for k, indices in enumerate(split_in_passes(sites, ends)):
        tmp = tmp_path_factory.mktemp(f"{request.param}-pass{k}")
        runs.append(run_gated_pass(exe, ARGS, STDIN, sites, indices, tmp))
    kernel = kernel_counts(exe, sites, tmp_path_factory.mktemp(f"{request.param}-kernel"))
    unprobed = support.reference_output([exe, *ARGS], stdin=STDIN)
    return Fidelity(exe, sites, ends, runs, kernel, unprobed)


@pytest.mark.tracefs
def test_fidelity_output_is_identical(fidelity: Fidelity) -> None:
    assert len(fidelity.runs) >= 2
    for run in fidelity.runs:
        assert run.exit_code == 0
        assert run.stdout == fidelity.unprobed


@pytest.mark.tracefs
def test_fidelity_every_accepted_site_is_optimized(fidelity: Fidelity) -> None:
    assert_placement(fidelity.sites, fidelity.ends, fidelity.runs)
    nhit, optimized, _ = by_site(fidelity.runs, len(fidelity.sites))
    # Not vacuous: many jumps, in the program and in libc, and many hits through them.
    mine = [i for i, s in enumerate(fidelity.sites) if optimized[i] and s.path == fidelity.exe]
    theirs = [i for i, s in enumerate(fidelity.sites) if optimized[i] and s.path != fidelity.exe]
    assert len(mine) >= (60 if fidelity.exe.name == "fidelity-nojt" else 12)
    assert len(theirs) >= 100
    assert sum(nhit[i] for i in mine) >= 2_000
    assert sum(nhit[i] for i in theirs) >= 20  # qsort_r sets up; msort does the work


@pytest.mark.tracefs
def test_fidelity_counts_equal_the_kernels(fidelity: Fidelity) -> None:
    sites, kernel = fidelity.sites, fidelity.kernel
    assert kernel.returncode == 0 and kernel.stdout == fidelity.unprobed
    nhit, optimized, _ = by_site(fidelity.runs, len(sites))
    compared = [i for i, c in enumerate(kernel.counts) if c is not None]
    assert len(compared) >= 0.9 * len(sites)
    mismatches = [
        (s.spec, hex(s.offset), s.text, optimized[i], nhit[i], kernel.counts[i])
        for i, s in enumerate(sites)
        if i in compared and nhit[i] != kernel.counts[i]
    ]
    assert mismatches == []
    # A pushf (which the kernel does not probe) runs as often as the instruction after it.
    pushfs = [i for i, s in enumerate(sites) if s.text.startswith("pushf")]
    assert pushfs
    for i in pushfs:
        assert nhit[i] == kernel.counts[i + 1] and nhit[i] > 0


# -- 2. malloc and free in a multi-threaded zstd ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Zstd:
    libc: Path  # the private copy both runs load
    env: dict[str, str]
    data: Path
    tmp: Path

    def argv(self, out: str) -> list[str]:
        assert ZSTD is not None
        return [ZSTD, "-q", "-f", "-T2", "-1", str(self.data), "-o", str(self.tmp / out)]


@pytest.fixture(scope="module")
def zstd(tmp_path_factory: Any) -> Zstd:
    if ZSTD is None:
        pytest.fail("zstd is part of the test machine's set-up (scripts/ensure-system-deps)")
    tmp = tmp_path_factory.mktemp("opt-zstd")
    (tmp / "lib").mkdir()
    libc = tmp / "lib" / "libc.so.6"
    shutil.copy2(support.libc_path(ZSTD), libc)
    data = tmp / "input"
    # One job for the pool of two workers (test_kernel_counts.py says why).
    data.write_bytes(b"".join(b"line %d of the zstd test input\n" % i for i in range(20_000)))
    return Zstd(libc, dict(os.environ, LD_LIBRARY_PATH=str(libc.parent)), data, tmp)


def run_zstd_pass(zstd: Zstd, sites: Sequence[Site], indices: list[int], out: str) -> PassRun:
    """zstd with the probes of one pass; their states as ``list()`` gives them at its exit
    (there is no pause to look at them earlier: zstd may end within one ``run(timeout)``)."""
    kps = probes_for(sites, indices)
    with open(os.devnull, "rb") as fin, open(os.devnull, "wb") as fout:
        proc = kprobes.spawn(zstd.argv(out), stdin=fin, stdout=fout, stderr=fout, env=zstd.env)
    notices: list[str] = []
    proc.on_notice = notices.append
    try:
        proc.register_kprobes(kps)  # pending: placed when the loader maps the private libc
        assert proc.run(timeout=60), "zstd did not finish within 60 s"
        assert not any(kp.is_pending for kp in kps), notices
        by_addr = {entry.addr: entry for entry in proc.list()}
    finally:
        support.cleanup_proc(proc)
    entries = [by_addr[kp.addr] for kp in kps if kp.addr is not None]
    assert len(entries) == len(kps)
    return PassRun(
        indices,
        (zstd.tmp / out).read_bytes(),
        proc.exit_code,
        [kp.nhit for kp in kps],
        [e.is_optimized for e in entries],
        [e.why_not_optimized for e in entries],
    )


@pytest.mark.tracefs
def test_malloc_and_free_in_a_multithreaded_zstd(zstd: Zstd) -> None:
    sites = sites_of(zstd.libc, ("malloc", "free"), libc=True)
    names = [f"{s.function}_{s.offset:x}" for s in sites]
    ends = region_ends(sites)
    null_in = os.open(os.devnull, os.O_RDONLY)
    null_out = os.open(os.devnull, os.O_WRONLY)
    try:
        probes = [
            RefProbe(n, zstd.libc, s.function, s.offset) for n, s in zip(names, sites, strict=True)
        ]
        with KernelReference(probes, grouped=True) as ref:
            kernel = ref.run(
                zstd.argv("kernel.zst"), env=zstd.env, stdin=null_in, stdout=null_out,
                stderr=null_out,
            )  # fmt: skip
            refused = ref.refused
    finally:
        os.close(null_in)
        os.close(null_out)
    assert kernel.returncode == 0 and len(kernel.by_process) == 1
    subprocess.run(zstd.argv("plain.zst"), env=zstd.env, check=True, timeout=60)
    plain = (zstd.tmp / "plain.zst").read_bytes()
    assert (zstd.tmp / "kernel.zst").read_bytes() == plain

    passes = split_in_passes(sites, ends)
    runs = [run_zstd_pass(zstd, sites, p, f"pass{k}.zst") for k, p in enumerate(passes)]
    for run in runs:
        assert run.exit_code == 0
        assert run.stdout == plain  # the compressed file, byte for byte
    assert_placement(sites, ends, runs)
    nhit, optimized, _ = by_site(runs, len(sites))
    assert len(refused) < len(sites) // 10, sorted(refused)
    compared = [i for i, n in enumerate(names) if n not in refused]
    got = {names[i]: nhit[i] for i in compared}
    assert got == {names[i]: kernel.counts[names[i]] for i in compared}
    # Not vacuous: many jumps, much of the work through them, and two threads at work.
    assert sum(optimized) >= 100
    assert sum(nhit[i] for i in compared if optimized[i]) >= 2_000
    assert kernel.counts["malloc_0"] > 50 and kernel.counts["free_0"] > 50
    assert len(kernel.threads["malloc_0"]) >= 2


# -- 3. switching while 8 threads hammer -----------------------------------------------------

THREADS = 8
ACTIONS = 90


@pytest.fixture(scope="module")
def hammer(build: Any) -> Path:
    path: Path = build("hammer")
    return path


def hammer_output(threads: int) -> bytes:
    """What ``hammer THREADS -1`` prints when every call was right."""
    lines = [f"thread {t}: every call checked\n" for t in range(threads)]
    return "".join([*lines, f"total: {threads} threads stopped\n"]).encode()


def hammer_calls(stderr: str, threads: int) -> int:
    """How many calls of mix() the workers made, as ``hammer`` reports them on stderr."""
    made = re.findall(r"^hammer: thread \d+ made (\d+) calls$", stderr, re.MULTILINE)
    assert len(made) == threads, stderr[-2000:]
    return sum(map(int, made))


def mix_sites(exe: Path) -> tuple[list[Site], list[int | None], list[int]]:
    """mix()'s and mix_model()'s boundaries, their regions, and how often each runs per call
    (the loop's instructions 3 times)."""
    sites = sites_of(exe, ("mix", "mix_model"), libc=False)
    (jnz,) = [s for s in sites if s.function == "mix" and s.text.startswith(("jne", "jnz"))]
    head = int(jnz.text.split()[1], 16)
    times = [3 if s.function == "mix" and head <= s.vaddr <= jnz.vaddr else 1 for s in sites]
    assert times.count(3) == 4  # rol, xor, dec, jnz
    return sites, region_ends(sites), times


def test_switching_while_eight_threads_hammer(spawn, hammer, tmp_path):
    """90 changes, at random, while 8 threads call mix() without a pause: the optimization
    off or on; 7 of the probes of mix_model() (called once per call of mix) disabled or
    enabled, each a jump written or removed while the threads run through that code; a probe
    registered inside the region of the jump at mix+0 (which goes back to its int3) or
    unregistered (the jump comes back). Every call is checked by the program, and the probes
    that stay enabled count every call exactly."""
    sites, ends, times = mix_sites(hammer)
    first = split_in_passes(sites, ends)[0]
    steady = [i for i in first if sites[i].function == "mix" and ends[i] is not None]
    toggled = [i for i in first if sites[i].function == "mix_model" and ends[i] is not None]
    entry = steady[0]
    assert sites[entry].offset == 0 and len(steady) >= 12 and len(toggled) >= 12
    inside = next(s for s in sites if sites[entry].vaddr < s.vaddr < (ends[entry] or 0))
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as fout, open(err, "wb") as ferr:
        proc = spawn([hammer, THREADS, -1], stdout=fout.fileno(), stderr=ferr.fileno())
    kps = probes_for(sites, steady)
    switched = probes_for(sites, toggled)
    proc.register_kprobes(kps + switched)
    assert all(e.is_optimized for e in proc.list()), proc.list()
    rng = random.Random(int(os.environ.get("KPROBES_TEST_SEED", "12")))
    guests: list[kprobes.Kprobe] = []  # every probe registered inside the region
    done: dict[str, int] = {"optimization": 0, "toggle": 0, "inside": 0}
    states: set[str] = set()  # what the probe at mix+0 was after each change
    for _ in range(ACTIONS):
        assert not proc.run(timeout=0.01), "the program ended early"
        action = rng.choice(list(done))
        done[action] += 1
        if action == "optimization":
            proc.optimization = not proc.optimization
        elif action == "toggle":
            for kp in rng.sample(switched, 7):
                (proc.enable_kprobe if kp.is_disabled else proc.disable_kprobe)(kp)
        elif guests and guests[-1].is_registered:
            proc.unregister_kprobe(guests[-1])
        else:
            guests.append(kprobes.Kprobe(symbol="mix", offset=inside.offset, optimize=True))
            proc.register_kprobe(guests[-1])
        (now,) = [e for e in proc.list() if e.where == "mix+0x0"]
        states.add("OPTIMIZED" if now.is_optimized else now.why_not_optimized.split(" (")[0])
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert out.read_bytes() == hammer_output(THREADS)
    calls = hammer_calls(err.read_text(), THREADS)
    # Every kind of change happened, and the jump at mix+0 came and went for each reason.
    assert min(done.values()) >= 15, done
    assert "OPTIMIZED" in states and "optimization is off" in states
    where = (kps[0].addr or 0) + inside.offset
    assert f"another probe at {where:#x} is inside the region" in states, states
    assert [kp.nhit for kp in kps] == [calls * times[i] for i in steady]
    assert all(0 < kp.nhit <= calls for kp in switched)
    assert 0 < sum(kp.nhit for kp in guests) <= calls
    assert calls > 100_000


@pytest.mark.parametrize("optimize", [False, True], ids=["trap", "optimized"])
def test_a_disabled_probe_beside_an_enabled_one_counts_nothing(spawn, hammer, optimize):
    """Two count probes on one address, one of them disabled: the site stays armed for the
    other (optimized or not), and the disabled one counts nothing, as on the trap tier (the
    kernel's aggregate probe skips a disabled one)."""
    with open(os.devnull, "wb") as null:
        proc = spawn([hammer, 2, 5_000], stdout=null.fileno(), stderr=null.fileno())
    quiet, counting = (kprobes.Kprobe(symbol="mix", optimize=True) for _ in range(2))
    proc.optimization = optimize
    proc.register_kprobes([quiet, counting])
    proc.disable_kprobe(quiet)
    assert [e.is_optimized for e in proc.list()] == [optimize, optimize]
    assert proc.run(timeout=60) and proc.exit_code == 0
    assert counting.nhit == 2 * 5_000
    assert quiet.nhit == 0


# -- 4. the tool killed while the jumps fire --------------------------------------------------


def what_is_left(pid: int, exe: Path, sites: Sequence[Site]) -> list[str]:
    """What each of ``sites`` (in mix, in address order) holds in the running program: its
    own byte, our int3 (which the rescue handler serves, and puts the byte back), a jump into
    an anonymous executable page (a detour), or nothing of its own (inside another site's
    jump). Every other byte of mix must be the file's: anything else is a torn patch."""
    sym = support.symbol(exe, "mix")
    bias = support.runtime_address(pid, exe, "mix") - sym.value
    live = support.raw_read(pid, bias + sym.value, sym.size)
    code = support.file_bytes(exe, sym.value, sym.size)
    detours = support.anonymous_exec_mappings(pid)
    left, expected, covered = [], bytearray(code), 0
    for s in sorted(sites, key=lambda s: s.offset):
        at = s.offset
        if at < covered:
            left.append("inside a jump")
        elif live[at] == 0xCC:
            left.append("int3")
            expected[at] = 0xCC
        elif live[at] == 0xE9 and code[at] != 0xE9:
            to = bias + s.vaddr + 5 + int.from_bytes(live[at + 1 : at + 5], "little", signed=True)
            assert any(m.start <= to < m.end for m in detours), (hex(at), hex(to))
            left.append("jump")
            expected[at : at + 5] = live[at : at + 5]
            covered = at + 5
        else:
            left.append("original")
    assert live == bytes(expected), (live.hex(), code.hex())
    return left


def start_hammer(popen: Any, hammer: Path) -> subprocess.Popen[bytes]:
    """``hammer 8 -1``, niced (its 8 spinning threads would starve the tool on two cores),
    returned once every thread runs."""
    argv = ["nice", "-n", "10", hammer, THREADS, -1]
    prog: subprocess.Popen[bytes] = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert prog.stdout is not None and prog.stderr is not None
    assert support.read_line(prog.stderr.fileno(), 20) == f"hammer {prog.pid} ready\n".encode()
    return prog


def kill_driver(popen: Any, prog: subprocess.Popen[bytes], *args: Any, stall: bool) -> None:
    """Start the driver on ``prog``; SIGKILL it when it says ``stalled`` (``stall``), else at a
    random moment after ``ready``; return once every thread of ``prog`` is released."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = popen(
        [sys.executable, DRIVERS / "optimize_until_killed.py", prog.pid, *args],
        stdout=subprocess.PIPE,
        env=env,
    )
    assert driver.stdout is not None
    assert support.read_line(driver.stdout.fileno(), 30) == b"ready\n"
    if stall:
        assert support.read_line(driver.stdout.fileno(), 30) == b"stalled\n"
    else:
        rng = random.Random(int(os.environ.get("KPROBES_TEST_SEED", "13")))
        time.sleep(rng.uniform(0.1, 0.4))
    driver.kill()
    assert driver.wait(10) == -signal.SIGKILL
    support.wait_until(
        lambda: not any(support.tracer_of(prog.pid, t) for t in support.thread_ids(prog.pid)),
        10,
        "the program's threads to be released",
    )


def finish_hammer(prog: subprocess.Popen[bytes]) -> None:
    """The program runs on alone a while, then must end by itself, every call right."""
    time.sleep(0.3)
    prog.send_signal(signal.SIGUSR1)
    out, err = prog.communicate(timeout=30)
    assert prog.returncode == 0, err.decode()[-2000:]
    assert out == hammer_output(THREADS)
    assert hammer_calls(err.decode(), THREADS) > 0


@pytest.mark.parametrize(
    ("mode", "stall", "after"),
    [
        ("steady", "none", 0),
        ("switch", "patch", 19),
        ("switch", "unpatch", 19),
        ("toggle", "patch", 6),
        ("toggle", "unpatch", 6),
    ],
    ids=["firing", "switching-on", "switching-off", "enabling", "disabling"],
)
def test_the_program_carries_on_when_the_tool_is_killed(popen, hammer, mode, stall, after):
    """SIGKILL of a tool whose optimized probes fire in 8 threads: at a random moment while
    they all fire, or held in the middle of a stop of the world that writes jumps (the
    optimization switched on, a probe enabled or a probe inside a region unregistered) or
    removes them (off, disabled, registered inside): some sites have their jumps, others
    their int3s or their own bytes. Every byte of mix is one of these, whole, and the
    program finishes by itself, every call right, with its output and status 0."""
    sites, ends, _ = mix_sites(hammer)
    first = split_in_passes(sites, ends)[0]
    probed = [sites[i] for i in first if sites[i].function == "mix" and ends[i] is not None]
    inside = next(s for s in sites if probed[0].vaddr < s.vaddr < (ends[first[0]] or 0))
    prog = start_hammer(popen, hammer)
    args = [mode, "--inside", hex(inside.offset), "--stall", stall, "--after", after]
    kill_driver(popen, prog, *args, *(hex(s.offset) for s in probed), stall=stall != "none")
    left = what_is_left(prog.pid, hammer, [*probed, inside])
    if stall == "none":
        assert sorted(left) == ["inside a jump"] + ["jump"] * len(probed)
    else:
        assert 0 < left.count("jump") < len(probed), left
    finish_hammer(prog)


def test_the_program_carries_on_when_the_tool_dies_holding_a_reaped_trap(popen, hammer):
    """The tool killed right after waitpid() gave it a thread stopped on an int3 of ours: the
    thread must go on from the probed instruction (the rescue's business), not from inside
    it."""
    sites, _, _ = mix_sites(hammer)
    (load,) = [s for s in sites if s.function == "mix" and "(%rip),%rdx" in s.text]
    assert support.file_bytes(hammer, load.vaddr, 1) == b"\x48"  # REX.W: 64 bits, not 32
    prog = start_hammer(popen, hammer)
    kill_driver(
        popen, prog, "traps", "--stall", "reaped", "--after", 50, hex(load.offset), stall=True
    )
    finish_hammer(prog)


# -- 5. C++: landing pads and cold parts -----------------------------------------------------

CXX_ARGS = ["300"]
CXX_FUNCTIONS = ("catcher", "catcher.cold", "may_throw", "may_throw.cold")


@pytest.fixture(scope="module")
def coldpad(build: Any) -> Path:
    path: Path = build("coldpad")
    return path


@pytest.mark.tracefs
def test_cxx_landing_pads_and_cold_parts(coldpad: Path, tmp_path_factory: Any) -> None:
    """Every boundary of a C++ function with a try block, two catch clauses and a cleanup, of
    its cold part (which jumps back into it), and of the function that throws: each site is
    optimized where find_region (given the other part) accepts it, else an int3 that says
    why; the landing pads and the sites after them included. Output and counts as the
    kernel's."""
    sites = sites_of(coldpad, CXX_FUNCTIONS, libc=False)
    ends = region_ends(sites)
    runs = []
    for k, indices in enumerate(split_in_passes(sites, ends)):
        tmp = tmp_path_factory.mktemp(f"coldpad-pass{k}")
        runs.append(run_gated_pass(coldpad, CXX_ARGS, b"go\n", sites, indices, tmp))
    unprobed = support.reference_output([coldpad, *CXX_ARGS], stdin=b"go\n")
    for run in runs:
        assert run.exit_code == 0
        assert run.stdout == unprobed
    assert_placement(sites, ends, runs)
    private = tmp_path_factory.mktemp("coldpad-kernel")
    kernel = kernel_counts(coldpad, sites, private, CXX_ARGS, b"go\n")
    assert kernel.returncode == 0 and kernel.stdout == unprobed
    nhit, optimized, _ = by_site(runs, len(sites))
    assert all(c is not None for c in kernel.counts)
    assert nhit == kernel.counts
    # What the test is about: landing pads entered through a jump (the sites right after
    # them, which that jump covers, keep their int3s); cold parts that run through jumps and
    # jump back to sites of catcher that are jumps themselves.
    pads = [i for i, s in enumerate(sites) if s.vaddr in landing_pads(coldpad)]
    assert len([i for i in pads if optimized[i] and nhit[i] > 0]) >= 2
    cold = [i for i, s in enumerate(sites) if s.function.endswith(".cold")]
    assert len([i for i in cold if optimized[i] and nhit[i] > 0]) >= 5
    back = {
        int(sites[i].text.split()[1], 16)
        for i in cold
        if sites[i].text.startswith("jmp") and "<catcher+" in sites[i].text
    }
    targets = [i for i, s in enumerate(sites) if s.vaddr in back]
    assert len(targets) == len(back) >= 2
    assert all(optimized[i] and nhit[i] > 0 for i in targets)
    assert sum(optimized) >= 50


def test_a_landing_pad_inside_the_region_refuses_the_jump(spawn, coldpad, tmp_path):
    """pad_inside's landing pad is 2 bytes after `xor %edx, %edx`: a jump there would cover
    it. The site must stay an int3 and say why, and the program run as without the probe."""
    (xor,) = [s for s in sites_of(coldpad, ("pad_inside",), libc=False) if s.text.startswith("xor")]
    assert xor.vaddr + 2 in landing_pads(coldpad)
    (start, body), *_ = function_parts(coldpad, "pad_inside", False)
    alone = find_region(body, start, xor.vaddr, len(body))  # the code alone allows a jump
    assert not isinstance(alone, Refusal) and alone.end == xor.vaddr + 5
    assert region_ends([xor]) == [None]  # the landing pad does not
    out = tmp_path / "out"
    stdin = tmp_path / "stdin"
    stdin.write_bytes(b"go\n")
    with open(stdin, "rb") as fin, open(out, "wb") as fout, open(os.devnull, "wb") as null:
        proc = spawn([coldpad, *CXX_ARGS], stdin=fin, stdout=fout, stderr=null)
    kp = kprobes.Kprobe(symbol="pad_inside", offset=xor.offset, optimize=True)
    proc.register_kprobe(kp)
    (entry,) = proc.list()
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert out.read_bytes() == support.reference_output([coldpad, *CXX_ARGS], stdin=b"go\n")
    assert not entry.is_optimized and "entered from elsewhere" in entry.why_not_optimized
    # The xor runs on the normal path only: when may_throw(i) did not throw.
    assert kp.nhit == sum(i % 7 != 3 and i % 11 != 5 for i in range(int(CXX_ARGS[0])))
