"""The tracing commands with ``--kernel`` on a real kernel (run inside the VM by tests/vm).

Each command runs ``cat`` under ``-c``: the kernel's kprobes see every process, and the session
keeps only cat's events (``set_event_pid`` in its instance), so the expected values are exact.
Kept to a few commands: every Python start costs seconds under software emulation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kprobes.model import Event
from kprobes.tracefs import Kernel

from .conftest import TRACEFS, leftovers

KPROBES = Path(sys.executable).parent / "kprobes"
CONTEXT = re.compile(r"^ *(?P<comm>\S+)-(?P<pid>\d+) +\[(?P<cpu>\d{3})\] +(?P<ts>\d+\.\d{6}): ")


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KPROBES), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def no_session_left() -> None:
    text = (TRACEFS / "kprobe_events").read_text()
    assert ":kprobes_" not in text, text
    assert not [p for p in (TRACEFS / "instances").iterdir() if p.name.startswith("kprobes_")]


def test_trace_json_keeps_only_the_commands_events(tmp_path: Path) -> None:
    marker = tmp_path / "hello.txt"
    marker.write_text("hello\n")
    r = cli(
        "trace",
        "--kernel",
        "--json",
        "-c",
        f"cat {marker}",
        "p:open do_sys_openat2 dfd=%di:s32 name=+0(%si):ustring",
        "r:opened do_sys_openat2 fd=$retval:s32",
    )
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert "hello" in r.stdout.splitlines()  # cat's own output, unharmed
    assert events and {e["comm"] for e in events} == {"cat"}, events
    assert len({e["pid"] for e in events}) == 1
    opens = [e for e in events if e["event"].endswith("/open")]
    assert {"dfd": -100, "name": str(marker)} in [e["args"] for e in opens]
    returns = [e for e in events if e["event"].endswith("/opened")]
    assert len(returns) == len(opens)
    assert all(isinstance(e["args"]["fd"], int) for e in returns)
    no_session_left()


def test_count_globs_and_hist_of_a_kernel_function(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_bytes(b"x" * 300_000)
    command = f"sh -c 'exec cat {data} >/dev/null'"
    r = cli("count", "--kernel", "-c", command, "vfs_rea?", "ksys_read")
    assert r.returncode == 0, r.stderr
    rows = dict(
        (line.split()[0], int(line.split()[1]))
        for line in r.stdout.splitlines()
        if re.match(r"\w+\s+\d+$", line)
    )
    # cat reads the file in 128 KiB chunks (3 reads and one at the end), plus its libraries;
    # every read(2) is a ksys_read calling vfs_read, and exec reads through vfs_read too.
    assert 4 <= rows["ksys_read"] <= rows["vfs_read"], r.stdout
    h = cli("hist", "--kernel", "-c", command, "p ksys_read count=%dx:u64", "--key", "count")
    assert h.returncode == 0, h.stderr
    assert re.search(r"^\s*\d+\s+131072$", h.stdout, re.M), h.stdout  # COUNT, then the value
    no_session_left()


def test_latency_pairs_entries_and_returns(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_bytes(b"y" * 100_000)
    r = cli("latency", "--kernel", "-u", "-c", f"sh -c 'exec cat {data} >/dev/null'", "vfs_read")
    assert r.returncode == 0, r.stderr
    m = re.search(r"avg = \d+ usecs, total: \d+ usecs, count: (\d+)", r.stdout)
    assert m is not None and int(m.group(1)) >= 2, r.stdout
    counts = [int(x.split(":")[1].split("|")[0]) for x in r.stdout.splitlines() if "->" in x]
    assert sum(counts) == int(m.group(1))  # every return was paired with its entry
    no_session_left()


def test_list_and_a_group_clash() -> None:
    with Kernel() as k:
        k.add("p:mine vfs_write")
        r = cli("list", "--kernel")
        assert r.returncode == 0, r.stderr
        assert re.search(r"^[0-9a-f]+\s+k\s+vfs_write\+0x0\s", r.stdout, re.M), r.stdout
        # Our group name is taken: one clear error, and the other session's events untouched.
        clash = cli("trace", "--kernel", "-d", "1", f"p:{k.group}/ev vfs_write")
        assert clash.returncode == 1 and "already exists" in clash.stderr
        assert f"{k.group}/mine" in (TRACEFS / "kprobe_events").read_text()
        group, instance = k.group, k.instance
    assert leftovers(group, instance) == []


def test_kernel_target_with_a_pid_filter() -> None:
    child = subprocess.Popen(
        ["sh", "-c", "read x; exec cat /proc/version"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    events: list[Event] = []
    try:
        with Kernel(pid=child.pid, sink=events.append) as k:
            k.add("p:open do_sys_openat2 name=+0(%si):ustring")
            os.close(os.open("/proc/version", os.O_RDONLY))  # ours: must not be recorded
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            child.stdin.close()
            assert k.run(timeout=60) is True  # returns when the process has ended
    finally:
        child.wait(timeout=30)
    assert events and all(e.pid == child.pid for e in events), events
    assert "/proc/version" in [e.arg("name") for e in events]
    assert {e.comm for e in events} <= {"sh", "cat"}
    no_session_left()
