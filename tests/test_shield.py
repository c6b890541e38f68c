"""Another tool's kernel uprobe on a function we jump-optimized (process/fast/shield.py).

The kernel writes a uprobe's int3 into every process that maps the probed file: over our jump
it then steps the file's first instruction and resumes inside our jump's displacement, and
when the uprobe goes it writes the file's first byte back before our jump's other four. These
tests register real uprobes, in a private tracefs instance, on the very bytes our jump holds,
while the program calls the function from four threads and checks every result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import support
from test_optimized import Run

import kprobes

pytestmark = [pytest.mark.ptrace, pytest.mark.tracefs]


class OtherTool(support.ForeignUprobes):
    """Another tool's uprobes on a file only the program maps: every record is its own."""

    def add(self, path: Path, vaddr: int) -> None:
        self.enable(self.define(path, vaddr))

    def pop(self) -> None:
        """The newest uprobe goes (its tool ends)."""
        self.remove(self.names[-1])


@pytest.fixture
def other_tool() -> Iterator[Callable[[int], OtherTool]]:
    made: list[OtherTool] = []

    def make(pid: int) -> OtherTool:
        try:
            made.append(OtherTool("shield"))
        except OSError as exc:
            pytest.skip(str(exc))
        return made[-1]

    yield make
    for tool in made:
        tool.close()


def code_mappings(pid: int, exe: Path) -> list[support.Mapping]:
    real = str(exe.resolve())
    return [m for m in support.maps(pid) if m.path == real and "x" in m.perms]


@pytest.mark.parametrize("optimize", [True, False], ids=["jump", "int3"])
def test_another_tools_uprobe_on_our_probe_harms_nothing(
    spawn, build, tmp_path, other_tool, optimize
):
    """Over a jump, the kernel's int3 killed the program; over an int3 of ours, the uprobe's
    removal took our int3 with it and our count stopped, without a word."""
    exe = build("optimized")
    n = 20_000
    run = Run(spawn, exe, tmp_path, 4, n, 4)
    proc, pid = run.proc, run.proc.pid
    kp = kprobes.Kprobe(symbol="work", optimize=optimize)
    proc.register_kprobe(kp)
    assert next(e for e in proc.list() if e.where == "work+0x0").is_optimized == optimize
    assert kp.addr is not None
    ours = support.raw_read(pid, kp.addr, 5)
    assert ours[0] == (0xE9 if optimize else 0xCC)
    # While a probe of ours is there, the page is writable: the kernel keeps uprobes out.
    assert [m.perms for m in code_mappings(pid, exe) if m.start <= kp.addr < m.end] == ["rwxp"]
    run.run_until("round 1")
    # Another tool probes work, the very bytes of our probe, for a round, then goes.
    work = support.symbol(exe, "work").value
    other = other_tool(pid)
    other.add(exe, work)
    assert support.raw_read(pid, kp.addr, 5) == ours, "the kernel wrote over our probe"
    run.next_round()
    run.run_until("round 2")
    other.pop()
    assert support.raw_read(pid, kp.addr, 5) == ours, "the kernel took our probe away"
    run.next_round()
    run.run_until("round 3")
    assert kp.nhit == 3 * 4 * n
    # It comes again. Our end gives the page its protection back and maps it from its file
    # again: the kernel then installs the other tool's uprobe, which counts the last round.
    other.add(exe, work)
    proc.close()
    assert not [m for m in code_mappings(pid, exe) if "w" in m.perms]
    assert support.raw_read(pid, kp.addr, 1) == b"\xcc"  # the other tool's int3
    assert other.hits() == 0  # none while our probe was there
    os.write(run.stdin, b"x")
    os.close(run.stdin)
    assert support.wait_child(pid, 60) == 0
    assert other.hits() == 4 * n  # each call of the last round, no more
    assert run.output() == run.reference()  # every sum the program checked is right
    assert kp.nhit == 3 * 4 * n


def test_a_program_that_may_not_have_writable_code_keeps_its_trap(attach):
    """A program under PR_SET_MDWE (systemd's MemoryDenyWriteExecute does the same with
    seccomp) may not make its code writable: the site stays an int3, and says why."""
    script = (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.prctl(65, 1, 0, 0, 0) != 0:\n"  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
        "    sys.exit(77)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read(1)\n"
        "x = [libc.malloc(64) for i in range(3000)]\n"
    )
    prog = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert prog.stdout is not None and prog.stdin is not None
        if prog.stdout.readline() != b"ready\n":
            assert prog.wait(timeout=30) == 77
            pytest.skip("the kernel has no PR_SET_MDWE (Linux 6.3+)")
        proc = attach(prog.pid)
        kp = kprobes.Kprobe(symbol="libc:malloc", optimize=True)
        proc.register_kprobe(kp)
        (entry,) = [e for e in proc.list() if "malloc" in e.where]
        assert not entry.is_optimized
        why = entry.why_not_optimized
        assert "may not make its code" in why and "MemoryDenyWriteExecute" in why, why
        assert kp.addr is not None and support.raw_read(prog.pid, kp.addr, 1) == b"\xcc"
        prog.stdin.write(b"x")
        prog.stdin.close()
        assert proc.run(timeout=60)
        assert proc.exit_code == 0
        assert kp.nhit >= 3000
    finally:
        if prog.poll() is None:
            prog.kill()
        prog.wait(timeout=30)


def test_pages_protections_and_runs():
    from kprobes.process.fast import shield

    assert shield.pages_of(0x1FFE, 5) == [0x1000, 0x2000]  # a jump across a page boundary
    assert shield.pages_of(0x1000, 1) == [0x1000]
    assert shield.prot_of("r-xp") == shield.PROT_READ | shield.PROT_EXEC
    assert shield.prot_of("rwxp") == 7 and shield.prot_of("---p") == 0
    assert shield._runs([0x5000, 0x1000, 0x2000, 0x4000]) == [[0x1000, 0x2000], [0x4000, 0x5000]]
