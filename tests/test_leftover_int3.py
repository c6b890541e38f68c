"""An int3 a SIGKILLed kprobes left is taken back by the next tool that probes its site.

A tool killed on the trap tier leaves its int3s; each is put back by the rescue when a thread
next traps on it. Until then a later tool found a breakpoint it did not own and refused the
site ("already a breakpoint (another debugger?)"): found by the command line's stress test
(a dead tool's int3 on ``realloc``, a later ``count`` on it). The dead tool's rescue lists its
int3s and what they hide (``rescue.left_breakpoints``): the later tool puts the byte back
before it decodes the site, and probes it.

The dead tool's rescue is found wherever it lies in the maps: a later tool's rescue mapped
right below it (the kernel's top-down ``mmap``) merges with it into one line, and a look at
the line's start alone found only the later one's (stress test: a dead ``count``'s int3 on
``realloc``, a dead ``trace`` on ``malloc`` after it, then ``count ... realloc`` refused).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import support
from test_cli_trace import KPROBES, count_rows

from kprobes.arch.x86_64 import rescue

pytestmark = pytest.mark.ptrace

DEPTH = 3


def test_a_dead_tools_int3_is_taken_back_and_probed(build, popen):
    busy = build("busy")
    prog = support.start_busy(popen, busy, 2, DEPTH)
    addr = support.runtime_address(prog.pid, busy, "on_usr2")  # never called until SIGUSR2
    original = support.raw_read(prog.pid, addr, 1)
    _killed_once_placed(
        popen,
        prog.pid,
        [KPROBES, "count", "--no-optimize", "-p", prog.pid, "on_usr2", "hot"],
        lambda: support.raw_read(prog.pid, addr, 1) == b"\xcc",
    )
    assert support.raw_read(prog.pid, addr, 1) == b"\xcc"  # left by the dead tool
    _probed_by_a_later_tool(popen, prog.pid, ["--no-optimize"])
    assert support.raw_read(prog.pid, addr, 1) == original  # the site is whole again
    os.kill(prog.pid, signal.SIGUSR2)  # the handler runs its own first byte
    code, stdout, stderr = support.stop_busy(prog)
    assert (code, stdout) == (0, support.busy_output(2, DEPTH)), stderr


def _anon_code(pid: int) -> list[tuple[int, int]]:
    """The lines of anonymous executable memory in the maps: (start, end)."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 5 and "x" in fields[1]:
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def _killed_once_placed(popen, pid: int, argv: list, placed) -> None:  # type: ignore[no-untyped-def]
    tool = popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    support.wait_until(lambda: placed() or tool.poll() is not None, 60, "the tool's probes")
    tool.send_signal(signal.SIGKILL)
    tool.wait()
    support.wait_until(
        lambda: "TracerPid:\t0" in Path(f"/proc/{pid}/status").read_text(), 30, "the detach"
    )


def _probed_by_a_later_tool(popen, pid: int, extra: list) -> None:  # type: ignore[no-untyped-def]
    """A later ``count`` of ``on_usr2`` places its probe and counts its hits."""
    later = popen(
        [KPROBES, "count", *extra, "-p", pid, "on_usr2", "-d", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    support.wait_until(
        lambda: (
            f"TracerPid:\t{later.pid}" in Path(f"/proc/{pid}/status").read_text()
            or later.poll() is not None
        ),
        60,
        "the later tool's attach",
    )
    while later.poll() is None:  # hits for the later tool's probe, as long as it runs
        os.kill(pid, signal.SIGUSR2)
        time.sleep(0.05)
    out, err = later.communicate(timeout=120)
    assert later.returncode == 0, err.decode()
    assert count_rows(out.decode()).get("on_usr2", 0) >= 1, out.decode()


def test_an_int3_of_a_rescue_merged_below_another_is_taken_back(build, popen):
    busy = build("busy")
    prog = support.start_busy(popen, busy, 2, DEPTH)
    cold = support.runtime_address(prog.pid, busy, "on_usr2")  # never called until SIGUSR2
    hot = support.runtime_address(prog.pid, busy, "hot")
    original = support.raw_read(prog.pid, cold, 1)
    _killed_once_placed(
        popen,
        prog.pid,
        [KPROBES, "count", "--no-optimize", "-p", prog.pid, "on_usr2", "hot"],
        lambda: support.raw_read(prog.pid, cold, 1) == b"\xcc",
    )
    first = _anon_code(prog.pid)
    # A second tool probes only `hot`: it never looks at the int3 on `on_usr2`, maps a rescue
    # of its own and dies too.
    _killed_once_placed(
        popen,
        prog.pid,
        [KPROBES, "count", "--no-optimize", "-p", prog.pid, "hot"],
        lambda: _anon_code(prog.pid) != first and support.raw_read(prog.pid, hot, 1) == b"\xcc",
    )
    assert support.raw_read(prog.pid, cold, 1) == b"\xcc"
    read = lambda at, n: support.raw_read(prog.pid, at, n)  # noqa: E731
    areas = [a for lo, hi in _anon_code(prog.pid) for a in rescue.find_areas(lo, hi, read)]
    assert len(areas) == 2, areas  # both dead rescues are found, wherever they lie

    _probed_by_a_later_tool(popen, prog.pid, [])  # optimized: its rescue is mapped first
    assert support.raw_read(prog.pid, cold, 1) == original
    code, stdout, stderr = support.stop_busy(prog)
    assert (code, stdout) == (0, support.busy_output(2, DEPTH)), stderr


def test_find_areas_reads_every_page_of_a_merged_line():
    """Two rescues side by side and one after a page of something else, in one line."""
    page = rescue.PAGE
    base = 0x7F0000000000
    starts = [base + page, base + page + rescue.AREA_SIZE, base + 3 * page + 2 * rescue.AREA_SIZE]
    end = starts[-1] + rescue.AREA_SIZE + page
    magic = rescue.MAGIC.to_bytes(8, "little")

    def read(at: int, n: int) -> bytes:
        if any(at == s + rescue.HEADER + rescue.H_MAGIC for s in starts):
            return magic[:n]
        return bytes(n) if base <= at < end else b""

    assert rescue.find_areas(base, end, read) == starts
    assert rescue.find_areas(base, starts[-1] + rescue.AREA_SIZE - 1, read) == starts[:2]
