"""The tracing commands on the kernel's backends: ``--backend uprobes`` live on this host, and
``--kernel`` where the kernel lacks kprobes (the kprobes side runs in the VM: tests/vm/guest).

The same specs must give the same events and the same aggregates whichever backend runs them:
each test runs a command on our ptrace backend and on the kernel's uprobes and compares.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import support
from test_cli_trace import KPROBES, bodies, cli, count_rows, histogram_total

pytestmark = pytest.mark.ptrace

TRACEFS = support.tracefs_root()
needs_uprobes = support.needs_uprobes


@pytest.fixture
def target(build) -> Path:
    return build("target")


def sessions_in_tracefs() -> tuple[set[str], list[str]]:
    """The kprobes sessions' instances and uprobe_events lines (other tools' are ignored)."""
    assert TRACEFS is not None
    instances = {p.name for p in (TRACEFS / "instances").iterdir() if p.name.startswith("kprobes_")}
    lines = (TRACEFS / "uprobe_events").read_text().splitlines()
    return instances, [line for line in lines if ":kprobes_" in line or "othertool" in line]


@pytest.fixture
def tracefs_state() -> Iterator[None]:
    """Every session a test runs must leave tracefs as it found it."""
    before = sessions_in_tracefs()
    yield
    assert sessions_in_tracefs() == before, "a uprobes session left something in tracefs"


SPECS = (
    "p:mywork work i=%di:u32 c=@counter:s64",
    "r work ret=$retval:s64",
    "show s=+0(%di):string",
)


@needs_uprobes
def test_trace_gives_the_same_events_on_both_backends(target, tracefs_state):
    ours = cli("trace", "-c", f"{target} 4", *SPECS)
    kernels = cli("trace", "--backend", "uprobes", "-c", f"{target} 4", *SPECS)
    assert ours.returncode == kernels.returncode == 0, kernels.stderr
    assert bodies(kernels.stdout) == bodies(ours.stdout)
    assert len(bodies(kernels.stdout)) == 9  # 4 entries, 4 returns, 1 show
    assert "p_show_0: (show+0x0/" in kernels.stdout and 's="hello kprobes"' in kernels.stdout
    assert "9 events, 9 hits, 0 missed, 0 dropped" in kernels.stderr
    # The program's own output is untouched.
    plain = subprocess.run([str(target), "4"], capture_output=True, text=True).stdout
    own = [line for line in kernels.stdout.splitlines() if not bodies(line)]
    assert own == plain.splitlines()


@needs_uprobes
def test_trace_json_carries_the_same_fields(target, tracefs_state):
    spec = "work i=%di:u32"
    ours = cli("trace", "--json", "-c", f"{target} 3", spec)
    kernels = cli("trace", "--json", "--backend", "uprobes", "-c", f"{target} 3", spec)

    def records(out: str) -> list[dict[str, object]]:
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    a, b = records(ours.stdout), records(kernels.stdout)
    assert [e["args"] for e in b] == [e["args"] for e in a] == [{"i": i} for i in range(3)]
    assert {e["comm"] for e in b} == {"target"}
    # The kernel session's event group is its own (kprobes_<pid>), never the shared "uprobes".
    assert all(str(e["event"]).endswith("/p_work_0") for e in b)


@needs_uprobes
def test_count_with_globs_matches_our_backend(target, tracefs_state):
    args = ("-c", f"{target} 5", "work", "comp*", "kpt_*")
    ours = cli("count", *args)
    kernels = cli("count", "--backend", "uprobes", *args)
    assert kernels.returncode == 0, kernels.stderr
    assert (
        count_rows(kernels.stdout)
        == count_rows(ours.stdout)
        == {
            "compute": 1,
            "kpt_asm": 2,
            "kpt_leaf": 2,
            "work": 5,
        }
    )


@needs_uprobes
def test_latency_pairs_every_call_with_its_entry(build, tracefs_state):
    rets = build("rets")
    r = cli("latency", "-u", "--backend", "uprobes", "-c", f"{rets} rec 20", "rec")
    assert r.returncode == 0, r.stderr
    assert (
        histogram_total(r.stdout, "usecs") == 21
    )  # rec(20) recurses down to rec(0): every return paired
    assert re.search(r"count: 21$", r.stdout, re.M)


@needs_uprobes
@pytest.mark.parametrize(
    "argv",
    [("latency", "--maxactive", "4", "rec"), ("trace", "r4 rec")],
    ids=["latency --maxactive", "trace rN"],
)
def test_a_pool_size_is_refused_on_uprobes(build, tracefs_state, argv):
    """The kernel's uretprobes keep no instance pool: an ``rN`` is refused, not dropped."""
    rets = build("rets")
    r = cli(argv[0], "--backend", "uprobes", "-c", f"{rets} rec 3", *argv[1:])
    assert r.returncode == 1, r.stderr
    assert "Uprobes cannot honour maxactive=4 on a Kretprobe" in r.stderr, r.stderr


@needs_uprobes
def test_hist_matches_our_backend(target, tracefs_state):
    args = ("-c", f"{target} 12", "work i=%di:u64", "--key", "i")
    ours = cli("hist", *args)
    kernels = cli("hist", "--backend", "uprobes", *args)
    assert kernels.returncode == 0, kernels.stderr

    def table(out: str) -> list[str]:
        return [line for line in out.splitlines() if re.match(r"\s*\d+\s+\d+$", line)]

    assert table(kernels.stdout) == table(ours.stdout)
    assert len(table(kernels.stdout)) == 12


@needs_uprobes
def test_attach_by_pid_leaves_the_program_running(build, tmp_path, tracefs_state):
    ticker = build("ticker")
    out = tmp_path / "ticker.out"
    with out.open("w") as f:
        # Never done by itself (400 ticks, 2 s, once ended before a loaded machine's
        # `trace` had started): killed below.
        prog = subprocess.Popen([str(ticker), "1000000", "5000"], stdout=f)
    try:
        support.wait_for_lines(out, 2, timeout=10)
        r = cli("trace", "--backend", "uprobes", "-p", prog.pid, "-n", "3", "work i=%di:u64")
        assert r.returncode == 0, r.stderr
        values = [int(b.split("i=")[1]) for b in bodies(r.stdout)]
        assert len(values) == 3 and values == list(range(values[0], values[0] + 3))
        assert prog.poll() is None  # still running, and still right afterwards
        n = len(support.file_lines(out))
        support.wait_for_lines(out, n + 2, timeout=10)
    finally:
        prog.kill()
        prog.wait()
    for line in support.file_lines(out):
        if line.startswith("tick"):
            _, i, v = line.split()
            assert int(v) == int(i) ** 2 + 1


@needs_uprobes
def test_a_file_for_every_process_that_runs_it(target, tracefs_state):
    """No -p/-c: the uprobe is on the file, and every process running it hits it."""
    assert TRACEFS is not None
    tracer = subprocess.Popen(
        [
            KPROBES,
            "trace",
            "--backend",
            "uprobes",
            "-n",
            "4",
            "-d",
            "60",
            f"p:ev {target}:work i=%di:u32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The event enabled in the session's instance: the probe is armed (which took from 5 to 26 s
    # on a loaded 2-vCPU guest: no sleep is long enough). The trace ends with the 4th event; the
    # kernel's count of hits says there were no more.
    group = f"kprobes_{tracer.pid}"
    enable = TRACEFS / "instances" / group / "events" / group / "ev" / "enable"

    def armed() -> bool:
        assert tracer.poll() is None, tracer.communicate()
        with contextlib.suppress(OSError):
            return enable.read_text().strip() == "1"
        return False

    support.wait_until(armed, 60, "the uprobe to be enabled")
    runs = [subprocess.run([str(target), "2"], capture_output=True) for _ in range(2)]
    out, err = tracer.communicate(timeout=70)
    assert tracer.returncode == 0, err
    pids = {line.split("-")[1].split()[0] for line in out.splitlines() if " ev: " in line}
    assert len(bodies(out)) == 4 and len(pids) == 2, out
    assert "4 events, 4 hits, 0 missed, 0 dropped" in err, err
    assert all(r.returncode == 0 for r in runs)


def test_ptrace_backend_needs_a_process() -> None:
    r = cli("count", "work")
    assert r.returncode == 1
    assert r.stderr == (
        "kprobes: the ptrace backend probes processes: give -p PID[,PID...] or -c CMD (or "
        "--kernel, or --backend uprobes with /PATH:SYMBOL specs)\n"
    )


@needs_uprobes
def test_several_event_groups_are_refused(target, tracefs_state):
    r = cli("trace", "--backend", "uprobes", "-c", f"{target} 1", "p:a/x work", "p:b/y show")
    assert r.returncode == 2
    assert "one event group" in r.stderr and "a, b" in r.stderr


@needs_uprobes
def test_a_group_that_exists_is_refused_and_left_alone(target, tracefs_state):
    """Another tool's group: one clear error; its events are not touched."""
    assert TRACEFS is not None
    offset = support.file_offset(target, support.symbol(target, "work").value)
    support._append(TRACEFS / "uprobe_events", f"p:othertool/ev {target}:{offset:#x}")
    try:
        r = cli("trace", "--backend", "uprobes", "-c", f"{target} 1", "p:othertool/mine work")
        assert r.returncode == 1
        assert "othertool" in r.stderr and "already exists" in r.stderr
        assert "p:othertool/ev" in (TRACEFS / "uprobe_events").read_text()
    finally:
        support._append(TRACEFS / "uprobe_events", "-:othertool/ev")


def test_kernel_backend_says_why_it_cannot_work_here():
    """On a kernel without CONFIG_KPROBES (this host's), --kernel says so and what to use."""
    if TRACEFS is not None and (TRACEFS / "kprobe_events").exists():
        pytest.skip("this kernel has kprobe_events: the --kernel tests run in tests/vm")
    r = cli("trace", "--kernel", "-d", "1", "p do_sys_openat2")
    assert r.returncode == 1
    assert "built without CONFIG_KPROBES" in r.stderr
    assert "Uprobes target" in r.stderr and "Process target" in r.stderr


def _running(argv: list[str]) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1]
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if [c.decode() for c in cmdline] == argv and state != "Z":
                found.append(int(entry))
    return found


@pytest.mark.parametrize("backend", ["ptrace", "uprobes"])
def test_an_early_end_stops_the_command(build, backend, tracefs_state):
    """-n/-d end the session before a -c command: the command, started for the session, ends
    with it (as under bpftrace -c) instead of running on unseen."""
    if backend == "uprobes" and TRACEFS is None:
        pytest.skip("the kernel's uprobes need tracefs")
    ticker = str(build("ticker"))
    argv = [ticker, "100003", "1000"]
    r = cli("trace", "--backend", backend, "-n", "3", "-c", " ".join(argv), "work i=%di:u64")
    assert r.returncode == 0, r.stderr
    assert len(bodies(r.stdout)) == 3
    assert _running(argv) == []


@needs_uprobes
def test_a_line_the_kernel_refuses_shows_its_error_log(target, tracefs_state):
    """Our grammar accepts ``:symbol`` (kprobes have it); the kernel's uprobes do not, and
    say so in error_log, which the command shows with its caret."""
    r = cli("trace", "--backend", "uprobes", "-c", f"{target} 1", "work x=%di:symbol")
    assert r.returncode == 1
    assert "Unknown type is specified" in r.stderr
    command = next(line for line in r.stderr.splitlines() if "Command:" in line)
    caret = next(line for line in r.stderr.splitlines() if line.strip() == "^")
    assert command[caret.index("^") :] == "symbol"
