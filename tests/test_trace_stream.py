"""``trace``'s stream of events on stdout (cli/trace_cmd.py, ``event_stream``): a buffer of
our own for a file or a pipe, flushed after each poll of the rings, by an event that comes
a while after the last flush, and at the end.

Before, a pipe's reader saw nothing until 8 KiB of events had come (Python's buffer), and
with ``PYTHONUNBUFFERED`` set (``python -u``, these machines' environment) every event of a
probe whose records alternate with another's was a ``write`` of its own: a trace into a file
took twice the time.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess

import pytest
import support

pytestmark = pytest.mark.ptrace

KPROBES = [support.KPROBES]


@pytest.mark.parametrize("tier", [[], ["--no-optimize"]], ids=["jump", "trap"])
def test_a_pipes_reader_gets_each_event_as_it_comes(build, popen, tier):
    """One call of ``work`` every half second: 8 KiB of lines would take ~40 s to come. On
    the trap tier alone there is no poll of the rings to flush after: an event written at
    least ``FLUSH_EVERY`` after the last flush flushes."""
    prog = popen([build("ticker"), 100_000, 500_000], stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    tool = popen(
        [*KPROBES, "trace", *tier, "-p", prog.pid, "work i=%di:s64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert tool.stdout is not None and tool.stderr is not None
    seen = []
    for _ in range(2):
        ready, _, _ = select.select([tool.stdout], [], [], 30)
        assert ready, "no event came through the pipe in 30 s"
        seen.append(tool.stdout.readline().decode())
    tool.send_signal(signal.SIGINT)
    assert tool.wait(timeout=60) == 0, tool.stderr.read().decode()
    i = [int(m[1]) for m in (re.search(r"\bi=(\d+)", line) for line in seen) if m]
    assert len(i) == 2 and i[1] == i[0] + 1, seen


def test_python_unbuffered_does_not_write_each_event_by_itself(build, tmp_path):
    """An entry and a return probe of one function: their records alternate, each run of
    the reader one event long. Counted: the tool's writes to stdout (strace)."""
    calls = 20_000
    out, log = tmp_path / "out", tmp_path / "strace"
    argv = [
        "strace", "-o", log, "-e", "trace=write", "-e", "signal=none",
        *KPROBES, "trace", "-c", f"{build('target')} {calls}", "p work i=%di", "r work ret=$retval",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with out.open("wb") as f:
        done = subprocess.run([str(a) for a in argv], stdout=f, stderr=subprocess.PIPE, env=env)
    assert done.returncode == 0, done.stderr.decode()
    events = sum(1 for line in out.read_text().splitlines() if "_work_0: (" in line)
    assert events == 2 * calls, done.stderr.decode()[-2000:]
    writes = sum(1 for line in log.read_text().splitlines() if line.startswith("write(1,"))
    assert 0 < writes < events // 100, writes


def test_script_prints_a_recording_through_the_same_buffer(build, tmp_path):
    """``script`` prints a ``record`` file through trace's output: the same writes."""
    calls = 20_000
    data, out, log = tmp_path / "alt.data", tmp_path / "out", tmp_path / "strace"
    recorded = subprocess.run(
        [*KPROBES, "record", "-o", data, "-c", f"{build('target')} {calls}", "p work i=%di",
         "r work ret=$retval"], capture_output=True,
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr.decode()
    argv = ["strace", "-o", log, "-e", "trace=write", "-e", "signal=none", *KPROBES, "script", data]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with out.open("wb") as f:
        done = subprocess.run([str(a) for a in argv], stdout=f, stderr=subprocess.PIPE, env=env)
    assert done.returncode == 0, done.stderr.decode()
    events = sum(1 for line in out.read_text().splitlines() if "_work_0: (" in line)
    assert events == 2 * calls
    writes = sum(1 for line in log.read_text().splitlines() if line.startswith("write(1,"))
    assert 0 < writes < events // 100, writes
