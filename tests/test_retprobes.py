"""Return probes (the document's §1.3, §4.3) on live processes, where the anchors break.

Each test runs a real program (tests/programs/rets.c, rets_cxx.cpp) under kretprobes and checks
three things: the program's output is the same as an unprobed run; every reported return is
paired with its own entry (the entry handler stores the argument in ``ri.data``, the return
handler checks the return value the program computes from it); and the counters
(``nhit``, ``nmissed``, ``nabandoned``) are exactly what the program's calls imply.
"""

from __future__ import annotations

import errno
import os
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes import Kretprobe, errors

pytestmark = pytest.mark.ptrace


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def start(
    spawn: Callable[..., Any], tmp_path: Path, argv: list[Any], **kw: Any
) -> tuple[Any, Path]:
    out = tmp_path / f"stdout.{len(list(tmp_path.iterdir()))}"
    with open(out, "wb") as f:
        proc = spawn(argv, stdout=f, **kw)
    return proc, out


def run_to_exit(proc: Any, timeout: float = 60) -> None:
    assert proc.run(timeout=timeout), f"program {proc.pid} did not exit within {timeout} s"
    assert proc.exit_code == 0


class Recorder:
    """Entry handler stores rdi in ri.data; the return handler records (arg, retval, tid)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int]] = []  # (tid, arg)
        self.returns: list[tuple[int, int, int, int]] = []  # (tid, arg, retval, ret_addr)

    def entry(self, ri: Any, regs: Any) -> None:
        assert regs.ip == ri.probe.addr
        struct.pack_into("<q", ri.data, 0, regs.rdi)
        self.entries.append((ri.task.tid, regs.rdi))

    def ret(self, ri: Any, regs: Any) -> None:
        arg = struct.unpack_from("<q", ri.data, 0)[0]
        assert regs.ip == ri.ret_addr, "handlers see ip at the real return address"
        self.returns.append((ri.task.tid, arg, regs.return_value, ri.ret_addr))

    def probe(self, symbol: str, **kw: Any) -> Kretprobe:
        return Kretprobe(
            symbol=symbol, handler=self.ret, entry_handler=self.entry, data_size=8, **kw
        )


def code_range(pid: int, path: Path, name: str) -> range:
    sym = support.symbol(path, name)
    start = support.runtime_address(pid, path, name)
    return range(start, start + sym.size)


# ---------------------------------------------------------------------------------------------
# The basics


def test_every_call_reports_its_return_value_and_real_return_address(spawn, rets, tmp_path):
    n = 40
    proc, out = start(spawn, tmp_path, [rets, "leaf", n])
    rec = Recorder()
    rp = rec.probe("leaf")
    proc.register_kretprobe(rp)
    main = code_range(proc.pid, rets, "main")
    assert rp.addr == support.runtime_address(proc.pid, rets, "leaf")
    listing = proc.list()
    assert [(e.kind, e.where) for e in listing] == [("r", "leaf+0x0")]
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "leaf", n])
    assert [(a, r) for _, a, r, _ in rec.returns] == [(i, 2 * i + 1) for i in range(n)]
    assert all(addr in main for *_, addr in rec.returns)
    assert rp.nhit == n and rp.nmissed == 0 and rp.nabandoned == 0
    assert {tid for tid, *_ in rec.returns} == {proc.pid}


def test_deep_recursion_pairs_every_return_with_its_own_entry(spawn, rets, tmp_path):
    depth = 10_000  # the kernel's uretprobes drop returns nested deeper than 64
    proc, out = start(spawn, tmp_path, [rets, "rec", depth])
    rec = Recorder()
    rp = rec.probe("rec", maxactive=depth + 1)
    proc.register_kretprobe(rp)
    run_to_exit(proc, timeout=120)
    assert out.read_bytes() == f"rec={depth * (depth + 1) // 2}\n".encode()
    # Returns come innermost first, each with n(n+1)/2 for its own n.
    assert [(a, r) for _, a, r, _ in rec.returns] == [
        (k, k * (k + 1) // 2) for k in range(depth + 1)
    ]
    assert rp.nhit == depth + 1 and rp.nmissed == 0 and rp.nabandoned == 0


def test_maxactive_bounds_instances_and_nmissed_counts_the_rest(spawn, rets, tmp_path):
    depth = 30
    proc, out = start(spawn, tmp_path, [rets, "rec", depth])
    rec = Recorder()
    rp = rec.probe("rec", maxactive=10)
    proc.register_kretprobe(rp)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "rec", depth])
    # The 10 outermost calls took the instances; the 21 deeper ones found none, and their
    # entry handler was skipped (as the document says).
    assert rp.nmissed == depth + 1 - 10
    assert [a for _, a in rec.entries] == list(range(depth, depth - 10, -1))
    assert [(a, r) for _, a, r, _ in rec.returns] == [
        (k, k * (k + 1) // 2) for k in range(depth - 9, depth + 1)
    ]


def test_default_maxactive_is_at_least_ten(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "rec", 30])
    rp = Kretprobe(symbol="rec", maxactive=0)
    proc.register_kretprobe(rp)
    assert rp.pool is not None and rp.pool.size >= 10
    run_to_exit(proc)
    assert rp.nhit == rp.pool.size and rp.nmissed == 31 - rp.pool.size


def test_entry_handler_returning_true_cancels_the_return_hook(spawn, rets, tmp_path):
    n = 20
    proc, out = start(spawn, tmp_path, [rets, "leaf", n])
    seen: list[int] = []
    rp = Kretprobe(
        symbol="leaf",
        entry_handler=lambda ri, regs: regs.rdi % 2 == 1,  # decline odd arguments
        handler=lambda ri, regs: seen.append(regs.return_value),
    )
    proc.register_kretprobe(rp)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "leaf", n])
    assert seen == [2 * i + 1 for i in range(0, n, 2)]
    assert rp.nmissed == 0


def test_kprobe_and_kretprobe_on_one_function_both_fire_in_registration_order(
    spawn, rets, tmp_path
):
    proc, _ = start(spawn, tmp_path, [rets, "leaf", 3])
    order: list[str] = []
    kp = kprobes.Kprobe(symbol="leaf", pre_handler=lambda p, r: order.append("k"))
    rp = Kretprobe(
        symbol="leaf",
        entry_handler=lambda ri, r: order.append("e"),
        handler=lambda ri, r: order.append("r"),
    )
    proc.register_kretprobe(rp)
    proc.register_kprobe(kp)
    assert sorted(e.kind for e in proc.list()) == ["k", "r"]
    run_to_exit(proc)
    assert order == ["e", "k", "r"] * 3
    assert kp.nhit == 3 and rp.nhit == 3


def test_disable_and_enable_kretprobe(spawn, rets, tmp_path):
    proc, out = start(spawn, tmp_path, [rets, "rec", 3])
    rp = Kretprobe(symbol="rec")
    proc.register_kretprobe(rp)
    proc.disable_kretprobe(rp)
    assert [e.is_disabled for e in proc.list()] == [True]
    addr = rp.addr
    assert addr is not None
    original = support.file_bytes(rets, support.symbol(rets, "rec").value, 1)
    assert support.raw_read(proc.pid, addr, 1) == original
    proc.enable_kretprobe(rp)
    assert [e.is_disabled for e in proc.list()] == [False]
    assert support.raw_read(proc.pid, addr, 1) == b"\xcc"
    run_to_exit(proc)
    assert out.read_bytes() == b"rec=6\n"
    assert rp.nhit == 4


# ---------------------------------------------------------------------------------------------
# Where return addresses are not what they seem


def test_tail_call_reports_both_returns_to_the_real_caller(spawn, rets, tmp_path):
    n = 10
    proc, out = start(spawn, tmp_path, [rets, "tail", n])
    got: list[tuple[str, int, int]] = []
    ra = Kretprobe(
        symbol="tail_a", handler=lambda ri, r: got.append(("a", r.return_value, ri.ret_addr))
    )
    rb = Kretprobe(
        symbol="tail_b", handler=lambda ri, r: got.append(("b", r.return_value, ri.ret_addr))
    )
    proc.register_kretprobes([ra, rb])
    main = code_range(proc.pid, rets, "main")
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "tail", n])
    # tail_a jumps into tail_b: one real return serves both; the newest (tail_b) is first.
    expect = []
    for i in range(n):
        expect += [("b", (i + 1) * 3), ("a", (i + 1) * 3)]
    assert [(w, v) for w, v, _ in got] == expect
    assert all(addr in main for *_, addr in got)
    assert ra.nhit == rb.nhit == n and ra.nabandoned == rb.nabandoned == 0


def test_longjmp_abandons_instances_and_never_mispairs(spawn, rets, tmp_path):
    rounds = 5
    proc, out = start(spawn, tmp_path, [rets, "longjmp", rounds])
    rec = Recorder()
    deep = rec.probe("deep", maxactive=100)
    leaf = rec.probe("leaf")
    proc.register_kretprobes([deep, leaf])
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([rets, "longjmp", rounds])
    # deep(6)..deep(0) never return: each round leaves 7 instances behind, found abandoned
    # by the next entry (the last round's by leaf's entry).
    assert deep.nhit == 0
    assert deep.nabandoned == 7 * rounds
    assert deep.pool is not None and deep.pool.in_flight == 0
    assert [(a, r) for _, a, r, _ in rec.returns] == [(1, 3)]  # leaf(1), and nothing else
    assert leaf.nhit == 1 and leaf.nabandoned == 0


def test_cxx_exceptions_through_probed_frames(spawn, build, tmp_path):
    prog = build("rets_cxx")
    n = 8
    proc, out = start(spawn, tmp_path, [prog, n])
    counts: Counter[str] = Counter()
    values: dict[str, list[int]] = {"outer": [], "catcher": []}

    def on_return(name: str) -> Callable[[Any, Any], None]:
        def handler(ri: Any, regs: Any) -> None:
            counts[name] += 1
            if name in values:
                values[name].append(regs.return_value)

        return handler

    probes = {
        name: Kretprobe(symbol=name, handler=on_return(name), maxactive=64)
        for name in ("outer", "catcher", "thrower", "leaf")
    }
    proc.register_kretprobes(list(probes.values()))
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([prog, n])
    # thrower's six frames per round are unwound by the exception: abandoned, never reported;
    # catcher and outer survive the throw and return normally; every leaf() call returns
    # (six from the Guard destructors during the unwinding, one in the catch block).
    assert counts["thrower"] == 0
    assert probes["thrower"].nabandoned == 6 * n
    assert values["catcher"] == [i * 10 + i + 1 for i in range(n)]
    assert values["outer"] == [i * 11 + 2 for i in range(n)]
    assert counts["leaf"] == 7 * n
    assert all(p.nmissed == 0 for p in probes.values())
    assert [e.kind for e in proc.list()] == ["r"] * 4  # the unwinder guards are not listed


def test_threads_pair_every_entry_with_exactly_one_return(spawn, rets, tmp_path):
    threads, calls, depth = 8, 20, 12
    proc, out = start(spawn, tmp_path, [rets, "threads", threads, calls, depth])
    rec = Recorder()
    rp = rec.probe("rec", maxactive=threads * (depth + 1))
    proc.register_kretprobe(rp)
    run_to_exit(proc, timeout=120)
    assert out.read_bytes() == support.reference_output([rets, "threads", threads, calls, depth])
    per_call = depth + 1
    assert rp.nhit == threads * calls * per_call and rp.nmissed == 0 and rp.nabandoned == 0
    entries = Counter(rec.entries)
    returns = Counter((tid, arg) for tid, arg, _, _ in rec.returns)
    assert entries == returns
    assert len({tid for tid, _ in entries}) == threads
    assert all(r == a * (a + 1) // 2 for _, a, r, _ in rec.returns)


def test_forked_child_returns_through_real_addresses(spawn, rets, tmp_path):
    proc, out = start(spawn, tmp_path, [rets, "fork"])
    got: list[int] = []
    rp = Kretprobe(symbol="forker", handler=lambda ri, r: got.append(r.return_value))
    proc.register_kretprobe(rp)
    run_to_exit(proc)
    assert sorted(out.read_text().splitlines()) == ["child back", "parent back child=7"]
    assert got == [7]  # the parent's return; the unfollowed child's is not ours


# ---------------------------------------------------------------------------------------------
# Leaving while calls are in flight


def test_unregister_with_calls_in_flight_restores_every_frame(spawn, rets, tmp_path):
    depth = 20
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    proc = spawn([rets, "block", depth], stdin=in_r, stdout=out_w)
    os.close(in_r)
    os.close(out_w)
    rec = Recorder()
    rp = rec.probe("rec_block", maxactive=100)
    proc.register_kretprobe(rp)
    while True:  # run until the program blocks at the bottom of the recursion
        proc.run(timeout=0.1)
        if len(rec.entries) == depth + 1:
            break
    assert support.read_line(out_r, 10) == b"bottom\n"
    assert rp.pool is not None and rp.pool.in_flight == depth + 1
    proc.unregister_kretprobe(rp)
    assert proc.list() == []
    os.write(in_w, b"go\n")
    run_to_exit(proc)
    assert support.read_line(out_r, 10) == f"block={depth * (depth + 1) // 2 + 1}\n".encode()
    assert rec.returns == []


def test_detach_with_calls_in_flight_leaves_a_working_program(spawn, rets, tmp_path):
    depth = 20
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    proc = spawn([rets, "block", depth], stdin=in_r, stdout=out_w)
    os.close(in_r)
    os.close(out_w)
    rp = Kretprobe(symbol="rec_block", maxactive=100)
    proc.register_kretprobe(rp)
    while rp.pool is None or rp.pool.in_flight < depth + 1:
        proc.run(timeout=0.1)
    assert support.read_line(out_r, 10) == b"bottom\n"
    proc.detach()
    os.write(in_w, b"go\n")
    assert support.read_line(out_r, 10) == f"block={depth * (depth + 1) // 2 + 1}\n".encode()
    status = support.wait_child(proc.pid, 10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, nothing registered, nothing patched


def test_kretprobe_not_at_function_entry_is_refused(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "leaf", 1])
    leaf = support.runtime_address(proc.pid, rets, "leaf")
    second = support.boundaries(rets, "leaf")[1]
    before = support.raw_read(proc.pid, leaf, 16)
    rp = Kretprobe(symbol="leaf", offset=second)
    with pytest.raises(errors.ProbeRejected, match="function entry") as info:
        proc.register_kretprobe(rp)
    assert info.value.errno == errno.EINVAL
    assert not rp.is_registered and proc.list() == []
    assert support.raw_read(proc.pid, leaf, 16) == before
    run_to_exit(proc)


def test_negative_data_size_is_refused(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "leaf", 1])
    with pytest.raises(errors.ProbeRejected, match="data_size"):
        proc.register_kretprobe(Kretprobe(symbol="leaf", data_size=-1))
    assert proc.list() == []
    run_to_exit(proc)


def test_batch_rolls_back_when_one_kretprobe_fails(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "leaf", 1])
    good = Kretprobe(symbol="leaf")
    bad = Kretprobe(symbol="no_such_function")
    with pytest.raises(errors.SymbolNotFound):
        proc.register_kretprobes([good, bad])
    assert not good.is_registered and proc.list() == []
    run_to_exit(proc)
