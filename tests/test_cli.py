"""`kprobes list -p PID`: the probes another kprobes session placed in a process (Appendix A).

A driver (tests/drivers/trace_until_killed.py) traces tests/programs/ticker.c with one probe
and prints its own proc.list(); the CLI, a separate process, must print the same lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import support

import kprobes

pytestmark = pytest.mark.ptrace

DRIVERS = Path(__file__).resolve().parent / "drivers"
REPO = DRIVERS.parent.parent
KPROBES = Path(sys.executable).parent / "kprobes"  # the console script of the install


def kprobes_cli(*args: object) -> subprocess.CompletedProcess[str]:
    assert KPROBES.exists(), f"{KPROBES} is missing: is the package installed (pip install -e .)?"
    return subprocess.run(
        [str(KPROBES), *map(str, args)], capture_output=True, text=True, timeout=30
    )


def test_list_of_a_traced_process(popen, build, tmp_path):
    exe = build("ticker")
    out = tmp_path / "ticker.out"
    # Ticks enough never to end by itself: `kprobes list` must find it traced however long
    # its start takes on a loaded machine (300 ticks, 1.5 s, were over before it once).
    n = 1_000_000
    driver = popen(
        [sys.executable, DRIVERS / "trace_until_killed.py", "--out", out, exe, n, 5000],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert driver.stdout is not None
    lines = []
    while not lines or lines[-1] != "ready":
        lines.append(support.read_line(driver.stdout.fileno(), timeout=20).decode().rstrip("\n"))
    pid = int(lines[0].split()[1])
    listed = [line[len("list ") :] for line in lines if line.startswith("list ")]
    work = support.runtime_address(pid, exe, "work")
    assert len(listed) == 1
    assert re.fullmatch(rf"{work:016x}  k  work\+0x0  \[ticker\]  \[\w+\]", listed[0])

    result = kprobes_cli("list", "-p", pid)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == listed
    result = kprobes_cli("list", "-p", pid, "--json")  # the same rows, as objects
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["addr"], r["kind"], r["where"], r["module"]) for r in rows] == [
        (work, "k", "work+0x0", "ticker")
    ]
    assert support.is_alive(pid)
    # A second tracer cannot take the process.
    with pytest.raises(kprobes.errors.TargetError):
        kprobes.attach(pid)

    os.kill(pid, signal.SIGTERM)  # the program ends; its tracer reports every tick it saw
    stdout, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0
    ticks = [line for line in support.file_lines(out) if line.startswith("tick ")]
    last = stdout.decode().splitlines()[-1]
    # Every call counted: the ticks printed, and one more if the signal came between a
    # call and its line.
    assert last in (f"exit -{signal.SIGTERM} hits {len(ticks) + k}" for k in (0, 1)), last


def test_list_of_an_untraced_process(popen):
    sleeper = popen(["sleep", "30"])
    result = kprobes_cli("list", "-p", sleeper.pid)
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert sleeper.poll() is None  # untouched


def test_list_of_a_missing_process():
    p = subprocess.Popen(["true"])
    p.wait(timeout=10)
    result = kprobes_cli("list", "-p", p.pid)
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
