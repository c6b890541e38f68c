"""Optimized count probes in live processes (process/fast/optimizer.py): a jmp to a detour that
counts in the program, no trap per hit.

tests/programs/optimized.c calls work(t, i) N times from each of T threads, in rounds that
wait for a byte on stdin between them, so the exact count is known and the tool can act
between rounds (detach, switch optimization off and on, unregister). tiny() is a one-byte
function: too short for a jump, it stays a trap probe and says why.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes.arch.x86_64 import shared_area as sa

pytestmark = pytest.mark.ptrace


@pytest.fixture
def optimized(build: Callable[[str], Path]) -> Path:
    return build("optimized")


class Run:
    """A spawned optimized.c with its stdout in a file and its stdin a pipe of ours."""

    def __init__(self, spawn: Any, exe: Path, tmp_path: Path, *args: int | str) -> None:
        self.out = tmp_path / "out"
        self.argv: list[Any] = [exe, *args]
        stdin_r, self.stdin = os.pipe()
        with open(self.out, "wb") as f:
            self.proc = spawn(self.argv, stdin=stdin_r, stdout=f.fileno())
        os.close(stdin_r)

    def run_until(self, line: str, timeout: float = 20) -> None:
        """Dispatch stops until the program printed ``line`` (it then waits on stdin)."""
        deadline = time.monotonic() + timeout
        while line not in self.out.read_text().splitlines():
            assert time.monotonic() < deadline, f"no {line!r} in {self.out.read_text()!r}"
            assert not self.proc.run(timeout=0.05), "the program exited early"

    def next_round(self) -> None:
        os.write(self.stdin, b"x")

    def finish(self) -> None:
        os.close(self.stdin)
        assert self.proc.run(timeout=30)
        assert self.proc.exit_code == 0

    def output(self) -> str:
        return self.out.read_text()

    def reference(self) -> str:
        rounds = int(self.argv[3]) if len(self.argv) > 3 else 1
        return support.reference_output(self.argv, stdin=b"x" * rounds).decode()


def listing(proc: Any, where: str) -> kprobes.ProbeListing:
    (entry,) = [e for e in proc.list() if e.where == where]
    return entry


def raw(proc: Any, kp: kprobes.Kprobe, n: int = 5) -> bytes:
    assert kp.addr is not None
    return support.raw_read(proc.pid, kp.addr, n)


def file_code(exe: Path, name: str, n: int = 5) -> bytes:
    return support.file_bytes(exe, support.symbol(exe, name).value, n)


def test_shared_area_is_one_memfd_seen_from_both_sides(spawn, optimized, tmp_path):
    run = Run(spawn, optimized, tmp_path, 1, 10)
    proc = run.proc
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    proc.register_kprobe(kp)
    (area,) = proc._jumps.areas
    # No fd of ours is left in the program; its mapping of the memfd is.
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        assert "kprobes" not in os.readlink(f"/proc/{proc.pid}/fd/{fd}")
    # The area, then its ring's first pages again right after it (the mirror).
    mapped, mirror = [m for m in support.maps(proc.pid) if "kprobes-area" in m.path]
    assert mapped.start == area.addr and mirror.start == mapped.end == area.addr + area.layout.size
    assert mirror.offset == area.layout.ring_offset and mirror.end - mirror.start == sa.MIRROR
    area.mapping[area.layout.ring_offset : area.layout.ring_offset + 8] = b"mirrored"
    assert support.raw_read(proc.pid, mirror.start, 8) == b"mirrored"
    area.mapping[area.layout.ring_offset : area.layout.ring_offset + 8] = bytes(8)
    # A value written on one side is read on the other.
    area.mapping[5000:5008] = b"fromtool"
    assert support.raw_read(proc.pid, area.addr + 5000, 8) == b"fromtool"
    fd = os.open(f"/proc/{proc.pid}/mem", os.O_RDWR)
    try:
        os.pwrite(fd, b"fromprog", area.addr + 6000)
    finally:
        os.close(fd)
    assert area.mapping[6000:6008] == b"fromprog"
    area.mapping[5000:5008] = area.mapping[6000:6008] = bytes(8)
    run.finish()
    assert kp.nhit == 10


@pytest.mark.parametrize("threads", [1, 4])
def test_count_is_exact_with_no_trap_per_hit(spawn, optimized, tmp_path, threads):
    n = 200_000
    run = Run(spawn, optimized, tmp_path, threads, n)
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    run.proc.register_kprobe(kp)
    entry = listing(run.proc, "work+0x0")
    assert entry.is_optimized and "[OPTIMIZED]" in str(entry)
    assert raw(run.proc, kp, 1) == b"\xe9"  # a jmp rel32, no int3
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_nvcsw
    run.finish()
    # Every ptrace stop is a voluntary context switch of the stopped thread.
    switches = resource.getrusage(resource.RUSAGE_CHILDREN).ru_nvcsw - before
    assert switches / (threads * n) < 0.01, switches
    assert kp.nhit == threads * n
    assert run.output() == run.reference()


def test_detach_mid_run_leaves_the_original_code(spawn, optimized, tmp_path):
    n = 50_000
    run = Run(spawn, optimized, tmp_path, 4, n, 2)
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    run.proc.register_kprobe(kp)
    run.run_until("round 1")
    pid = run.proc.pid
    run.proc.detach()
    support.assert_untouched(pid, optimized)
    assert kp.nhit == 4 * n
    run.next_round()
    os.close(run.stdin)
    assert support.wait_child(pid, 30) == 0
    assert run.output() == run.reference()


def test_optimization_off_and_on_and_unregister_keep_counts_exact(spawn, optimized, tmp_path):
    n = 20_000
    run = Run(spawn, optimized, tmp_path, 4, n, 4)
    proc = run.proc
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    proc.register_kprobe(kp)
    original = file_code(optimized, "work")
    run.run_until("round 1")
    assert kp.nhit == 4 * n
    # Off: back to the int3 (the original code behind it), hits through traps.
    proc.optimization = False
    entry = listing(proc, "work+0x0")
    assert not entry.is_optimized and "proc.optimization" in entry.why_not_optimized
    assert raw(proc, kp) == b"\xcc" + original[1:]
    run.next_round()
    run.run_until("round 2")
    assert kp.nhit == 2 * 4 * n
    # On again: a jump, counted in the program.
    proc.optimization = True
    assert listing(proc, "work+0x0").is_optimized
    assert raw(proc, kp, 1) == b"\xe9"
    run.next_round()
    run.run_until("round 3")
    assert kp.nhit == 3 * 4 * n
    # Unregistered: the original bytes, and no more counting.
    proc.unregister_kprobe(kp)
    assert support.raw_read(proc.pid, support.runtime_address(proc.pid, optimized, "work"), 5) == (
        original
    )
    run.next_round()
    run.finish()
    assert kp.nhit == 3 * 4 * n
    assert run.output() == run.reference()


def test_a_refused_site_stays_a_trap_probe_and_says_why(spawn, optimized, tmp_path):
    run = Run(spawn, optimized, tmp_path, 1, 10, 3)
    tiny = kprobes.Kprobe(symbol="tiny", optimize=True)
    hot = kprobes.Kprobe(symbol="hot", optimize=True)
    handled = kprobes.Kprobe(symbol="work", optimize=True, pre_handler=lambda kp, regs: None)
    run.proc.register_kprobes([tiny, hot, handled])
    entry = listing(run.proc, "hot+0x0")
    assert not entry.is_optimized and "jumps into the region" in entry.why_not_optimized
    entry = listing(run.proc, "tiny+0x0")
    assert not entry.is_optimized and "the jump needs 5" in entry.why_not_optimized
    assert raw(run.proc, tiny, 1) == b"\xcc"
    entry = listing(run.proc, "work+0x0")
    assert not entry.is_optimized and "handler" in entry.why_not_optimized
    for _ in range(2):
        run.next_round()
    run.finish()
    assert tiny.nhit == hot.nhit == 3
    assert handled.nhit == 30
    assert run.output() == run.reference()


@pytest.mark.parametrize("follow", [False, True])
def test_a_fork_child_released_gets_the_original_code(spawn, optimized, tmp_path, follow):
    """A child that is let go gets the original bytes in its copy (breakpoints.restore_all);
    a followed one keeps the jump and counts into the same shared area (a MAP_SHARED memfd)."""
    n = 1000
    out = tmp_path / "out"
    argv = [optimized, 1, n, 1, "fork"]
    with open(out, "wb") as f:
        proc = spawn(argv, stdout=f.fileno(), follow_forks=follow)
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    proc.register_kprobe(kp)
    assert listing(proc, "work+0x0").is_optimized
    # The code as every analysis reads it: the jump undone.
    assert proc._tracer.breakpoints.original(proc._tracer.main, kp.addr, 5) == file_code(
        optimized, "work"
    )
    assert proc.run(timeout=30) and proc.exit_code == 0
    lines = out.read_text().splitlines()
    reference = support.reference_output(argv).decode().splitlines()
    (code,) = [line for line in lines if line.startswith("child code")]
    seen = bytes.fromhex(code.removeprefix("child code "))
    if follow:
        assert seen[0] == 0xE9  # our jump, counting into the shared area
        assert kp.nhit == 2 * n
    else:
        assert seen == file_code(optimized, "work")
        assert kp.nhit == n
    assert [x for x in lines if x != code] == [x for x in reference if "child code" not in x]


def test_library_probes_get_an_area_of_their_own(spawn, optimized, tmp_path):
    """Probes in libc, placed when the loader maps it, are optimized with a second shared area
    within their reach (the executable's is more than 2 GiB away)."""
    run = Run(spawn, optimized, tmp_path, 4, 1000, 2)
    names = ("work", "libc:pthread_create", "libc:pthread_join")
    kps = [kprobes.Kprobe(symbol=name, optimize=True) for name in names]
    run.proc.register_kprobes(kps)
    run.run_until("round 1")
    assert all(e.is_optimized for e in run.proc.list()), run.proc.list()
    assert len(run.proc._jumps.areas) == 2
    run.next_round()
    run.finish()
    assert [kp.nhit for kp in kps] == [8000, 8, 8]
    assert run.output() == run.reference()


def test_switching_while_threads_hammer_keeps_every_hit(spawn, optimized, tmp_path):
    """Optimize and unoptimize, over and over, while 4 threads call the probed function: no
    crash, no changed output, and not one hit lost or counted twice."""
    n = 3_000_000
    run = Run(spawn, optimized, tmp_path, 4, n)
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    run.proc.optimization = False  # trap phases are slow: start with one
    run.proc.register_kprobe(kp)
    switches = 0
    while not run.proc.run(timeout=0.005):
        run.proc.optimization = not run.proc.optimization
        switches += 1
    assert run.proc.exit_code == 0
    assert switches >= 4
    assert kp.nhit == 4 * n
    assert run.output() == run.reference()


_KILLED_TOOL = """
import sys, kprobes
proc = kprobes.attach(int(sys.argv[1]))
proc.register_kprobe(kprobes.Kprobe(symbol="work", optimize=True))
assert proc.list()[0].is_optimized
print("ready", flush=True)
proc.run()
"""


def test_the_program_keeps_counting_when_the_tool_is_killed(optimized, tmp_path):
    """SIGKILL leaves the jump, the detour and the area: the program carries on unharmed."""
    out = tmp_path / "out"
    argv = [str(optimized), "4", "100000", "2"]
    with open(out, "wb") as f:
        prog = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=f)
    try:
        support.wait_until(lambda: "round 1" in out.read_text(), 10, "round 1")
        tool = subprocess.Popen(
            [sys.executable, "-c", _KILLED_TOOL, str(prog.pid)],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(Path(kprobes.__file__).parents[1])},
        )
        assert tool.stdout is not None
        assert support.read_line(tool.stdout.fileno(), 20) == b"ready\n"
        tool.kill()
        tool.wait(10)
        work = support.runtime_address(prog.pid, optimized, "work")
        assert support.raw_read(prog.pid, work, 1) == b"\xe9"
        assert prog.stdin is not None
        prog.stdin.write(b"x")
        prog.stdin.close()
        assert prog.wait(30) == 0
    finally:
        if prog.poll() is None:
            prog.kill()
            prog.wait(10)
    assert out.read_text().encode() == support.reference_output(argv, stdin=b"x")


def test_exec_leaves_nothing_and_the_new_image_is_optimized_again(spawn, optimized, tmp_path):
    """At exec the jump, detours and area go with the old image; the probe, given by symbol,
    is placed in the new one and optimized there with an area of its own."""
    n = 10_000
    out = tmp_path / "out"
    argv = [optimized, 2, n, 1, "exec"]
    with open(out, "wb") as f:
        proc = spawn(argv, stdout=f.fileno())
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    proc.register_kprobe(kp)
    (first,) = proc._jumps.areas
    assert proc.run(timeout=30) and proc.exit_code == 0
    assert kp.nhit == 2 * 2 * n
    (area,) = proc._jumps.areas  # the old image's was forgotten at exec
    assert area is not first
    assert out.read_text().encode() == support.reference_output([str(a) for a in argv])


def test_disable_and_enable_keep_counts_exact(spawn, optimized, tmp_path):
    n = 20_000
    run = Run(spawn, optimized, tmp_path, 4, n, 3)
    kp = kprobes.Kprobe(symbol="work", optimize=True)
    run.proc.register_kprobe(kp)
    run.run_until("round 1")
    run.proc.disable_kprobe(kp)
    entry = listing(run.proc, "work+0x0")
    assert entry.is_disabled and not entry.is_optimized
    assert raw(run.proc, kp) == file_code(optimized, "work")
    run.next_round()
    run.run_until("round 2")
    run.proc.enable_kprobe(kp)
    assert listing(run.proc, "work+0x0").is_optimized
    run.next_round()
    run.finish()
    assert kp.nhit == 2 * 4 * n
    assert run.output() == run.reference()


def test_a_signal_frame_inside_the_region_delays_the_jump(spawn, optimized, tmp_path):
    """A thread in a signal handler will return into the middle of the region (faulty+3):
    the site waits as an int3 probe and is optimized once the handler has returned."""
    n = 1000
    run = Run(spawn, optimized, tmp_path, 1, n, 2, "signal")
    run.run_until("in handler")
    kp = kprobes.Kprobe(symbol="faulty", optimize=True)
    run.proc.register_kprobe(kp)
    entry = listing(run.proc, "faulty+0x0")
    assert not entry.is_optimized and "stack holds" in entry.why_not_optimized
    run.next_round()  # the handler returns to faulty+3, which still holds the original code
    run.run_until("round 1")
    assert listing(run.proc, "faulty+0x0").is_optimized
    run.next_round()
    run.finish()
    assert kp.nhit == n
    assert run.output() == run.reference()
