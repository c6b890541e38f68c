"""Every way out of a kprobes user that can be caught leaves the program running, unpatched.

tests/drivers/trace_until_killed.py spawns tests/programs/ticker.c with a probe and dispatches
hits; the test kills the driver (SIGINT, SIGTERM, SIGHUP) or makes its handler raise. The
program, reparented to this test process (a child subreaper), must finish with its complete
output and exit status 0: one patched byte left behind would kill it with SIGTRAP.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support

pytestmark = pytest.mark.ptrace

N = 300  # ticks
DELAY_US = 5000  # 5 ms between ticks: 1.5 s unprobed

PR_SET_CHILD_SUBREAPER = 36
DRIVERS = Path(__file__).resolve().parent / "drivers"
REPO = DRIVERS.parent.parent


def expected_lines(n: int = N) -> list[str]:
    return [f"tick {i} {i * i + 1}" for i in range(n)] + [
        f"done {sum(i * i + 1 for i in range(n))}"
    ]


@pytest.fixture
def subreaper() -> Iterator[list[int]]:
    """Orphans of this test (the traced program, once its tracer is gone) become our children,
    so that their exit status can be collected. Pids put in the yielded list are killed and
    reaped at teardown if the test left them behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    orphans: list[int] = []
    try:
        yield orphans
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in orphans:
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    continue  # exited just now
            except ChildProcessError:
                continue  # already reaped, or still someone else's child: leave it alone
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    raise AssertionError("no TracerPid")


def start_driver(
    popen: Callable[..., subprocess.Popen[bytes]], exe: Path, out: Path, *extra: Any
) -> tuple[subprocess.Popen[bytes], int, list[str]]:
    """Start the driver; returns (driver, program pid, the driver's list lines)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = popen(
        [sys.executable, DRIVERS / "trace_until_killed.py", "--out", out, *extra, exe, N, DELAY_US],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=support.default_signals,  # the signals the tests send act as they would
    )
    assert driver.stdout is not None
    pid = 0
    listed = []
    while True:
        line = support.read_line(driver.stdout.fileno(), timeout=20).decode().rstrip("\n")
        if line.startswith("pid "):
            pid = int(line.split()[1])
        elif line.startswith("list "):
            listed.append(line[len("list ") :])
        elif line == "ready":
            break
    assert pid > 0
    return driver, pid, listed


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name
)
def test_program_survives_its_tracer_being_signalled(subreaper, popen, build, tmp_path, sig):
    exe = build("ticker")
    out = tmp_path / "ticker.out"
    driver, pid, _ = start_driver(popen, exe, out)
    subreaper.append(pid)
    support.wait_for_lines(out, 20, timeout=20)
    assert tracer_of(pid) == driver.pid
    os.kill(driver.pid, sig)
    driver.wait(timeout=20)
    status = support.wait_child(pid, timeout=30)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"program ended with status {status:#x}",
        driver.stderr.read() if driver.stderr else b"",
    )
    assert support.file_lines(out) == expected_lines()


def test_program_survives_an_exception_in_a_handler(subreaper, popen, build, tmp_path):
    exe = build("ticker")
    out = tmp_path / "ticker.out"
    driver, pid, _ = start_driver(popen, exe, out, "--raise-at", 30)
    subreaper.append(pid)
    assert driver.wait(timeout=30) != 0
    assert driver.stderr is not None
    stderr = driver.stderr.read().decode()
    assert "RuntimeError: deliberate failure at hit 30" in stderr
    status = support.wait_child(pid, timeout=30)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"status {status:#x}"
    assert support.file_lines(out) == expected_lines()


def test_driver_runs_to_the_end(popen, build, tmp_path):
    """The driver itself works: without interference it traces the program to its end."""
    exe = build("ticker")
    out = tmp_path / "ticker.out"
    driver, pid, listed = start_driver(popen, exe, out)
    assert len(listed) == 1 and "  k  work+0x0  [ticker]" in listed[0]
    stdout, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0
    assert stdout.decode() == f"exit 0 hits {N}\n"
    assert support.file_lines(out) == expected_lines()
    assert not support.is_alive(pid)
