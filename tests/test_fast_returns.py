"""Optimized return probes (process/fast/returns.py, arch/x86_64/retstack.py): entry and return
without a trap, timed and counted in the program.

The programs are the trap tier's (tests/programs/rets.c, rets_cxx.cpp): each prints what its
calls computed, so an unchanged output says every return reached its real caller, and the
counts are exactly what its calls imply. Each test also checks the probe really ran on the
fast tier (``[OPTIMIZED]`` in the listing, no trap taken at its entry).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support
from test_retprobes import run_to_exit, start

from kprobes import Kretprobe

pytestmark = pytest.mark.ptrace

DRIVERS = Path(__file__).resolve().parent / "drivers"


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def optimized(proc: Any, rp: Kretprobe) -> bool:
    (entry,) = [e for e in proc.list() if e.addr == rp.addr]
    assert entry.kind == "r"
    assert entry.is_optimized, entry.why_not_optimized
    return "[OPTIMIZED]" in str(entry)


def register_on_tier(proc: Any, rp: Kretprobe, *, fast: bool) -> None:
    """``rp`` registered on the fast tier (its entry takes the jump) or on traps (the
    optimization off), and checked so."""
    if not fast:
        proc.optimization = False
    proc.register_kretprobe(rp)
    if fast:
        assert optimized(proc, rp)
    else:
        assert not [e for e in proc.list() if e.is_optimized]


def probed_run(
    spawn: Any, tmp_path: Path, argv: list[Any], *symbols: str, **kw: Any
) -> list[Kretprobe]:
    """``argv`` run to its end under an optimized return probe on each of ``symbols`` (each
    checked ``[OPTIMIZED]``); its output must be an unprobed run's."""
    proc, out = start(spawn, tmp_path, argv)
    rps = [Kretprobe(symbol=symbol, optimize=True, **kw) for symbol in symbols]
    proc.register_kretprobes(rps)
    for rp in rps:
        assert optimized(proc, rp)
    run_to_exit(proc, timeout=300)
    assert out.read_bytes() == support.reference_output(argv)
    return rps


def test_deep_recursion_counts_every_return_in_the_program(spawn, rets, tmp_path):
    depth = 10_000  # the kernel's uretprobes drop returns nested deeper than 64
    (rp,) = probed_run(spawn, tmp_path, [rets, "rec", depth], "rec")
    assert rp.nhit == depth + 1 and rp.nmissed == 0 and rp.nabandoned == 0
    assert rp.kp.nhit == depth + 1  # every entry, by the detour: no trap
    assert sum(rp.hist_slots) == depth + 1


def test_threads_recursing_10000_deep_count_every_return(spawn, rets, tmp_path):
    threads, calls, depth = 8, 2, 10_000
    (rp,) = probed_run(spawn, tmp_path, [rets, "threads", threads, calls, depth], "rec")
    total = threads * calls * (depth + 1)
    assert rp.nhit == total and rp.nmissed == 0 and rp.nabandoned == 0
    assert rp.kp.nhit == total


def test_maxactive_caps_the_calls_in_flight(spawn, rets, tmp_path):
    depth = 30
    (rp,) = probed_run(spawn, tmp_path, [rets, "rec", depth], "rec", maxactive=10)
    assert rp.nhit == 10 and rp.nmissed == depth + 1 - 10


@pytest.mark.parametrize("fast", [True, False], ids=["in-the-program", "on-traps"])
def test_maxactive_is_each_probes_own(spawn, rets, tmp_path, fast):
    """Two return probes on rec, each with 10 instances, and rec 30 deep: each hooks the
    outer 10 calls and misses the 21 below, on both tiers (the shadow stack holds both
    probes' entries, and neither takes the other's instances)."""
    depth = 30
    proc, out = start(spawn, tmp_path, [rets, "rec", depth])
    if not fast:
        proc.optimization = False
    probes = [Kretprobe(symbol="rec", optimize=True, maxactive=10) for _ in range(2)]
    proc.register_kretprobes(probes)
    entries = [e for e in proc.list() if e.addr == probes[0].addr]
    assert len(entries) == 2 and all(e.is_optimized == fast for e in entries)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "rec", depth])
    for rp in probes:
        assert rp.nhit == 10 and rp.nmissed == depth + 1 - 10 and rp.nabandoned == 0


def test_maxactive_is_shared_by_every_thread(spawn, rets, tmp_path):
    """Eight threads calling rec(5) over and over under a probe with 3 instances: at most 3
    calls hooked at once in the process (the kernel's pool), so some are missed; every
    call is either returned or missed, and the program's results are unchanged."""
    argv = [rets, "threads", 8, 300, 5]
    (rp,) = probed_run(spawn, tmp_path, argv, "rec", maxactive=3)
    calls = 8 * 300 * 6
    assert rp.kp.nhit == calls and rp.nhit + rp.nmissed == calls
    assert rp.nhit >= 3 and rp.nmissed >= 8 * 300 * 3  # no thread nests more than 3 of 6
    assert rp.nabandoned == 0


def test_tail_call_chains_both_trampolines_to_the_real_caller(spawn, rets, tmp_path):
    n = 10
    proc, out = start(spawn, tmp_path, [rets, "tail", n])
    ra = Kretprobe(symbol="tail_a", optimize=True)
    rb = Kretprobe(symbol="tail_b", optimize=True)
    proc.register_kretprobes([ra, rb])
    assert optimized(proc, rb)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "tail", n])
    assert ra.nhit == rb.nhit == n and ra.nabandoned == rb.nabandoned == 0


def test_longjmp_releases_vanished_frames_and_never_mispairs(spawn, rets, tmp_path):
    rounds = 5
    deep, leaf = probed_run(spawn, tmp_path, [rets, "longjmp", rounds], "deep", "leaf")
    # deep(6)..deep(0) never return: 7 frames a round, released by the next entry (the
    # last round's by leaf's), each counted once, by the probe whose frame it was (as the
    # trap tier counts an abandoned instance), whichever probe's entry found it.
    assert deep.nhit == 0 and leaf.nhit == 1
    assert deep.nabandoned == 7 * rounds and leaf.nabandoned == 0


def test_forked_child_returns_through_its_own_copy_of_the_shadow_stack(spawn, rets, tmp_path):
    proc, out = start(spawn, tmp_path, [rets, "fork"])
    rp = Kretprobe(symbol="forker", optimize=True)
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    run_to_exit(proc)
    assert sorted(out.read_text().splitlines()) == ["child back", "parent back child=7"]
    # Both returns went through the trampoline (the child's with its private copy), and the
    # counters are shared: the child's return is counted too.
    assert rp.kp.nhit == 1 and rp.nhit == 2 and rp.nabandoned == 0


def test_maxactive_after_forks_keeps_hooking(spawn, rets, tmp_path):
    """forker(1) forks inside, and both processes return through the hooked frame: each
    gives the instance back (the counters are shared), so the count goes below zero. The
    next calls must still be hooked (an unsigned compare refused every one after)."""
    (rp,) = probed_run(spawn, tmp_path, [rets, "forks", 3], "forker", maxactive=1)
    assert rp.kp.nhit == 3 and rp.nmissed == 0
    assert rp.nhit == 6  # each call returns twice: in the parent and in its child


def test_cxx_exceptions_through_optimized_return_probes(spawn, build, tmp_path):
    prog = build("rets_cxx")
    n = 8
    names = ("outer", "catcher", "thrower", "leaf")
    probes = dict(zip(names, probed_run(spawn, tmp_path, [prog, n], *names), strict=True))
    # The unwinder's guard puts the real return address back in every hooked frame of the
    # throwing thread: thrower's 6 frames a round are released, never reported; catcher and
    # outer survive the throw, are hooked again when the catch block begins, and return
    # through their trampolines, as the trap tier reports them (test_retprobes.py). Every
    # leaf() call returns: six from the Guard destructors during the unwinding, one in the
    # catch block.
    outer, catcher, thrower, leaf = (probes[name] for name in names)
    assert thrower.nhit == 0 and thrower.kp.nhit == 6 * n
    assert catcher.kp.nhit == catcher.nhit == n and outer.kp.nhit == outer.nhit == n
    assert leaf.nhit == leaf.kp.nhit == 7 * n
    # The last round's frames may stay unreleased; each is thrower's own.
    assert 6 * (n - 1) <= thrower.nabandoned <= 6 * n
    assert outer.nabandoned == catcher.nabandoned == leaf.nabandoned == 0
    assert all(rp.nmissed == 0 for rp in probes.values())


def block_until_bottom(spawn: Any, rets: Path, depth: int) -> tuple[Any, Kretprobe, int, int]:
    """rets block DEPTH under an optimized return probe on rec_block, run until every frame
    is hooked and the program waits at the bottom: (process, probe, its stdout, its stdin)."""
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    proc = spawn([rets, "block", depth], stdin=in_r, stdout=out_w)
    os.close(in_r)
    os.close(out_w)
    rp = Kretprobe(symbol="rec_block", optimize=True)
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    while rp.kp.nhit < depth + 1:
        proc.run(timeout=0.1)
    assert support.read_line(out_r, 10) == b"bottom\n"
    return proc, rp, out_r, in_w


def test_detach_with_hooked_frames_leaves_a_working_program(spawn, rets, tmp_path):
    depth = 20
    proc, _, out_r, in_w = block_until_bottom(spawn, rets, depth)
    proc.detach()  # 21 frames return through the trampoline's page: it must not be needed
    os.write(in_w, b"go\n")
    assert support.read_line(out_r, 10) == f"block={depth * (depth + 1) // 2 + 1}\n".encode()
    status = support.wait_child(proc.pid, 10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def probed_by_a_driver(popen: Any, argv: list[Any], *symbols: str) -> tuple[Any, Any]:
    """The program, waiting for a line, and a driver process holding optimized return
    probes on ``symbols`` in it (tests/drivers/return_until_killed.py), ready."""
    prog = popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    driver = popen(
        [sys.executable, DRIVERS / "return_until_killed.py", prog.pid, *symbols],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(DRIVERS.parent.parent)),
    )
    assert driver.stdout is not None
    line = support.read_line(driver.stdout.fileno(), timeout=60)
    assert line == b"ready\n", driver.communicate(timeout=5)[1].decode()[-2000:]
    return prog, driver


def test_tool_killed_with_returns_pending_leaves_a_working_program(popen, rets):
    depth = 50
    prog, driver = probed_by_a_driver(popen, [rets, "waitblock", depth], "rec_block")
    assert prog.stdin is not None and prog.stdout is not None
    prog.stdin.write(b"go\n")
    prog.stdin.flush()
    assert support.read_line(prog.stdout.fileno(), timeout=20) == b"bottom\n"
    driver.send_signal(signal.SIGKILL)  # 51 frames hooked, their tool gone
    driver.wait(timeout=10)
    out, err = prog.communicate(b"go\n", timeout=30)
    assert prog.returncode == 0, err.decode()[-2000:]
    want = depth * (depth + 1) // 2
    assert out == f"block={want + 1}\nrec={want}\n".encode()


def test_exceptions_unwind_hooked_frames_after_the_tools_death(popen, build):
    """The unwinder's in-program unhook (a jump on its entry points) works with no tool:
    every frame entered after the SIGKILL is hooked, and the exceptions still unwind."""
    prog_path = build("rets_cxx")
    n = 8
    argv = [prog_path, n, "wait"]
    prog, driver = probed_by_a_driver(popen, argv, "catcher", "thrower", "leaf")
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=10)
    out, err = prog.communicate(b"go\n", timeout=30)
    assert prog.returncode == 0, (prog.returncode, err.decode()[-2000:])
    assert out == support.reference_output(argv, stdin=b"go\n")


def test_optimization_off_puts_real_return_addresses_back_in_live_frames(spawn, rets):
    depth = 20
    proc, rp, out_r, in_w = block_until_bottom(spawn, rets, depth)
    proc.optimization = False  # the entry goes back to its int3; 21 frames unhooked
    assert not [e for e in proc.list() if e.is_optimized]
    os.write(in_w, b"go\n")
    assert proc.run(timeout=60) and proc.exit_code == 0
    assert support.read_line(out_r, 10) == f"block={depth * (depth + 1) // 2 + 1}\n".encode()
    assert rp.nhit == 0  # none came back through the trampoline


# -- the command line -----------------------------------------------------------------------


def histogram_total(stdout: str) -> int:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "distribution" in line)
    return sum(
        int(line.split(":")[1].split("|")[0]) for line in lines[header + 1 :] if "->" in line
    )


@pytest.mark.parametrize("optimize", [True, False], ids=["in-the-program", "no-optimize"])
def test_latency_times_every_call_of_threads_recursing_deep(rets, optimize):
    threads, calls, depth = 4, 2, 10_000
    argv = [rets, "threads", threads, calls, depth]
    flags = [] if optimize else ["--no-optimize"]
    r = support.cli("latency", *flags, "-c", " ".join(map(str, argv)), "rec", timeout=300)
    assert r.returncode == 0, r.stderr
    n = threads * calls * (depth + 1)
    assert histogram_total(r.stdout) == n
    assert f"count: {n}\n" in r.stdout
    assert support.reference_output(argv).decode() in r.stdout  # the program's own, unharmed
    assert "uses a breakpoint" not in r.stderr  # rec's entry takes the jump (or was not asked)
    assert f"{n} events, {n} hits, 0 missed" in r.stderr


def test_latency_says_why_a_return_probe_keeps_its_trap(rets):
    r = support.cli("latency", "-c", f"{rets} tail 10", "tail_a")
    assert r.returncode == 0, r.stderr
    # tail_a is `add; jmp tail_b`: the jump's five bytes would take the jmp.
    assert "tail_a_0 uses a breakpoint: a jump in the region" in r.stderr
    assert histogram_total(r.stdout) == 10


def test_latency_maxactive_caps_the_calls_in_flight_in_the_program(rets):
    """``--maxactive`` is one pool for every thread on both tiers (the threads' share of it
    is a matter of timing): one thread 50 deep keeps 20; four threads keep at least 20
    between them, and every call is timed or missed."""
    r = support.cli("latency", "--maxactive", 20, "-c", f"{rets} rec 50", "rec")
    assert r.returncode == 0, r.stderr
    assert "uses a breakpoint" not in r.stderr
    assert histogram_total(r.stdout) == 20
    assert "20 events, 20 hits, 31 missed" in r.stderr
    threads, depth = 4, 50
    r = support.cli(
        "latency", "--maxactive", 20, "-c", f"{rets} threads {threads} 1 {depth}", "rec"
    )
    assert r.returncode == 0, r.stderr
    timed = histogram_total(r.stdout)
    assert 20 <= timed <= threads * 20
    assert f"{timed} events, {timed} hits, {threads * (depth + 1) - timed} missed" in r.stderr


def test_threads_coming_and_going_are_each_counted(spawn, build, tmp_path):
    """100 rounds of 8 short-lived threads (800 threads, more than the 256 thread slots:
    glibc gives a joined thread's stack and thread pointer to the next one, which finds its
    slot again), every call of ``hot`` returned through the trampoline."""
    rounds, threads, calls = 100, 8, 50
    (rp,) = probed_run(spawn, tmp_path, [build("churn"), rounds, threads, calls], "hot")
    n = rounds * threads * calls
    assert rp.kp.nhit == n and rp.nhit == n and rp.nmissed == 0 and rp.nabandoned == 0


def test_signal_handlers_calling_the_probed_function_are_never_mispaired(spawn, rets, tmp_path):
    """A 1 ms timer's handler calls rec(3) while the main loop calls rec(5): a handler that
    interrupts an entry or a return in the middle of its shadow stack is not hooked (a miss),
    every other call is; the program's results stay right."""
    n = 2_000_000
    (rp,) = probed_run(spawn, tmp_path, [rets, "signals", n], "rec")
    assert rp.nabandoned == 0
    assert rp.nhit + rp.nmissed == rp.kp.nhit  # each entry hooked and returned, or missed
    assert rp.kp.nhit >= 6 * n


@pytest.mark.parametrize("kind", ["u64", "u32"])
def test_hist_of_return_values_aggregated_in_the_program_matches_the_traps(rets, kind):
    """``hist -H`` of ``$retval``: the program's log2 histogram of rec's return values
    (n(n+1)/2 for each n of 4 threads' recursions) is the trap tier's, slot for slot."""
    command = f"{rets} threads 4 3 200"
    spec = f"r rec ret=$retval:{kind}"
    fast = support.cli("hist", "-H", "-c", command, spec, "--key", "ret", timeout=300)
    traps = support.cli(
        "hist", "-H", "--no-optimize", "-c", command, spec, "--key", "ret", timeout=300
    )
    assert fast.returncode == traps.returncode == 0, fast.stderr + traps.stderr
    n = 4 * 3 * 201
    assert histogram_total(fast.stdout) == n
    assert fast.stdout == traps.stdout
    assert f"{n} events, {n} hits, 0 missed" in fast.stderr
    # r20 is the probe's pool, shared by every thread (docs/decisions.md, "maxactive on the
    # fast tier"): one thread hooks exactly 20 of each 201-deep descent; four threads whose
    # descents overlap (a loaded machine) share the 20, and every call is hooked or missed.
    r20 = f"r20 rec ret=$retval:{kind}"
    alone = support.cli("hist", "-H", "-c", f"{rets} threads 1 3 200", r20, "--key", "ret")
    assert histogram_total(alone.stdout) == 3 * 20, alone.stderr
    capped = support.cli("hist", "-H", "-c", command, r20, "--key", "ret")
    hooked = histogram_total(capped.stdout)
    assert 20 <= hooked <= 4 * 3 * 20, capped.stderr
    assert f"{hooked} events, {hooked} hits, {n - hooked} missed" in capped.stderr, capped.stderr


def test_exec_gives_the_new_image_its_own_shadow_stacks_and_trampolines(spawn, build, tmp_path):
    """procs exec 25 40: work() 25 times, exec itself, work() 40 times: the return probe is
    placed and optimized again in the new image, with new memory of its own (the old
    image's addresses mean nothing there)."""
    argv = [build("procs"), "exec", 25, 40]
    read_end, write_end = os.pipe()
    try:
        proc, out = start(spawn, tmp_path, argv, stdin=read_end)
    finally:
        os.close(read_end)
    try:
        rp = Kretprobe(symbol="work", optimize=True)
        proc.register_kretprobe(rp)
        assert optimized(proc, rp)
        while b"phase2 ready\n" not in out.read_bytes():
            assert proc.run(timeout=0.05) is False
        proc.run(timeout=0.2)  # the new image's sweep
        assert optimized(proc, rp)  # in the new image
    finally:
        os.close(write_end)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output(argv)
    assert rp.nhit == 65 and rp.nmissed == 0 and rp.nabandoned == 0


def test_vfork_children_return_through_the_parents_shadow_stack(spawn, build, tmp_path):
    """procs vfork 15: two vfork children call work() in the parent's memory, on its
    thread pointer and below its stack pointer: their frames come and go on the parent's
    shadow stack, above its entries."""
    (rp,) = probed_run(spawn, tmp_path, [build("procs"), "vfork", 15], "work")
    assert rp.nmissed == 0 and rp.nabandoned == 0 and rp.nhit == rp.kp.nhit >= 30


def test_a_return_probe_registered_again_counts_into_its_own_counters(spawn, build, tmp_path):
    """optimized.c 2 1000 3: 2 threads call work() 1000 times a round. A return probe for
    round 1, none for round 2, a new one for round 3: each counts its own round."""
    from test_optimized import Run

    run = Run(spawn, build("optimized"), tmp_path, 2, 1000, 3)
    first = Kretprobe(symbol="work", optimize=True)
    run.proc.register_kretprobe(first)
    assert optimized(run.proc, first)
    run.run_until("round 1")
    run.proc.unregister_kretprobe(first)
    run.next_round()
    run.run_until("round 2")
    again = Kretprobe(symbol="work", optimize=True)
    run.proc.register_kretprobe(again)
    assert optimized(run.proc, again)
    run.next_round()
    run.finish()
    assert run.output() == run.reference()
    assert first.nhit == first.kp.nhit == 2000
    assert again.nhit == again.kp.nhit == 2000


def test_trace_of_a_return_reading_the_entrys_memory_says_it_keeps_its_trap(rets):
    spec = "r leaf x=+0($arg1):u8"  # the entry's memory: only a trap at the entry reads it
    r = support.cli("trace", "-c", f"{rets} leaf 3", spec)
    assert r.returncode == 0, r.stderr
    assert "r_leaf_0 uses a breakpoint: a fetch-arg reads $argN's memory" in r.stderr
    assert r.stdout.count("<- leaf) x=") == 3
    fast = support.cli("trace", "-c", f"{rets} leaf 3", "r leaf x=$arg1")
    assert "uses a breakpoint" not in fast.stderr  # recorded at the return, in the program
    assert fast.stdout.count("<- leaf) x=0x") == 3
    quiet = support.cli("trace", "--no-optimize", "-c", f"{rets} leaf 3", spec)
    assert "uses a breakpoint" not in quiet.stderr  # no jump was asked for


def test_coroutines_switching_stacks_under_hooked_frames_return_home(spawn, rets, tmp_path):
    """rets coro: coroutine A's 4 hooked frames (on the lower stack) are released as vanished
    when B's co_work enters above them; A's returns find their addresses in the thread's
    lost ring (the trap tier's ``Thread.lost``), uncounted, and the program runs on."""
    rounds = 50
    (rp,) = probed_run(spawn, tmp_path, [rets, "coro", rounds], "co_work")
    assert support.reference_output([rets, "coro", rounds]) == (
        f"coro a={4 * rounds} b={4 * rounds}\n".encode()
    )
    assert rp.kp.nhit == 8 * rounds
    assert rp.nhit == 4 * rounds and rp.nabandoned == 4 * rounds  # B's counted, A's released
