"""An int3 a SIGKILLed kprobes left is taken back by the next tool that probes its site.

A tool killed on the trap tier leaves its int3s; each is put back by the rescue when a thread
next traps on it. Until then a later tool found a breakpoint it did not own and refused the
site ("already a breakpoint (another debugger?)"): found by the command line's stress test
(a dead tool's int3 on ``realloc``, a later ``count`` on it). The dead tool's rescue lists its
int3s and what they hide (``rescue.left_breakpoints``): the later tool puts the byte back
before it decodes the site, and probes it.
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

pytestmark = pytest.mark.ptrace

DEPTH = 3


def test_a_dead_tools_int3_is_taken_back_and_probed(build, popen):
    busy = build("busy")
    prog = support.start_busy(popen, busy, 2, DEPTH)
    addr = support.runtime_address(prog.pid, busy, "on_usr2")  # never called until SIGUSR2
    original = support.raw_read(prog.pid, addr, 1)
    first = popen(
        [KPROBES, "count", "--no-optimize", "-p", prog.pid, "on_usr2", "hot"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    support.wait_until(
        lambda: support.raw_read(prog.pid, addr, 1) == b"\xcc", 60, "the first tool's int3"
    )
    first.send_signal(signal.SIGKILL)
    first.wait()
    support.wait_until(
        lambda: "TracerPid:\t0" in Path(f"/proc/{prog.pid}/status").read_text(), 30, "the detach"
    )
    assert support.raw_read(prog.pid, addr, 1) == b"\xcc"  # left by the dead tool

    later = popen(
        [KPROBES, "count", "--no-optimize", "-p", prog.pid, "on_usr2", "-d", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    support.wait_until(
        lambda: f"TracerPid:\t{later.pid}" in Path(f"/proc/{prog.pid}/status").read_text()
        or later.poll() is not None,
        60,
        "the later tool's attach",
    )
    while later.poll() is None:  # hits for the later tool's probe, as long as it runs
        os.kill(prog.pid, signal.SIGUSR2)
        time.sleep(0.05)
    out, err = later.communicate(timeout=120)
    assert later.returncode == 0, err.decode()
    assert count_rows(out.decode()).get("on_usr2", 0) >= 1, out.decode()
    assert support.raw_read(prog.pid, addr, 1) == original  # the site is whole again
    os.kill(prog.pid, signal.SIGUSR2)  # the handler runs its own first byte
    code, stdout, stderr = support.stop_busy(prog)
    assert (code, stdout) == (0, support.busy_output(2, DEPTH)), stderr
