"""``kprobes record`` and ``kprobes script`` (issue 21, item 2).

Each test runs the commands through the command line's ``main()`` in this process on the
test program (its ``work`` loop jump-optimized: record probes):

- a 2,000,000-call loop recorded with no event lost, and every value there, in order;
- ``script`` prints ``trace``'s very bytes for the same run's records: ``trace`` runs with
  each read of the rings also handed to the recorder's tee, and its trap events to the
  file, and ``script`` of that file is compared whole with ``trace``'s output (text and
  ``--json``, many fetch types, a trap event in the middle, ``--filter``);
- a file cut short prints every whole record before the cut, a damaged one every event
  before the damage, and both say so on one line (exit status 1);
- ``report`` counts and histograms what ``script`` prints.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import support
from support import run_main as kprobes

from kprobes.cli import main as cli_main
from kprobes.cli import trace_cmd
from kprobes.cli.replay import Replay
from kprobes.output.recfile import END, META, RecordWriter
from kprobes.process.fast.reader import RingReader
from kprobes.process.fast.tee import ModuleInfo, RecordTee
from kprobes.symbols.elf import ElfImage, build_id

pytestmark = pytest.mark.ptrace

SUMMARY = re.compile(r"(\d+) events, (\d+) hits, (\d+) missed, (\d+) dropped")


@pytest.fixture
def target(build: Any) -> Path:
    return build("target")


def failing(*args: object) -> tuple[int, str, str]:
    """``kprobes ARGS`` in this process, which may fail: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.deadline(240)
def test_a_hot_loop_of_two_million_calls_is_recorded_whole(target: Path, tmp_path: Path) -> None:
    calls = 2_000_000
    data = tmp_path / "hot.data"
    _, err = kprobes("record", "-o", data, "-c", f"{target} {calls}", "p work i=%di:u64")
    m = SUMMARY.search(err)
    assert m is not None, err
    assert tuple(map(int, m.groups())) == (calls, calls, 0, 0)  # 0 dropped
    out, err = kprobes("script", data)
    values = [int(line.rpartition(" i=")[2]) for line in out.splitlines()]
    assert values == list(range(calls))  # every call, in order, its own value
    assert f"{calls} events printed" in err


SPECS = (
    r"p work a=%di:s64 b=%di:u32 c=%di d=%di:s8 e=%di:char f=%di:b4@2/32 h=%di:x16 k=\7"
    " n=$comm x=%di:s32 g=+0(%di):u8",  # g: address i, which faults
    "p show s=+0(%di):string bytes=+0(%di):u8[4]",
    "p compute x=%di:s32",  # keeps its breakpoint (a ret in its first 5 bytes): a trap event
    "p kpt_asm x=%di y=%si",  # two probes at one site: the per-event path
    "p kpt_asm z=%si",
    "p libc:printf f=%di",  # a second ring (libc is out of reach of the first): merged by time
)


def trace_and_record(monkeypatch: pytest.MonkeyPatch, data: Path, *argv: str) -> tuple[str, str]:
    """``kprobes trace ARGV``, each read of the rings also handed to the recorder's tee
    and each event its output handles (a trap's) also written: the file ``record`` would
    have written for the same run. (trace's stdout, stderr)."""
    f = open(data, "wb")  # noqa: SIM115 - closed below
    writer = RecordWriter(f)
    specs = [a for a in argv if a.startswith("p ")]
    at = argv.index("--filter") + 1 if "--filter" in argv else None
    writer.json(META, {"specs": specs, "filter": argv[at] if at else None})
    tees: dict[int, RecordTee] = {}
    readers: list[RingReader] = []
    deliver_blocks = RingReader.deliver_blocks
    handle = trace_cmd.TraceOutput.handle

    def both(self: RingReader, blocks: Any) -> None:
        if self.clock is not None:  # a live reader, not script's
            if id(self) not in tees:
                tees[id(self)] = RecordTee(self, len(tees) + 1, writer)
                readers.append(self)
            tees[id(self)].take(blocks)
        deliver_blocks(self, blocks)

    def handle_both(self: trace_cmd.TraceOutput, ev: Any) -> None:
        if not any(r.is_draining for r in readers):  # a trap's event, not a record's
            writer.event(ev)
        handle(self, ev)

    monkeypatch.setattr(RingReader, "deliver_blocks", both)
    monkeypatch.setattr(trace_cmd.TraceOutput, "handle", handle_both)
    try:
        out, err = kprobes("trace", *argv)
    finally:
        writer.json(END, {"events": 0, "hits": 0, "missed": 0, "dropped": 0})
        f.close()
        monkeypatch.undo()
    return out, err


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("filtered", [False, True], ids=["all", "filter"])
def test_script_prints_the_bytes_trace_printed(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool, filtered: bool
) -> None:
    data = tmp_path / "same.data"
    flags = ["--json"] if as_json else []
    if filtered:
        flags += ["--filter", 'a < 100 || a >= 2990 || s ~ "hell*" || x == 7 || x == 1']
    out, err = trace_and_record(monkeypatch, data, *flags, "-c", f"{target} 3000", *SPECS)
    m = SUMMARY.search(err)
    assert m is not None, err
    assert out.count("p_work_0") == (110 if filtered else 3000)
    assert "p_compute_0" in out and "p_kpt_asm_0" in out
    assert filtered or out.count("p_kpt_asm_0") == 4  # 2 calls, 2 probes
    assert filtered or out.count("p_libc_printf_0") == 4
    assert "(fault)" in out or "null" in out
    script, err = kprobes("script", *(["--json"] if as_json else []), data)
    assert script == out
    assert f"{m.group(1)} events printed" in err


def test_record_then_script_as_trace_prints(target: Path, tmp_path: Path) -> None:
    """What trace prints of a run, but for the thread ids and times, script prints of a
    recording of the same program."""
    data = tmp_path / "run.data"
    specs = SPECS[:3]  # not kpt_asm's: its values are stack addresses
    kprobes("record", "-o", data, "-c", f"{target} 3000", *specs)
    script, _ = kprobes("script", data)
    out, _ = kprobes("trace", "-c", f"{target} 3000", *specs)
    context = re.compile(r"^ *target-\d+ +\[\d+\] +\d+\.\d+: ", re.M)
    assert context.sub("", script) == context.sub("", out)
    as_json, _ = kprobes("script", "--json", data)
    events = [json.loads(line) for line in as_json.splitlines()]
    assert [e["args"]["a"] for e in events if e["event"] == "kprobes/p_work_0"] == list(range(3000))


def test_a_file_cut_short_prints_every_whole_record_before_the_cut(
    target: Path, tmp_path: Path
) -> None:
    data = tmp_path / "cut.data"
    kprobes("record", "-o", data, "-c", f"{target} 20000", "p work i=%di")
    whole, _ = kprobes("script", data)
    raw = data.read_bytes()
    cut = tmp_path / "short.data"
    cut.write_bytes(raw[: len(raw) // 2 + 13])  # in the middle of a record
    code, out, err = failing("script", cut)
    assert code == 1
    assert out and whole.startswith(out)
    lines = out.count("\n")
    assert abs(lines - 20000 / 2) < 20000 / 4  # every whole record of the first half
    (line,) = err.splitlines()
    assert "cut short" in line and f"the {lines} events before it were printed" in line


def test_a_damaged_file_prints_every_event_before_the_damage(target: Path, tmp_path: Path) -> None:
    data = tmp_path / "bad.data"  # on breakpoints: an event a chunk
    kprobes("record", "-o", data, "--no-optimize", "-c", f"{target} 2000", "p work i=%di")
    whole, _ = kprobes("script", data)
    assert whole.count("\n") == 2000
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad = tmp_path / "flipped.data"
    bad.write_bytes(bytes(raw))
    code, out, err = failing("script", bad)
    assert code == 1
    assert whole.startswith(out) and 500 < out.count("\n") < 1500
    (line,) = err.splitlines()
    assert "damaged" in line and "checksum" in line and "at byte" in line
    code, out, err = failing("script", tmp_path / "nothing.data")
    assert code == 1 and "No such file" in err
    (tmp_path / "text.data").write_text("hello\n")
    code, out, err = failing("script", tmp_path / "text.data")
    assert code == 1 and "not a kprobes record file" in err


def test_report_sums_up_what_script_prints(target: Path, tmp_path: Path) -> None:
    data = tmp_path / "sums.data"
    kprobes("record", "-o", data, "-c", f"{target} 5000", *SPECS[:3], "r work")
    counts, _ = kprobes("report", data)
    rows = dict(line.split() for line in counts.splitlines()[1:])
    assert rows == {
        "kprobes/p_work_0": "5000",
        "kprobes/r_work_0": "5000",
        "kprobes/p_show_0": "1",
        "kprobes/p_compute_0": "1",
    }
    log2, _ = kprobes("report", "--hist", "b", "-H", data)  # b: i as u32
    buckets = {
        int(m.group(1)): int(m.group(2))
        for m in re.finditer(r"^ *(\d+) -> \d+ *: (\d+)", log2, re.M)
    }
    assert buckets[0] == 2 and buckets[2] == 2 and buckets[4096] == 5000 - 4096
    assert sum(buckets.values()) == 5000
    table, _ = kprobes("report", "--hist", "s", data)
    assert '"hello kprobes"' in table
    latency, _ = kprobes("report", "--latency", "-u", data)
    assert "count: 5000" in latency and "usecs" in latency
    script, _ = kprobes("script", data)
    assert script.count("r_work_0") == 5000


def test_script_takes_trace_s_output_options(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "opts.data"
    perfetto = tmp_path / "trace.json"
    out, _ = trace_and_record(
        monkeypatch, data, "--perfetto", str(perfetto), "-c", f"{target} 300", *SPECS[:3]
    )
    again = tmp_path / "script.json"
    script, _ = kprobes("script", "--perfetto", again, data)
    assert script == out
    assert again.read_text() == perfetto.read_text()
    assert len(json.loads(again.read_text())["traceEvents"]) >= 302
    recorded = tmp_path / "wall.data"
    kprobes("record", "-o", recorded, "-c", f"{target} 30", "p work i=%di")
    wall, _ = kprobes("script", "-T", recorded)
    assert re.fullmatch(r"( *target-\d+ +\[\d+\] +\d\d:\d\d:\d\d\.\d{6}: p_work_0: .*\n){30}", wall)


def test_addresses_are_named_from_the_recorded_files_while_they_are_the_same(
    target: Path, tmp_path: Path, build: Any
) -> None:
    """A replayed process names an address as the live ``Symbolizer`` does, from the file
    mapped there (``MODS``) while its build-id is the recorded one; else in hex, and the
    file is listed as changed."""
    program = tmp_path / "prog"
    program.write_bytes(target.read_bytes())
    main = ElfImage.open(str(program)).lookup("main")
    assert main is not None
    bias = 0x5555_0000_0000
    replay = Replay(lambda ev: None)
    proc = replay._process(1)
    proc.modules = [ModuleInfo(str(program), bias, bias + 0x10000, bias, build_id(str(program)))]
    assert proc.symbolize(bias + main.value + 4) == f"main+0x4/{main.size:#x}"
    assert proc.symbolize(bias + 0x20000) == f"{bias + 0x20000:#x}"  # in no file
    program.write_bytes(build("jprobe").read_bytes())  # another file at the same path
    again = Replay(lambda ev: None)
    other = again._process(1)
    other.modules = proc.modules
    assert other.symbolize(bias + main.value + 4) == f"{bias + main.value + 4:#x}"
    assert again.changed == [str(program)]


@pytest.fixture
def busy(build: Any) -> Path:
    return build("busy")


def _record_busy(popen: Any, busy: Path, tmp_path: Path) -> tuple[Any, Any, Path, Path]:
    """``kprobes record -p`` of a running ``busy`` (2 threads), once its probe is placed:
    (the program, the tool, the file, the tool's stderr)."""
    from test_cli_ending import start, wait_placed

    prog = support.start_busy(popen, busy, 2, 20)
    data = tmp_path / "busy.data"
    tool, err = start(popen, ["record", "-o", data, "-p", prog.pid, "hot i=%di:s64"], tmp_path)
    wait_placed(tool, err, prog.pid, busy)
    time.sleep(1)
    return prog, tool, data, err


def test_a_signal_ends_a_recording_whole(busy: Path, popen: Any, tmp_path: Path) -> None:
    prog, tool, data, err = _record_busy(popen, busy, tmp_path)
    tool.send_signal(signal.SIGINT)
    assert tool.wait(timeout=30) == 0, err.read_text()
    m = SUMMARY.search(err.read_text())
    assert m is not None
    events = int(m.group(1))
    assert events > 0
    code, out, script_err = failing("script", data)
    assert code == 0, script_err
    assert out.count(" p_hot_0: ") == events  # what the summary said it recorded
    assert "ended by SIGINT" in script_err
    code, stdout, _ = support.stop_busy(prog)
    assert (code, stdout) == (0, support.busy_output(2, 20))


def test_a_recorder_killed_leaves_a_file_script_reads_to_the_cut(
    busy: Path, popen: Any, tmp_path: Path
) -> None:
    prog, tool, data, _ = _record_busy(popen, busy, tmp_path)
    os.kill(tool.pid, signal.SIGKILL)
    tool.wait(timeout=30)
    code, out, err = failing("script", data)
    assert code == 1
    assert out.count(" p_hot_0: ") > 0
    (line,) = err.splitlines()
    assert "cut short" in line and "were printed" in line
    code, stdout, _ = support.stop_busy(prog)  # the program carries on without the tool
    assert (code, stdout) == (0, support.busy_output(2, 20))


# -- record --block (issue 21, item 3: trace's --block, process/fast/lease.py) ----------


def test_block_loses_nothing_of_a_loop_much_longer_than_the_ring(
    target: Path, tmp_path: Path
) -> None:
    calls = 1_000_000  # 15 times what a 1 MiB ring holds
    data = tmp_path / "block.data"
    argv = ["record", "--block", "--ring-size", "1M", "-o", data, "-c", f"{target} {calls}"]
    _, err = kprobes(*argv, "p work i=%di:u64")
    m = SUMMARY.search(err)
    assert m is not None, err
    assert tuple(map(int, m.groups())) == (calls, calls, 0, 0)
    out, _ = kprobes("script", data)
    assert [int(line.rpartition(" i=")[2]) for line in out.splitlines()] == list(range(calls))
    code, _, err = failing("record", "--block", "--backend", "uprobes", "-c", target, "p work")
    assert code == 1 and "--block makes our own optimized probes wait" in err


def test_a_blocking_recorder_killed_releases_the_program(
    busy: Path, popen: Any, tmp_path: Path
) -> None:
    """The tool stopped, then SIGKILLed, while the program's threads wait for room in a
    full ring: they wait no longer than the lease, and the program ends unharmed."""
    from test_cli_ending import start, wait_placed

    prog = support.start_busy(popen, busy, 2, 20)
    data = tmp_path / "held.data"
    argv = ["record", "--block", "--ring-size", "64K", "-o", data, "-p", prog.pid]
    tool, err = start(popen, [*argv, "hot i=%di:s64"], tmp_path)
    wait_placed(tool, err, prog.pid, busy)
    time.sleep(0.5)
    os.kill(tool.pid, signal.SIGSTOP)  # nobody reads: the ring fills, the threads wait
    time.sleep(0.5)
    os.kill(tool.pid, signal.SIGKILL)
    tool.wait(timeout=30)
    code, stdout, _ = support.stop_busy(prog, timeout=20)
    assert (code, stdout) == (0, support.busy_output(2, 20))


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["text", "json"])
def test_script_into_a_reader_that_stops_reading_ends_quietly(
    target: Path, tmp_path: Path, popen: Any, extra: list[str]
) -> None:
    """``kprobes script FILE | head -2``: once the pipe closes the rest is written nowhere,
    with status 0 and no traceback (a batch write raised OutputClosed out of it)."""
    data = tmp_path / "run.data"
    kprobes("record", "-o", data, "-c", f"{target} 200000", "p work i=%di")
    argv = [support.KPROBES, "script", *extra, str(data)]
    lines, err, status = support.read_then_close(popen, argv, 2)
    assert status == 0, err
    assert all(b"p_work_0" in line for line in lines), lines
    assert "Traceback" not in err, err
