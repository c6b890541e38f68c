"""Process life cycle under probes: fork, vfork, posix_spawn, exec, exit, and a probed Python.

tests/programs/procs.c calls work() a known number of times in the parent and in its
children, so each count is exact.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes

pytestmark = pytest.mark.ptrace


@pytest.fixture
def procs(build: Callable[[str], Path]) -> Path:
    return build("procs")


class Hits:
    """Pre handler recording (tid, first argument) of every hit."""

    def __init__(self) -> None:
        self.hits: list[tuple[int, int]] = []

    def __call__(self, p: Any, regs: Any) -> None:
        self.hits.append((regs.tid, regs.rdi))

    def args_of(self, tid: int) -> list[int]:
        return [a for t, a in self.hits if t == tid]


def start(spawn: Callable[..., Any], tmp_path: Path, argv: list[Any], **kw: Any) -> Any:
    with open(tmp_path / "stdout", "wb") as fo, open(tmp_path / "stderr", "wb") as fe:
        return spawn(argv, stdout=fo, stderr=fe, **kw)


def output(tmp_path: Path) -> bytes:
    return (tmp_path / "stdout").read_bytes()


def child_pid(tmp_path: Path) -> int:
    m = re.search(rb"child pid=(\d+)", (tmp_path / "stderr").read_bytes())
    assert m is not None
    return int(m.group(1))


def entry_records(into: list[tuple[int, int]]) -> kprobes.Kprobe:
    """A jump-optimized record probe on ``work``: (tid, its argument) of each call."""
    return kprobes.Kprobe(
        symbol="work",
        optimize=True,
        async_handler=lambda _, ev: into.append((ev.tid, ev.args[0].value)),
        args="x=%di:s64",
    )


def return_records(into: list[tuple[int, int]]) -> kprobes.Kretprobe:
    """A return probe on ``work`` recording in the program: (tid, the value returned)."""
    return kprobes.Kretprobe(
        symbol="work",
        optimize=True,
        async_handler=lambda _, ev: into.append((ev.tid, ev.args[0].value)),
        args="ret=$retval:s64",
    )


# ---------------------------------------------------------------------------------------------
# fork


def test_fork_child_is_released_and_not_counted(spawn, procs, tmp_path):
    argv = [procs, "fork", 20, 30, 10]
    expected = support.reference_output(argv)
    proc = start(spawn, tmp_path, argv)
    hits = Hits()
    kp = kprobes.Kprobe(symbol="work", pre_handler=hits)
    proc.register_kprobe(kp)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    assert b"child exit=0\n" in expected
    assert kp.nhit == 30  # 20 before the fork, 10 after; none of the child's 30
    assert hits.args_of(proc.pid) == list(range(20)) + list(range(2000, 2010))
    assert {t for t, _ in hits.hits} == {proc.pid}


def test_follow_forks_counts_the_child(spawn, procs, tmp_path):
    argv = [procs, "fork", 20, 30, 10]
    expected = support.reference_output(argv)
    proc = start(spawn, tmp_path, argv, follow_forks=True)
    hits = Hits()
    kp = kprobes.Kprobe(symbol="work", pre_handler=hits)
    proc.register_kprobe(kp)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    child = child_pid(tmp_path)
    assert kp.nhit == 60
    assert hits.args_of(proc.pid) == list(range(20)) + list(range(2000, 2010))
    assert hits.args_of(child) == list(range(1000, 1030))
    assert {t for t, _ in hits.hits} == {proc.pid, child}


def test_a_probe_registered_after_a_fork_gets_its_page_in_the_child(spawn, procs, tmp_path):
    """The first probes are registered once a followed child exists: the page of ours they
    need (the return trampoline's), mapped by the parent after the fork, is mapped at the
    same address in the child too (the registration failed with EIO writing the child's
    copy). Both processes count every call and every return."""
    argv = [procs, "forkwait", 30, 10]
    child_sum = sum(3 * x + 2 for x in range(1000, 1030))
    parent_sum = sum(3 * x + 2 for x in range(2000, 2010))
    expected = f"child sum={child_sum}\nchild exit=0\nparent after={parent_sum}\n".encode()
    proc = start(spawn, tmp_path, argv, follow_forks=True)
    deadline = time.monotonic() + 30
    while b"child pid=" not in (tmp_path / "stderr").read_bytes():
        assert time.monotonic() < deadline, "the program did not fork"
        proc.run(timeout=0.05)
    child = child_pid(tmp_path)
    assert child in proc._tracer.tracees
    hits = Hits()
    returns: list[tuple[int, int]] = []
    kp = kprobes.Kprobe(symbol="work", pre_handler=hits)
    rp = kprobes.Kretprobe(
        symbol="work", handler=lambda ri, regs: returns.append((regs.tid, regs.return_value))
    )
    proc.register_kprobe(kp)
    proc.register_kretprobe(rp)  # its trampoline is an int3 in the page of ours
    os.kill(child, signal.SIGUSR1)
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    assert hits.args_of(child) == list(range(1000, 1030))
    assert hits.args_of(proc.pid) == list(range(2000, 2010))
    assert [r for t, r in returns if t == child] == [3 * x + 2 for x in range(1000, 1030)]
    assert [r for t, r in returns if t == proc.pid] == [3 * x + 2 for x in range(2000, 2010)]


def test_follow_forks_records_in_the_program_name_the_child_apart(spawn, procs, tmp_path):
    """Records written in the program (jump-optimized entry and return probes): a fork child
    writes into its parent's ring (the shared area is shared) with its parent's thread
    pointer, and its own thread salt keeps its records its own: each process's events carry
    its own arguments, after the fork as before."""
    argv = [procs, "fork", 20, 30, 10]
    expected = support.reference_output(argv)
    proc = start(spawn, tmp_path, argv, follow_forks=True)
    entries: list[tuple[int, int]] = []
    returns: list[tuple[int, int]] = []
    proc.register_kprobe(entry_records(entries))
    proc.register_kretprobe(return_records(returns))
    assert all(e.is_optimized for e in proc.list()), proc.list()
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    child = child_pid(tmp_path)
    parent_x = list(range(20)) + list(range(2000, 2010))
    child_x = list(range(1000, 1030))
    assert [x for t, x in entries if t == proc.pid] == parent_x
    assert [x for t, x in entries if t == child] == child_x
    assert [r for t, r in returns if t == proc.pid] == [3 * x + 2 for x in parent_x]
    assert [r for t, r in returns if t == child] == [3 * x + 2 for x in child_x]
    assert {t for t, _ in entries + returns} == {proc.pid, child}


# ---------------------------------------------------------------------------------------------
# vfork and posix_spawn: the child runs in the parent's memory, probes and all


def test_vfork_children_run_fine(spawn, procs, tmp_path):
    argv = [procs, "vfork", 15]
    expected = support.reference_output(argv)
    assert b"vfork+exec child exit=0\n" in expected
    assert b"vfork+_exit child exit=5\n" in expected
    proc = start(spawn, tmp_path, argv)
    hits = Hits()
    kp = kprobes.Kprobe(symbol="work", pre_handler=hits)
    proc.register_kprobe(kp)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    assert hits.args_of(proc.pid) == list(range(15)) + list(range(2000, 2015))
    # The children's calls (500, 600) hit the breakpoints they share with the parent; whether
    # they are counted is the tracer's choice, but they must be theirs, not the parent's.
    assert kp.nhit in (30, 31, 32)
    assert sorted(a for t, a in hits.hits if t != proc.pid) in ([], [500], [600], [500, 600])


def test_records_after_a_vfork_name_the_parent_again(spawn, procs, tmp_path):
    """A vfork child runs on its parent's stack with its parent's thread pointer, so records
    written in the program name it as they name its parent. The child's own are its own
    (learnt at its first stop); once the parent is back (PTRACE_EVENT_VFORK_DONE, read
    first) they are the parent's again: they were the last child's until then."""
    argv = [procs, "vfork", 15]
    expected = support.reference_output(argv)
    proc = start(spawn, tmp_path, argv)
    seen: list[tuple[int, int]] = []
    proc.register_kprobe(entry_records(seen))
    assert proc.list()[0].is_optimized, proc.list()
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    assert [x for t, x in seen if t == proc.pid] == list(range(15)) + list(range(2000, 2015))
    children = [(t, x) for t, x in seen if t != proc.pid]
    assert [x for _, x in children] == [500, 600]
    assert len({t for t, _ in children}) == 2


def test_a_vfork_in_a_fork_child_is_named_in_its_memory(spawn, procs, tmp_path):
    """A grandchild vforked by a followed fork child runs in the child's memory, whose
    thread salt its records carry: they name it, then the child again, never another."""
    argv = [procs, "forkvfork"]
    expected = support.reference_output(argv)
    proc = start(spawn, tmp_path, argv, follow_forks=True)
    seen: list[tuple[int, int]] = []
    proc.register_kprobe(entry_records(seen))
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    child = child_pid(tmp_path)
    assert [x for t, x in seen if t == proc.pid] == [2000, 2001, 2002]
    assert [x for t, x in seen if t == child] == [1000, 1001, 1002]
    others = [(t, x) for t, x in seen if t not in (proc.pid, child)]
    assert [x for _, x in others] == [500] and others[0][0] > 0


def test_posix_spawn_children_run_fine(spawn, procs, tmp_path):
    argv = [procs, "spawn", 12]
    expected = support.reference_output(argv)
    assert expected.count(b"exit=0\n") == 3
    proc = start(spawn, tmp_path, argv)
    hits = Hits()
    work = kprobes.Kprobe(symbol="work", pre_handler=hits)
    # glibc's posix_spawn child calls execve() on the parent's stack, in the parent's memory.
    execve_hits = Hits()
    execve = kprobes.Kprobe(symbol="libc:execve", pre_handler=execve_hits)
    proc.register_kprobes([work, execve])
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == expected
    assert work.nhit == 36
    assert hits.args_of(proc.pid) == [i * 1000 + j for i in range(3) for j in range(12)]
    assert proc.pid not in {t for t, _ in execve_hits.hits}


# ---------------------------------------------------------------------------------------------
# A probed Python interpreter running a subprocess


def test_probed_python_runs_subprocesses(spawn, tmp_path):
    code = (
        "import os, subprocess\n"
        "r = subprocess.run(['true'])\n"
        "print('true', r.returncode)\n"
        "r = subprocess.run(['sh', '-c', 'exit 3'])\n"
        "print('sh', r.returncode)\n"
        "pid = os.getpid()\n"
        "print('same', all(os.getpid() == pid for _ in range(1000)))\n"
    )
    proc = start(spawn, tmp_path, [sys.executable, "-c", code])
    getpid = kprobes.Kprobe(symbol="libc:getpid")
    # Run by the vfork()ed children of subprocess, in the interpreter's memory.
    execve = kprobes.Kprobe(symbol="libc:execve")
    proc.register_kprobes([getpid, execve])
    assert proc.run(timeout=60)
    assert proc.exit_code == 0
    assert output(tmp_path) == b"true 0\nsh 3\nsame True\n"
    assert 1001 <= getpid.nhit <= 1100


# ---------------------------------------------------------------------------------------------
# exec: the probes are placed again in the new image; exit: they are GONE


def test_exec_places_probes_again_in_the_new_image(spawn, procs, tmp_path):
    read_end, write_end = os.pipe()
    try:
        proc = start(spawn, tmp_path, [procs, "exec", 25, 40], stdin=read_end)
    finally:
        os.close(read_end)
    try:
        kp = kprobes.Kprobe(symbol="work")
        other = kprobes.Kprobe(symbol="main", disabled=True)
        gone = kprobes.Kprobe(symbol="libkpt:lib_work")  # pending: procs never maps it
        proc.register_kprobes([kp, other, gone])
        first_addr = kp.addr
        # Run until the new image has printed its first line and waits on stdin.
        for _ in range(200):
            if b"phase2 ready\n" in output(tmp_path):
                break
            assert proc.run(timeout=0.05) is False
        assert output(tmp_path) == b"phase1 sum=950\nphase2 ready\n"
        assert kp.nhit == 25
        entries = sorted(proc.list(), key=lambda e: e.where)
        assert [(e.where, e.is_gone, e.is_pending) for e in entries] == [
            ("libkpt:lib_work", False, True),
            ("main+0x0", False, False),
            ("work+0x0", False, False),
        ]
        assert "[DISABLED]" in str(entries[1])
        # The same file, a new image: placed again (ASLR moves it).
        assert kp.addr == support.runtime_address(proc.pid, procs, "work")
        assert first_addr is not None
    finally:
        os.close(write_end)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert output(tmp_path) == b"phase1 sum=950\nphase2 ready\nphase2 sum=14420\n"
    assert kp.nhit == 25 + 40  # the new image's calls too, as the kernel's uprobes count them
    assert other.nhit == 0


def test_exit_makes_probes_gone(spawn, procs, tmp_path):
    proc = start(spawn, tmp_path, [procs, "exit", 3])
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    assert proc.exit_code is None
    assert proc.run(timeout=30) is True
    assert proc.exit_code == 3
    assert kp.nhit == 3
    assert output(tmp_path) == b"works=15\n"
    (entry,) = proc.list()
    assert entry.is_gone
    assert "[GONE]" in str(entry)
    # Nothing left to wait for: run() returns at once (or says the process is gone).
    with contextlib.suppress(kprobes.errors.TargetError):
        assert proc.run(timeout=5) is True


def test_killed_while_traced(spawn, build, tmp_path):
    proc = start(spawn, tmp_path, [build("ticker"), 1000, 1000])
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    assert proc.run(timeout=0.2) is False
    os.kill(proc.pid, 9)
    assert proc.run(timeout=10) is True
    assert proc.exit_code == -9
    assert all(e.is_gone for e in proc.list())


def test_reference_program_outputs(procs):
    """The expectations above, from unprobed runs."""
    out = subprocess.run([procs, "exec", "25", "40"], capture_output=True, timeout=10, input=b"")
    assert out.stdout == b"phase1 sum=950\nphase2 ready\nphase2 sum=14420\n"
    out = subprocess.run([procs, "exit", "3"], capture_output=True, timeout=10)
    assert (out.returncode, out.stdout) == (3, b"works=15\n")


@pytest.mark.parametrize("order", ["entry first", "return first"])
def test_probes_that_join_an_optimized_site_get_their_events(spawn, procs, tmp_path, order):
    """A record probe and a return probe registered one after the other at one site: the
    second joins a site already optimized for the first, whose detour is built again for
    both (it used to keep the first one's action: the second got no event at all)."""
    argv = [procs, "fork", 20, 30, 10]
    proc = start(spawn, tmp_path, argv)  # the child is let go: the parent's 30 calls
    entries: list[tuple[int, int]] = []
    returns: list[tuple[int, int]] = []
    kp, rp = entry_records(entries), return_records(returns)
    first, second = (kp, rp) if order == "entry first" else (rp, kp)
    for probe in (first, second):
        if isinstance(probe, kprobes.Kretprobe):
            proc.register_kretprobe(probe)
        else:
            proc.register_kprobe(probe)
        assert all(e.is_optimized for e in proc.list()), proc.list()
    assert proc.run(timeout=30) and proc.exit_code == 0
    xs = list(range(20)) + list(range(2000, 2010))
    assert [x for _, x in entries] == xs
    assert [r for _, r in returns] == [3 * x + 2 for x in xs]
