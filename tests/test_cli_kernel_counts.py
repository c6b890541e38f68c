"""``count`` on the kernel's uprobes has the kernel count the hits (issue 22, item 8).

Each hit used to be written as a record into the session's ring, read and decoded in Python
to add one to a row. Now, when nothing needs the events (no filter, no ``-n``) and every
process that runs the file is counted (no ``-p``/``-c``), the event is never enabled: perf
counters on it, one per CPU (kprobes/linux/perf.py), count in the kernel, and the tool reads
one number per probe. With ``-p``/``-c`` the hits of those processes are told apart by events,
as before: counters that follow a process tree lost hits on this kernel (docs/decisions.md);
the last test is the case that showed it, kept on the events.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import support
from support import cli, needs_uprobes
from test_cli_trace import count_rows

from kprobes.errors import TraceFsError
from kprobes.linux import perf

pytestmark = [pytest.mark.ptrace, needs_uprobes]

TOOL = (str(support.KPROBES), "count", "--backend", "uprobes")


def online_cpus() -> list[int]:
    text = Path("/sys/devices/system/cpu/online").read_text().strip()
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def session_enables(tool_pid: int) -> list[str]:
    """The ``enable`` file of each probe event in the session's instance."""
    root = support.tracefs_root()
    assert root is not None
    group = f"kprobes_{tool_pid}"
    events = root / "instances" / group / "events" / group
    return [(e / "enable").read_text().strip() for e in events.iterdir() if e.is_dir()]


def test_a_file_probed_for_every_process_is_counted_by_the_kernel(build: Any) -> None:
    """No -p, no -c: every process that runs the file; counters per CPU, and the events are
    never enabled (no record is written, none read)."""
    target = build("target")
    with subprocess.Popen(
        [*TOOL, "-x", str(target), "work", "compute"],  # perf's -x: bare names are the file's
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as tool:
        try:
            want = 2 * len(online_cpus())
            support.wait_until(
                lambda: support.perf_event_fds(tool.pid) >= want, 60, "the tool's counters"
            )
            for n in (3, 4):
                subprocess.run([target, str(n)], check=True, capture_output=True)
            assert session_enables(tool.pid) == ["0", "0"]
        finally:
            tool.send_signal(signal.SIGINT)  # on every way out: it removes its events
            out, err = tool.communicate(timeout=120)
    assert tool.returncode == 0, err
    assert count_rows(out) == {"work": 7, "compute": 2}


def test_a_wrapper_scripts_tree_is_counted_exactly(tmp_path: Path) -> None:
    """The tree that lost hits to inherited counters (a shim that runs helpers, then execs
    python3): with -c the events count every call, run after run."""
    shim = tmp_path / "python3"
    shim.write_text(
        "#!/bin/bash\n"
        'here=$(dirname "$0")\n'
        "version=$(uname -r | cut -d. -f1)\n"
        '/bin/true "$here" "$version"\n'
        'exec /usr/bin/python3 "$@"\n'
    )
    shim.chmod(0o755)
    program = "import json; d = {str(i): [i] * i for i in range(300)}; print(len(json.dumps(d)))"
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    command = f"{shim} -c {shlex.quote(program)}"
    counts = set()
    for _ in range(4):
        r = subprocess.run(
            [*TOOL, "-c", command, "libc:malloc"], capture_output=True, text=True, env=env
        )
        assert r.returncode == 0, r.stderr
        counts.add(count_rows(r.stdout)["libc:malloc"])
    assert len(counts) == 1, counts


def test_with_a_filter_the_events_are_read(build: Any) -> None:
    """A filter needs each event: the same file, the same count, from records."""
    target = build("target")
    r = cli("count", "--backend", "uprobes", "--filter", "tid > 0", "-c", f"{target} 5", "work")
    assert r.returncode == 0, r.stderr
    assert count_rows(r.stdout) == {"work": 5}


def test_kernel_counters_say_what_they_could_not_open() -> None:
    """A counter the kernel refuses is one line (the trace event's id and why)."""
    with pytest.raises(TraceFsError) as info:
        perf.Counter(1 << 40, pid=os.getpid())
    assert str(info.value).startswith(
        f"cannot count trace event {1 << 40} in process {os.getpid()}: "
    )
