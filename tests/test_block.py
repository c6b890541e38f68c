"""``--block`` (issue 21, item 3): a hit that finds its ring full waits for the reader.

The detour retries a full ring while the reader's lease holds (shared_area.py), so a trace of
any length is complete; the reader renews the lease at every read, so a tool that dies, is
stopped or detaches releases every waiting thread, and the program goes on (dropping).
A tool SIGKILLed while threads wait: test_records.py's killed mid-trace, ``block``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import support
from test_records import expected, run_on_a_small_ring, values

pytestmark = pytest.mark.ptrace


def test_a_full_ring_waits_for_a_slow_handler_and_loses_nothing(spawn, build, tmp_path):
    """The ring holds a few records, the handler is slow: without waiting most hits are
    dropped (test_records.py's full ring); with it every one reaches the handler."""
    threads, n = 4, 1000
    proc, kp, hits = run_on_a_small_ring(spawn, build("records"), tmp_path, threads, n, block=True)
    assert proc.dropped == 0 and kp.nhit == len(hits) == threads * n
    assert all(values(h) == expected(h.arg("t"), h.arg("i")) for h in hits)
    by_thread: dict[int, list[int]] = {}
    for h in hits:
        by_thread.setdefault(h.arg("t"), []).append(h.arg("i"))
    assert by_thread == {t: list(range(n)) for t in range(threads)}  # each in its order


def test_trace_block_keeps_every_event_of_a_hot_loop(build, tmp_path):
    """Three rings' worth of one-slot records from a tight loop, every one printed, in
    order, with its value."""
    target = build("target")
    n = 1_600_000  # the default ring holds 524,288
    out = tmp_path / "trace.txt"
    with open(out, "w") as f:
        result = subprocess.run(
            [str(support.KPROBES), "trace", "--block", "-c", f"{target} {n}", "p work i=%di"],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=600,
        )
    assert result.returncode == 0, result.stderr
    assert f"{n} events, {n} hits, 0 missed, 0 dropped" in result.stderr, result.stderr
    text = support.without_output_of(out.read_text(), support.reference_output([target, n]))
    seen = [int(m, 16) for m in re.findall(r" i=0x([0-9a-f]+)$", text, re.M)]
    assert seen == list(range(n))


def test_block_is_refused_on_the_kernels_backends():
    result = subprocess.run(
        [str(support.KPROBES), "trace", "--block", "--backend", "uprobes", "/bin/true:main"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.startswith(
        "kprobes: --block makes our own optimized probes wait for room in their ring"
    ), result.stderr


def test_a_stopped_tool_never_holds_the_program(build, popen, tmp_path):
    """A tool stopped (^Z, SIGSTOP) reads nothing: the ring fills, the program waits until
    the lease runs out, then drops and runs to its end while the tool is still stopped. (A
    program that traps or faults stops for its stopped tracer, as under any debugger: this
    one only runs detours.)"""
    target = build("target")
    n = 3_000_000
    out = tmp_path / "out"
    with open(out, "wb") as f:
        tool = popen(
            [support.KPROBES, "trace", "--block", "-c", f"{target} {n}", "p work i=%di"],
            stdout=f.fileno(),
            stderr=subprocess.PIPE,
        )
    try:
        support.wait_until(lambda: b" i=0x" in out.read_bytes(), 120, "the first events")
        os.kill(tool.pid, signal.SIGSTOP)
        # target's last line, written at its exit, after the 3,000,000 calls
        support.wait_until(lambda: b"show hello kprobes" in out.read_bytes(), 300, "its end")
        assert "State:\tT" in Path(f"/proc/{tool.pid}/status").read_text()
    finally:
        os.kill(tool.pid, signal.SIGKILL)
        tool.wait()
