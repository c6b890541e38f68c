"""Optimized record probes: asynchronous handlers fed from the ring (process/fast/reader.py).

tests/programs/records.c calls note(s, p, t, i) from T threads with good pointers and, on
known calls, bad ones (NULL, an address below mmap_min_addr, a string that runs into a
PROT_NONE page): every hit's fetch-args are known, and so is which of them must read
``(fault)``. The same handler runs on both tiers, so a trap run is the reference of an
optimized one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes

pytestmark = pytest.mark.ptrace

ARGS = "s=+0(%di):string v=+0(%si):s64 t=%dx i=%cx"


@pytest.fixture
def records(build: Callable[[str], Path]) -> Path:
    return build("records")


def expected(t: int, i: int) -> tuple[int, int, str | None, int | None]:
    """What note's fetch-args read on thread t's call i (records.c's rules)."""
    if i % 7 == 0:
        return t, i, None, None
    if i % 11 == 0:
        return t, i, None, 3 * i  # the string runs into a PROT_NONE page: no NUL
    return t, i, f"t{t}", 3 * i


def values(hit: Any) -> tuple[int, int, str | None, int | None]:
    return hit.arg("t"), hit.arg("i"), hit.arg("s"), hit.arg("v")


def run_with_handler(
    spawn: Any, exe: Path, tmp_path: Path, threads: int, n: int, *, optimize: bool = True
) -> tuple[Any, kprobes.Kprobe, list[Any], str]:
    out = tmp_path / "out"
    with open(out, "wb") as f:
        proc = spawn([exe, threads, n], stdout=f.fileno())
    hits: list[Any] = []
    kp = kprobes.Kprobe(
        symbol="note",
        optimize=True,
        async_handler=lambda p, h: hits.append(h),
        args=ARGS,
        with_regs=True,
    )
    if not optimize:
        proc.optimization = False
    proc.register_kprobe(kp)
    (entry,) = proc.list()
    assert entry.is_optimized == optimize, entry
    assert proc.run(timeout=60)
    assert proc.exit_code == 0
    return proc, kp, hits, out.read_text()


@pytest.mark.parametrize("threads", [1, 4])
def test_every_hit_reaches_the_handler_with_its_values(spawn, records, tmp_path, threads):
    n = 3000
    proc, kp, hits, output = run_with_handler(spawn, records, tmp_path, threads, n)
    assert output == support.reference_output([records, threads, n]).decode()
    assert kp.nhit == threads * n and len(hits) == threads * n and proc.dropped == 0
    by_thread: dict[int, list[Any]] = {}
    for h in hits:
        by_thread.setdefault(h.arg("t"), []).append(h)
    assert sorted(by_thread) == list(range(threads))
    ncpu = os.cpu_count() or 1
    for t, mine in by_thread.items():
        # In order, with the values of each call, bad pointers as (fault) (None).
        assert [values(h) for h in mine] == [expected(t, i) for i in range(n)]
        # One thread each, named by its tid, its name, a CPU that exists, time going forward.
        assert (
            len({h.tid for h in mine}) == 1 and mine[0].tid not in (0, proc.pid)
        ) or threads == 1
        assert {h.comm for h in mine} == {"records"}
        assert all(0 <= h.cpu < ncpu for h in mine)
        times = [h.timestamp for h in mine]
        assert times == sorted(times) and times[0] <= time.monotonic()
        assert all(h.ip == kp.addr and h.regs.rdx == t and h.regs.rcx == h.arg("i") for h in mine)
    assert len({mine[0].tid for mine in by_thread.values()}) == threads


def test_the_snapshot_is_read_only(spawn, records, tmp_path):
    _, _, hits, _ = run_with_handler(spawn, records, tmp_path, 1, 10)
    regs = hits[3].regs
    assert regs.rcx == 3 and regs.ip == hits[3].ip
    with pytest.raises(TypeError):
        regs.rcx = 0
    with pytest.raises(TypeError):
        regs["rax"] = 1


def test_the_trap_tier_gives_the_same_hits(spawn, records, tmp_path):
    threads, n = 2, 400
    _, _, fast, _ = run_with_handler(spawn, records, tmp_path, threads, n)
    (tmp_path / "trap").mkdir()
    _, kp, trap, _ = run_with_handler(spawn, records, tmp_path / "trap", threads, n, optimize=False)
    assert kp.nhit == threads * n
    key = lambda h: (h.arg("t"), h.arg("i"))  # noqa: E731
    assert [(values(h), h.comm) for h in sorted(fast, key=key)] == [
        (values(h), h.comm) for h in sorted(trap, key=key)
    ]
    assert all(h.regs is not None for h in trap)


def run_on_a_small_ring(
    spawn: Any, records: Path, tmp_path: Path, threads: int, n: int, *, block: bool = False
) -> tuple[Any, kprobes.Kprobe, list[Any]]:
    """``records THREADS N`` to its end, traced by a slow handler through a ring of 128
    slots (a reader that cannot keep up), waiting for room with ``block``."""
    out = tmp_path / "out"
    with open(out, "wb") as f:
        proc = spawn([records, threads, n], stdout=f.fileno())
    proc.ring_size = 8192
    proc.records.block_when_full = block
    hits: list[Any] = []

    def slow(p: Any, h: Any) -> None:
        hits.append(h)
        time.sleep(0.0001 if block else 0.0002)

    kp = kprobes.Kprobe(symbol="note", optimize=True, async_handler=slow, args=ARGS)
    proc.register_kprobe(kp)
    (entry,) = proc.list()
    assert entry.is_optimized, entry
    assert proc.run(timeout=300)
    assert proc.exit_code == 0
    assert out.read_text() == support.reference_output([records, threads, n]).decode()
    return proc, kp, hits


def test_a_full_ring_counts_drops_and_never_tears(spawn, records, tmp_path):
    proc, kp, hits = run_on_a_small_ring(spawn, records, tmp_path, 2, 20000)
    assert kp.nhit == 40000
    assert proc.dropped > 0 and len(hits) + proc.dropped == kp.nhit
    assert all(values(h) == expected(h.arg("t"), h.arg("i")) for h in hits)


def test_wrong_args_are_refused_before_anything_is_placed(spawn, records):
    proc = spawn([records, 1, 10])
    with pytest.raises(kprobes.errors.SpecError) as err:
        proc.register_kprobe(
            kprobes.Kprobe(symbol="note", async_handler=lambda p, h: None, args="x=+0(%zz)")
        )
    assert err.value.column > 0
    assert proc.list() == []
    with pytest.raises(kprobes.errors.ProbeRejected, match="async_handler"):
        proc.register_kprobe(
            kprobes.Kprobe(
                symbol="note", async_handler=lambda p, h: None, pre_handler=lambda p, r: None
            )
        )
    assert proc.list() == []


def test_a_handler_that_raises_ends_run(spawn, records):
    proc = spawn([records, 1, 100])

    def bad(p: Any, h: Any) -> None:
        raise ValueError("boom")

    proc.register_kprobe(kprobes.Kprobe(symbol="note", optimize=True, async_handler=bad))
    with pytest.raises(ValueError, match="boom"):
        proc.run(timeout=30)


# -- the command line ---------------------------------------------------------------------


def events(stdout: str) -> list[str]:
    """The bodies of the trace lines (after the timestamp), in order."""
    return [line.split(": ", 1)[1] for line in stdout.splitlines() if ": p_note" in line]


def test_trace_is_the_same_with_and_without_optimization(records):
    spec = f"p note {ARGS}"
    fast = support.cli("trace", "-c", f"{records} 2 300", spec)
    trap = support.cli("trace", "--no-optimize", "-c", f"{records} 2 300", spec)
    assert fast.returncode == 0 and trap.returncode == 0, fast.stderr + trap.stderr
    assert "uses a breakpoint" not in fast.stderr

    def by_thread(stdout: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for body in events(stdout):
            t = re.search(r" t=(0x[0-9a-f]+)", body)
            assert t is not None, body
            out.setdefault(t.group(1), []).append(body)
        return out

    assert by_thread(fast.stdout) == by_thread(trap.stdout)
    assert len(events(fast.stdout)) == 600
    assert "s=(fault) v=(fault) t=0x0 i=0x0" in fast.stdout


def test_trace_of_a_tight_loop_delivers_every_event_in_order(build):
    exe = build("optimized")
    n = 300_000
    r = support.cli("trace", "-c", f"{exe} 1 {n}", "p work i=%si:u64", timeout=300)
    assert r.returncode == 0, r.stderr
    text = support.without_output_of(r.stdout, support.reference_output([exe, 1, n]))
    got = [int(m) for m in re.findall(r"p_work_0: \(work\+0x0/0x[0-9a-f]+\) i=(\d+)", text)]
    assert got == list(range(n))
    assert f"{n} events, {n} hits, 0 missed, 0 dropped" in r.stderr


def test_a_refused_site_says_it_uses_a_breakpoint(build):
    exe = build("optimized")
    r = support.cli("trace", "-c", f"{exe} 1 3", "p tiny", "p work")
    assert r.returncode == 0, r.stderr
    assert re.search(r"p_tiny_0 uses a breakpoint: .*bytes", r.stderr), r.stderr
    assert "p_work_0 uses a breakpoint" not in r.stderr
    assert len([line for line in r.stdout.splitlines() if "p_work_0:" in line]) == 3


@pytest.mark.parametrize("block", [False, True], ids=["drop", "block"])
def test_the_program_finishes_when_the_tool_is_killed_mid_trace(records, popen, tmp_path, block):
    """With ``--block`` (test_block.py) the threads that wait for room in the full ring go
    on once the dead tool's lease runs out."""
    # One call in seven faults: a fixup each, by the tracer, then by the rescue. Enough calls
    # that a machine many times faster than a 2-vCPU guest is still at them when the tool dies.
    n = 1_000_000
    out = tmp_path / "out"
    stdin_r, stdin_w = os.pipe()
    with open(out, "wb") as f:
        prog = popen([records, 2, n, "wait"], stdin=stdin_r, stdout=f.fileno())
    os.close(stdin_r)
    tool = popen(
        [
            support.KPROBES,
            "trace",
            *(["--block"] if block else []),
            "-p",
            prog.pid,
            f"p note {ARGS}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    addr = support.runtime_address(prog.pid, records, "note")
    support.wait_until(lambda: support.raw_read(prog.pid, addr, 1) == b"\xe9", 30, "the jump")
    os.write(stdin_w, b"x")
    os.close(stdin_w)
    time.sleep(0.3)  # records being written and read, bad pointers fixed by the tracer,
    support.wait_ran(prog.pid, 0.005)  # and so on a loaded machine too
    assert prog.poll() is None, "the program ended before the tool was killed"
    os.kill(tool.pid, signal.SIGKILL)
    tool.wait()
    assert prog.wait(timeout=90) == 0
    assert out.read_text() == support.reference_output([records, 2, n]).decode()


def _area_resident(pid: int) -> list[tuple[int, int]]:
    """(size, resident) in KiB of each mapping of the program's shared areas (the area, then
    the ring's first pages mapped again after it)."""
    out = []
    size = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            size = 0 if "/memfd:kprobes-area" in line else -1
        elif size >= 0 and line.startswith("Size:"):
            size = int(line.split()[1])
        elif size > 0 and line.startswith("Rss:"):
            out.append((size, int(line.split()[1])))
    return out


def test_the_ring_is_in_before_the_first_record(spawn, records):
    """A record probe's ring is faulted in when the probe is optimized (memory.py), so that
    the ring's first lap costs the program no page fault; a count's ring is left out."""
    counted = spawn([records, 1, 10])
    counted.register_kprobe(kprobes.Kprobe(symbol="note", optimize=True))
    (entry,) = counted.list()
    assert entry.is_optimized, entry
    areas = _area_resident(counted.pid)
    assert areas and all(rss < size // 2 for size, rss in areas), areas  # only what it counts
    assert counted.run(timeout=60) and counted.exit_code == 0

    recorded = spawn([records, 1, 10])
    hits: list[Any] = []
    recorded.register_kprobe(
        kprobes.Kprobe(symbol="note", optimize=True, async_handler=lambda p, h: hits.append(h))
    )
    (entry,) = recorded.list()
    assert entry.is_optimized, entry
    areas = _area_resident(recorded.pid)
    # before any hit: the ring and its mirror (not the header and the counters)
    assert areas and all(size - rss < 1024 for size, rss in areas), areas
    assert recorded.run(timeout=60) and recorded.exit_code == 0
    assert len(hits) == 10
