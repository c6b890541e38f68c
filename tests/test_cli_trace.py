"""The tracing commands (`trace`, `count`, `latency`, `hist`) against real processes.

Outputs are checked exactly where the program makes them exact (hit counts, fetched values,
event names), and the trace text is compared field by field with what the kernel's own
uprobe_events prints for the same probe lines on the same program.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import support

pytestmark = pytest.mark.ptrace

KPROBES = support.KPROBES
CONTEXT = re.compile(r"^ *(?P<comm>\S+)-(?P<pid>\d+) +\[(?P<cpu>\d{3})\] +(?P<ts>\d+\.\d{6}): ")


cli = support.cli


def bodies(stdout: str) -> list[str]:
    """The part of each trace line after the context (``comm-pid [cpu] ts: ``)."""
    out = []
    for line in stdout.splitlines():
        m = CONTEXT.match(line)
        if m:
            out.append(line[m.end() :])
    return out


def count_rows(stdout: str) -> dict[str, int]:
    """The ``FUNC COUNT`` table of ``kprobes count``, as {function: hits}."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("FUNC"))
    return {line.split()[0]: int(line.split()[1]) for line in lines[head + 1 :]}


def histogram_total(stdout: str, unit: str) -> int:
    """The sum of a latency histogram's bucket counts (``unit``: the column header's)."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if unit in line and "distribution" in line)
    return sum(
        int(line.split(":")[1].split("|")[0]) for line in lines[header + 1 :] if "->" in line
    )


@pytest.fixture
def target(build) -> Path:
    return build("target")


def test_trace_prints_the_kernel_format_with_fetched_values(target):
    r = cli(
        "trace",
        "-c",
        f"{target} 3",
        "p:mywork work i=%di:s64 c=@counter:u64",
        "r work ret=$retval:x64 arg=$arg1:u32",
        "p show s=+0(%di):string",
    )
    assert r.returncode == 0, r.stderr
    main_size = support.symbol(target, "main").size
    caller = rf"\(main\+0x[0-9a-f]+/{main_size:#x} <- work\)"
    got = bodies(r.stdout)
    assert len(got) == 7, r.stdout
    work = [line for line in got if not line.startswith("p_show")]
    assert work[0::2] == [
        f"mywork: (work+0x0/{support.symbol(target, 'work').size:#x}) i={i} c={c}"
        for i, c in ((0, 0), (1, 0), (2, 1))
    ]
    for line, (ret, arg) in zip(work[1::2], ((0, 0), (3, 1), (7, 2)), strict=True):
        assert re.fullmatch(rf"r_work_0: {caller} ret={ret:#x} arg={arg}", line), line
    assert (
        got[-1]
        == f'p_show_0: (show+0x0/{support.symbol(target, "show").size:#x}) s="hello kprobes"'
    )
    contexts = [CONTEXT.match(line) for line in r.stdout.splitlines() if CONTEXT.match(line)]
    assert {m["comm"] for m in contexts if m} == {"target"}
    stamps = [float(m["ts"]) for m in contexts if m]
    assert stamps == sorted(stamps)
    assert "7 events, 7 hits, 0 missed, 0 dropped" in r.stderr


def test_trace_json_max_events_and_filter(target):
    r = cli("trace", "--json", "-n", "2", "-c", f"{target} 10", "work i=%di:u32")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [e["args"] for e in events] == [{"i": 0}, {"i": 1}]
    assert all(e["event"] == "kprobes/p_work_0" and e["comm"] == "target" for e in events)
    assert {"pid", "tid", "timestamp", "ip"} <= set(events[0])
    r = cli("trace", "--filter", "i >= 7 && i != 8", "-c", f"{target} 10", "work i=%di:u32")
    assert r.returncode == 0, r.stderr
    assert [b.rsplit(" ", 1)[1] for b in bodies(r.stdout)] == ["i=7", "i=9"]


def test_trace_perfetto_pairs_entries_and_returns(target, tmp_path):
    out = tmp_path / "trace.json"
    r = cli("trace", "--perfetto", out, "-c", f"{target} 4", "p work", "r work")
    assert r.returncode == 0, r.stderr
    trace = json.loads(out.read_text())
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(slices) == 4 and all(s["name"] == "work" and s["dur"] >= 0 for s in slices)
    assert any(e.get("ph") == "M" and e.get("name") == "thread_name" for e in trace["traceEvents"])


def test_count_specs_and_glob_patterns(target):
    r = cli("count", "-c", f"{target} 5", "work", "comp*", "kpt_*")
    assert r.returncode == 0, r.stderr
    assert f"{'FUNC':<36} {'COUNT':>8}" in r.stdout.splitlines()
    rows = count_rows(r.stdout)
    # kpt_asm calls kpt_leaf; kpt_iret and kpt_int3 are never called (zero rows are omitted)
    assert rows == {"compute": 1, "kpt_asm": 2, "kpt_leaf": 2, "work": 5}
    r = cli("count", "--json", "-c", f"{target} 5", "work")
    assert [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")] == [
        {"probe": "work", "hits": 5}
    ]


def test_latency_histogram_counts_every_call(build):
    rets = build("rets")
    r = cli("latency", "-u", "--maxactive", "100", "-c", f"{rets} rec 20", "rec")
    assert r.returncode == 0, r.stderr
    assert histogram_total(r.stdout, "usecs") == 21
    assert re.search(r"avg = \d+ usecs, total: \d+ usecs, count: 21", r.stdout)
    assert "0 missed" in r.stderr


def test_hist_frequency_table_of_a_fetched_value(target):
    r = cli("hist", "-c", f"{target} 12", "work i=%di:u64", "--key", "i", "-H")
    assert r.returncode == 0, r.stderr
    rows = {
        line.split(":")[0].strip(): int(line.split(":")[1].split("|")[0])
        for line in r.stdout.splitlines()
        if "->" in line
    }
    assert rows == {"0 -> 1": 2, "2 -> 3": 2, "4 -> 7": 4, "8 -> 15": 4}
    r = cli("hist", "-c", f"{target} 3", "work i=%di:u64", "--key", "i")
    assert r.returncode == 0, r.stderr
    assert sorted(line.split() for line in r.stdout.splitlines()[-3:]) == [
        ["1", "0"],
        ["1", "1"],
        ["1", "2"],
    ]


@pytest.mark.parametrize(
    ("spec", "message", "column"),
    [
        ("work i=%zz", "Invalid register name", 7),
        ("p:ev work x=$retval", "$retval", 12),
        ("work i=+0(%di):u99", "type", 15),
        ("work a=+0(%di):u8[64]", "too big", 18),
    ],
)
def test_bad_specs_exit_2_with_the_column_and_touch_nothing(target, popen, spec, message, column):
    prog = popen([target, 100000], stdout=subprocess.DEVNULL)
    r = cli("trace", "-p", prog.pid, spec)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("kprobes: ") and message.lower() in lines[0].lower()
    assert lines[1] == f"  {spec}"
    assert lines[2] == "  " + " " * column + "^", (spec, lines)
    # Nothing attached: the spec is refused before the program is touched.
    status = Path(f"/proc/{prog.pid}/status").read_text()
    assert "TracerPid:\t0" in status


def test_filter_on_unknown_field_is_a_usage_error(target):
    r = cli("trace", "--filter", "nosuch == 1", "-c", f"{target} 1", "work i=%di")
    assert r.returncode == 2
    assert "nosuch" in r.stderr


def test_trace_text_matches_the_kernels_uprobe_events(target):
    """The same probe lines through the kernel's uprobe_events and through us."""
    root = support.tracefs_root()
    assert root is not None, "tracefs with uprobe_events is needed (root, as on these machines)"
    path = os.path.realpath(target)
    work_off = support.file_offset(target, support.symbol(target, "work").value)
    show_off = support.file_offset(target, support.symbol(target, "show").value)
    lines = [
        f"p:kptcmp/work_in {path}:{work_off:#x} i=%di:s32 w=%di:x16 st=$stack0:u8",
        f"r:kptcmp/work_out {path}:{work_off:#x} ret=$retval:s64",
        f"p:kptcmp/show_in {path}:{show_off:#x} s=+0(%di):string c=+0(%di):char",
    ]
    instance = root / "instances" / f"kptcmp_{os.getpid()}"
    instance.mkdir()
    defined: list[str] = []
    try:
        # The kernel's trace file without the irq-flags column: the layout we print.
        support._append(instance / "options" / "irq-info", "0")
        for line in lines:
            support._append(root / "uprobe_events", line + "\n")
            defined.append(line.split()[0].split(":", 1)[1])
        for name in defined:
            support._append(instance / "events" / name / "enable", "1")
        kernel_run = subprocess.run([target, "3"], capture_output=True, timeout=30)
        support._append(instance / "tracing_on", "0")
        kernel_text = (instance / "trace").read_text()
    finally:
        for name in defined:
            with contextlib.suppress(OSError):
                support._append(instance / "events" / name / "enable", "0")
        for name in defined:
            with contextlib.suppress(OSError):
                support._append(root / "uprobe_events", f"-:{name}\n")
        instance.rmdir()
    ours = cli("trace", "-c", f"{target} 3", *lines)
    assert ours.returncode == 0, ours.stderr
    k = [line for line in kernel_text.splitlines() if CONTEXT.match(line)]
    o = [line for line in ours.stdout.splitlines() if CONTEXT.match(line)]
    assert len(k) == len(o) == 7, (kernel_text, ours.stdout)
    assert kernel_run.returncode == 0
    for kl, ol in zip(k, o, strict=True):
        km, om = CONTEXT.match(kl), CONTEXT.match(ol)
        assert km and om
        assert km["comm"] == om["comm"] == "target"
        kbody, obody = kl[km.end() :], ol[om.end() :]
        # event name, then the location (the kernel prints addresses for uprobes, we print
        # sym+off/size), then the args: names, order and values must be identical
        kev, _, krest = kbody.partition(": ")
        oev, _, orest = obody.partition(": ")
        assert kev == oev
        kargs = krest.split(") ", 1)[1]
        oargs = orest.split(") ", 1)[1]
        assert kargs == oargs, (kl, ol)


def test_count_intervals_duration_and_ctrl_c_on_an_attached_program(build, popen):
    ticker = build("ticker")
    prog = popen([ticker, 100000, 2000], stdout=subprocess.DEVNULL)
    r = cli("count", "-p", prog.pid, "-i", "0.4", "-d", "1.3", "work")
    assert r.returncode == 0, r.stderr
    tables = [i for i, line in enumerate(r.stdout.splitlines()) if line.startswith("FUNC")]
    assert len(tables) >= 3, r.stdout  # one per interval, and the last partial one
    assert support.is_alive(prog.pid)  # detached, still running
    # Ctrl-C ends a trace and still prints the summary.
    tracer = popen(
        [KPROBES, "trace", "-p", prog.pid, "work i=%di:u64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert tracer.stdout is not None
    first = support.read_line(tracer.stdout.fileno(), 20).decode()
    assert re.search(r": p_work_0: \(work\+0x0/0x[0-9a-f]+\) i=\d+$", first.rstrip())
    os.kill(tracer.pid, signal.SIGINT)
    _, err = tracer.communicate(timeout=20)
    assert tracer.returncode == 0, err
    assert re.search(rb"\d+ events, \d+ hits, 0 missed, 0 dropped", err)
    assert support.is_alive(prog.pid)
    assert "TracerPid:\t0" in Path(f"/proc/{prog.pid}/status").read_text()


def test_live_status_line_when_stderr_is_a_terminal(build, popen):
    import pty
    import select

    ticker = build("ticker")
    prog = popen([ticker, 100000, 2000], stdout=subprocess.DEVNULL)
    master, slave = pty.openpty()
    try:
        run = popen(
            [KPROBES, "count", "-p", prog.pid, "-d", "1.6", "work"],
            stdout=subprocess.PIPE,
            stderr=slave,
        )
        os.close(slave)
        run.wait(timeout=30)
        data = b""
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(master)
    assert run.returncode == 0
    statuses = re.findall(rb"\r[^\r\n]*events[^\r\n]*", data)
    assert len(statuses) >= 2, data  # refreshed while running (every 0.5 s)
    assert re.search(rb"\d+ events, \d+ hits, 0 missed, 0 dropped", data)


@pytest.mark.parametrize("tier", ["opt", "traps"])
def test_a_program_killed_by_a_signal_is_said_so(build, tier):
    """A traced program that dies of a signal is a fact the user must see (strace's "+++
    killed by SIGILL +++"): the command says so on stderr, beside its table, and exits with
    the command's status (128 + SIGILL), as strace does."""
    target = build("target")
    extra = ["--no-optimize"] if tier == "traps" else []
    r = support.cli(
        "count", "-c", f"sh -c '{target} 3; kill -ILL $$'", "libc:malloc", *extra, timeout=120
    )
    assert r.returncode == 128 + signal.SIGILL, r.stderr
    assert re.search(r"^kprobes: process \d+ was killed by SIGILL$", r.stderr, re.M), r.stderr
    assert "libc:malloc" in r.stdout
    r = support.cli("count", "-c", f"{target} 3", "libc:malloc", *extra, timeout=120)
    assert "killed by" not in r.stderr, r.stderr


@pytest.mark.parametrize("extra", [[], ["-T"]], ids=["rows", "per event"])
def test_a_reader_that_stops_reading_ends_the_trace_quietly(build, popen, extra):
    """``kprobes trace ... | head -2``: the run ends as after ``-n`` once the pipe closes,
    the probes removed and the summary said, with no traceback and status 0."""
    target = build("target")
    argv = [KPROBES, "trace", *extra, "-c", f"{target} 3000000", "p work i=%di"]
    lines, err, status = support.read_then_close(popen, argv, 2)
    assert status == 0, err
    # The program writes to the same pipe: on a busy machine its lines may come first.
    own = (b"sum=", b"compute=", b"show ", b"asm1=")
    assert all(b"p_work_0:" in line or line.startswith(own) for line in lines), lines
    assert "Traceback" not in err and "(its output closed)" in err, err
