"""``count`` on the kernel's uprobes has the kernel count the hits (issue 22, item 8).

Each hit used to be written as a record into the session's ring, read and decoded in Python
to add one to a row. Now, when nothing needs the events (no filter, no ``-n``) and the
processes to count are a whole tree (``-c``, ``-p --follow-forks``) or every one (a file
probed with no target), the event is never enabled: perf counters on it
(kprobes/linux/perf.py) count in the kernel, and the tool reads one number per probe. The
counts must be what the events said: each test compares with the same command made to read
events (a ``--filter`` that keeps every one) and with what the program did.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import support
from support import cli, needs_uprobes
from test_cli_trace import count_rows

from kprobes.cli import main as cli_main
from kprobes.errors import TraceFsError
from kprobes.linux import perf
from kprobes.tracefs.target import TraceTarget

pytestmark = [pytest.mark.ptrace, needs_uprobes]

KEEP_ALL = ("--filter", "tid > 0")
TOOL = (
    str(support.KPROBES),
    "count",
    "--backend",
    "uprobes",
)  # a filter: the command must read every event


def counted(*args: object) -> dict[str, int]:
    result = cli("count", "--backend", "uprobes", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    return count_rows(result.stdout)


def test_a_command_is_counted_by_the_kernel_without_one_event(
    build: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    enabled: list[object] = []
    opened: list[int] = []
    real_enable, real_counter = TraceTarget.enable_kprobe, perf.Counter.__init__

    def enable(self: TraceTarget, kp: Any) -> None:
        enabled.append(kp)
        real_enable(self, kp)

    def counter(self: perf.Counter, event_id: int, **kwargs: Any) -> None:
        opened.append(event_id)
        real_counter(self, event_id, **kwargs)

    monkeypatch.setattr(TraceTarget, "enable_kprobe", enable)
    monkeypatch.setattr(perf.Counter, "__init__", counter)
    target = build("target")
    code = cli_main.main(["count", "--backend", "uprobes", "-c", f"{target} 7", "work", "compute"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert count_rows(out) == {"compute": 1, "work": 7}
    assert enabled == [], "an event was enabled: its hits were written and read"
    assert len(opened) == 2  # one counter a probe: the command, and what it starts


def test_a_tree_of_processes_counts_as_the_events_do(build: Any) -> None:
    target = build("target")
    command = f"sh -c '{target} 5 >/dev/null; {target} 7 >/dev/null'"
    specs = (f"{target}:work", "libc:strtol")
    in_kernel = counted("-c", command, *specs)
    from_events = counted(*KEEP_ALL, "-c", command, *specs)
    assert in_kernel == from_events
    assert in_kernel[f"{target}:work"] == 12


def test_follow_forks_counts_every_thread_of_a_running_process(build: Any, popen: Any) -> None:
    """``-p --follow-forks``: a counter on each thread there is, inherited by those it
    starts: the threads created after the tool attached are counted too."""
    threads = build("threads")
    prog = popen(
        [threads, 4, 1000, "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert support.read_line(prog.stdout.fileno(), timeout=20) == b"ready\n"
    with subprocess.Popen(
        [*TOOL, "-p", str(prog.pid), "--follow-forks", "hammer"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as tool:
        wait_for_counters(tool.pid, 1)
        prog.stdin.write(b"\n")
        prog.stdin.flush()
        assert prog.wait(timeout=60) == 0
        out, err = tool.communicate(timeout=60)  # the process's exit ends the session
    assert tool.returncode == 0, err
    assert count_rows(out) == {"hammer": 4 * 1000}


def test_a_file_probed_for_every_process_is_counted_per_cpu(build: Any) -> None:
    """No -p, no -c: every process that runs the file, one counter per CPU."""
    target = build("target")
    with subprocess.Popen(
        [*TOOL, "-x", str(target), "work"],  # perf's -x: a bare name is the file's
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as tool:
        wait_for_counters(tool.pid, len(online_cpus()))
        for n in (3, 4):
            subprocess.run([target, str(n)], check=True, capture_output=True)
        tool.send_signal(signal.SIGINT)
        out, err = tool.communicate(timeout=60)
    assert tool.returncode == 0, err
    assert count_rows(out) == {"work": 7}


def wait_for_counters(pid: int, at_least: int, timeout: float = 60) -> None:
    """Until process ``pid`` holds ``at_least`` perf event files (its counters are open)."""

    def perf_fds() -> int:
        n = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]"
            except OSError:
                continue
        return n

    support.wait_until(lambda: perf_fds() >= at_least, timeout, "the tool's counters")


def online_cpus() -> list[int]:
    text = Path("/sys/devices/system/cpu/online").read_text().strip()
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def test_kernel_counters_say_what_they_could_not_open() -> None:
    """A counter the kernel refuses is one line (the trace event's id and why)."""
    with pytest.raises(TraceFsError) as info:
        perf.Counter(1 << 40, pid=os.getpid())
    assert str(info.value).startswith(
        f"cannot count trace event {1 << 40} in process {os.getpid()}: "
    )
