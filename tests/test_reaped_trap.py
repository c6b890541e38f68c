"""The tool SIGKILLed while it holds a thread stopped on a breakpoint's trap (issue 17, item 1).

The kernel keeps a stopped tracee's trap until the tracer reaps the stop (``waitpid``). A
tracer that dies before the reap leaves the trap delivered to the program (the rescue's
business); one that dies after leaves the thread to go on from its registers, the trap
gone. Either way the thread must go on from where it is right: never from one byte past an
int3, the middle of the probed instruction (``push %r12`` = ``41 54`` resumed at ``54`` is
``push %rsp``: a register silently wrong).

The program is tests/programs/mallocs.c: 4 workers malloc, fill, check and free blocks and
call ``framed()`` (``push %rbp; mov %rsp,%rbp; lea; pop %rbp; ret``), counting their
iterations in a register and in memory; any wrong register shows as a BAD line and status 1.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

pytestmark = pytest.mark.ptrace

DRIVERS = Path(__file__).resolve().parent / "drivers"
REPO = DRIVERS.parent.parent
THREADS = 4


def expected_output(threads: int = THREADS) -> bytes:
    lines = [f"thread {t}: every call checked" for t in range(threads)]
    return ("\n".join([*lines, f"total: {threads} threads stopped"]) + "\n").encode()


def start_mallocs(popen: Callable[..., Any], build: Callable[[str], Path]) -> Any:
    # niced: its 4 spinning threads would starve the tool on two cores
    argv = ["nice", "-n", "10", build("mallocs"), THREADS]
    prog = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = support.read_line(prog.stderr.fileno(), timeout=20)
    assert line == f"mallocs {prog.pid} ready\n".encode(), line
    return prog


def released(prog: Any) -> None:
    support.wait_until(
        lambda: not any(support.tracer_of(prog.pid, t) for t in support.thread_ids(prog.pid)),
        10,
        "the program's threads to be released",
    )


def finish_mallocs(prog: Any) -> None:
    """The program runs on alone a while (through every int3 left), then must end by
    itself, every iteration checked."""
    time.sleep(0.3)
    assert prog.poll() is None, f"the program died: status {prog.returncode}"
    prog.send_signal(signal.SIGUSR1)
    out, err = prog.communicate(timeout=30)
    assert prog.returncode == 0, err.decode()[-2000:]
    assert out == expected_output(), err.decode()[-2000:]


def test_unprobed_reference(popen, build):
    finish_mallocs(start_mallocs(popen, build))


# (where the thread stalls: the probe it is put back on, None for a slot; the probes):
# malloc's first instruction (a push: boosted, sent to its slot); framed's mov (emulated, put
# back on its int3 one byte past the probed push: the rescue must not take its trap for the
# push's); framed's pop (boosted); framed's ret (emulated, one byte past the probed pop).
SITES = {
    "malloc-entry": (None, ["libc:malloc"]),
    "after-a-probed-push": ("framed+1", ["framed", "framed+1"]),
    "boosted-pop": (None, ["framed+9"]),
    "ret-after-a-probed-pop": ("framed+10", ["framed+9", "framed+10"]),
}


@pytest.mark.parametrize("stall", ["held", "reaped"])
@pytest.mark.parametrize("site", list(SITES))
def test_the_tool_dies_holding_a_trap(popen, build, site, stall):
    """Killed with a thread's trap not reaped yet (the kernel delivers it to the rescue when
    the tool dies) or just reaped (the kernel has dropped it): the thread goes on from the
    probed instruction, whole, and the program finishes right."""
    at, specs = SITES[site]
    prog = start_mallocs(popen, build)
    args = ["--stall", stall, "--after", 20, *(["--at", at] if at else []), *specs]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = popen(
        [sys.executable, DRIVERS / "trap_until_killed.py", prog.pid, *args],
        stdout=subprocess.PIPE,
        env=env,
    )
    assert support.read_line(driver.stdout.fileno(), 30) == b"ready\n"
    assert support.read_line(driver.stdout.fileno(), 30) == b"stalled\n"
    driver.kill()
    assert driver.wait(10) == -signal.SIGKILL
    released(prog)
    finish_mallocs(prog)


@pytest.mark.parametrize("stall", ["held", "reaped"])
@pytest.mark.parametrize("site", ["malloc-entry", "boosted-pop"])
def test_the_tool_dies_holding_a_trap_of_a_followed_child(popen, build, tmp_path, site, stall):
    """As above, in a child that a followed shell ran (fork, then exec: a member of the
    family, with an image and a rescue of its own, whose stops reach the tool through the
    root's wait): the thread goes on from the probed instruction, and the program and the
    shell finish right."""
    # framed is the program's: pending, in the shell, until the child's exec maps it
    specs = [s if s.startswith("libc:") else f"mallocs:{s}" for s in SITES[site][1]]
    # past the startup of nice and of the program: a trap of a worker
    kill_following(popen, build, tmp_path, "--stall", stall, "--after", 400, *specs)


def test_the_tool_dies_setting_aside_a_trap_of_a_followed_child(popen, build, tmp_path):
    """Killed right after the root reaped a member's trap while stopping its world (to place
    or remove a probe): the member's thread was put back on its int3 first, and goes on
    right."""
    kill_following(
        popen, build, tmp_path, "--cycle", "--stall", "aside", "--after", 5, "libc:malloc"
    )


def kill_following(popen: Any, build: Any, tmp_path: Path, *args: Any) -> None:
    """``trap_until_killed.py --follow`` on a shell that runs the program as its child, killed
    when it stalls; the program then runs on alone and must finish right, and the shell."""
    script = tmp_path / "run.sh"
    script.write_text(f"#!/bin/sh\nread go\nnice -n 10 {build('mallocs')} {THREADS}\nexit $?\n")
    script.chmod(0o755)
    shell = popen(
        [script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its group: the program too, killed whatever happens
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = popen(
        [sys.executable, DRIVERS / "trap_until_killed.py", shell.pid, "--follow", *args],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert support.read_line(driver.stdout.fileno(), 30) == b"ready\n"
        shell.stdin.write(b"go\n")
        shell.stdin.flush()
        assert support.read_line(driver.stdout.fileno(), 30) == b"stalled\n"
        driver.kill()
        assert driver.wait(10) == -signal.SIGKILL
        # (the tool may have stalled before the program said it was ready)
        line = support.read_line(shell.stderr.fileno(), timeout=30)
        assert line.startswith(b"mallocs ") and line.endswith(b" ready\n"), line
        prog = int(line.split()[1])
        support.wait_until(
            lambda: not any(support.tracer_of(prog, t) for t in support.thread_ids(prog)),
            10,
            "the program's threads to be released",
        )
        time.sleep(0.3)
        assert shell.poll() is None, f"the shell ended: status {shell.returncode}"
        os.kill(prog, signal.SIGUSR1)
        out, err = shell.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert shell.returncode == 0, err.decode()[-2000:]
    assert out == expected_output(), err.decode()[-2000:]


@pytest.mark.deadline(240)
def test_trace_killed_at_random_moments(popen, build):
    """``kprobes trace --no-optimize -p PID libc:malloc`` (every other time with framed's
    probes beside, one byte apart) SIGKILLed 10 times at a random moment once it traces, over
    one run of the program: every iteration of every thread stays right (issue 17: 3 runs in
    9 of this went wrong)."""
    prog = start_mallocs(popen, build)
    rng = random.Random(int(os.environ.get("KPROBES_TEST_SEED", "17")))
    kprobes_cmd = Path(sys.executable).with_name("kprobes")
    for i in range(10):
        specs = ["libc:malloc"] if i % 2 == 0 else ["libc:malloc", "framed", "framed+1"]
        tool = popen(
            [kprobes_cmd, "trace", "--no-optimize", "-p", prog.pid, *specs],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert support.read_line(tool.stdout.fileno(), 60), "no event traced"
        time.sleep(rng.uniform(0.0, 0.3))
        tool.kill()
        tool.wait(10)
        released(prog)
        assert prog.poll() is None, f"the program died: status {prog.returncode}"
    finish_mallocs(prog)
