"""Several return probes on one function, on the fast tier (process/fast/optimizer.py
``_return_action``, returns.py, arch/x86_64/retstack.py ``_emit_caller``): one detour hooks
the call once per probe, each later hook keeping the earlier one's trampoline as the return
address (a chain, as a tail call makes); the returns come back through each trampoline,
newest first, and each writes its own records or counts into its own counters.

A site whose probes change has its detour made again (``SiteOpt.probes``): the last test.

The proof is the trap tier (``--no-optimize``: the same lines, in the same order) and the
programs' own output (every return reached its real caller).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support
from test_fast_return_records import _PREFIX, event_lines
from test_fast_returns import optimized, probed_by_a_driver
from test_retprobes import run_to_exit, start

from kprobes import Kprobe, Kretprobe

pytestmark = pytest.mark.ptrace

# Two return specs with different fetch-args, and an entry spec, on one function.
SPECS = ("p rec k=%di", "r rec ret=$retval:s32", "r:other rec n=$arg1 m=$arg1:s8 ax=%ax")


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def both_entries_optimized(proc: Any, rp: Kretprobe) -> bool:
    entries = [e for e in proc.list() if e.addr == rp.addr]
    return len(entries) == 2 and all(e.is_optimized for e in entries)


def traced(*flags: str, argv: list[Any]) -> Any:
    r = support.cli("trace", *flags, "-c", " ".join(map(str, argv)), *SPECS, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_two_return_specs_on_one_function_print_the_trap_tiers_lines_in_order(rets):
    argv = [rets, "rec", 25]
    output = support.reference_output(argv)
    fast, traps = traced(argv=argv), traced("--no-optimize", argv=argv)
    assert "uses a breakpoint" not in fast.stderr  # one jump: the entry and both returns

    def in_order(stdout: str) -> list[str]:
        text = support.without_output_of(stdout, output)
        return [_PREFIX.sub("", line) for line in text.splitlines() if _PREFIX.match(line)]

    lines = in_order(fast.stdout)
    assert lines == in_order(traps.stdout) and len(lines) == 3 * 26
    # Newest hook first, as the trap tier reports a chain; each names the real caller.
    assert lines[26].startswith("other: (rec+") and lines[27].startswith("r_rec_0: (rec+")
    assert lines[-2].startswith("other: (main+") and lines[-1].startswith("r_rec_0: (main+")
    assert "78 events, 78 hits, 0 missed, 0 dropped" in fast.stderr


def test_two_return_specs_on_threads_match_the_trap_tier(rets):
    argv = [rets, "threads", 3, 4, 30]
    output = support.reference_output(argv)
    fast, traps = traced(argv=argv), traced("--no-optimize", argv=argv)
    assert "uses a breakpoint" not in fast.stderr
    lines = event_lines(fast.stdout, output)
    assert lines == event_lines(traps.stdout, output) and len(lines) == 3 * 3 * 4 * 31
    assert output.decode() in fast.stdout


@pytest.mark.parametrize("together", [True, False], ids=["together", "one-after-the-other"])
def test_an_aggregating_and_a_recording_return_probe_share_one_site(
    spawn, rets, tmp_path, together
):
    """A probe placed beside an optimized one has the site's detour made again, with both
    hooks (registered in one call, or the second after the first is optimized)."""
    argv = [rets, "rec", 30]
    proc, out = start(spawn, tmp_path, argv)
    events: list[Any] = []
    timed = Kretprobe(symbol="rec", optimize=True)
    recorded = Kretprobe(
        symbol="rec",
        optimize=True,
        async_handler=lambda _rp, ev: events.append(ev),
        args="ret=$retval:s64 n=$arg1",
    )
    if together:
        proc.register_kretprobes([timed, recorded])
    else:
        proc.register_kretprobe(timed)
        assert optimized(proc, timed)
        proc.register_kretprobe(recorded)
    assert both_entries_optimized(proc, timed)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output(argv)
    assert timed.nhit == recorded.nhit == len(events) == 31
    assert timed.kp.nhit == recorded.kp.nhit == 31  # every entry by the detour: no trap
    assert sum(timed.hist_slots) == 31 and timed.nmissed == timed.nabandoned == 0
    assert [ev.args[0].value for ev in events] == [k * (k + 1) // 2 for k in range(31)]
    assert [ev.args[1].value for ev in events] == list(range(31))
    assert {ev.location.split("+")[0] for ev in events} == {"rec", "main"}  # real callers


def test_detach_with_frames_hooked_twice_leaves_a_working_program(spawn, rets):
    depth = 20
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    proc = spawn([rets, "waitblock", depth], stdin=in_r, stdout=out_w)
    os.close(in_r)
    os.close(out_w)
    first = Kretprobe(symbol="rec_block", optimize=True)
    second = Kretprobe(symbol="rec_block", optimize=True, async_handler=print, args="n=$arg1")
    proc.register_kretprobes([first, second])
    assert both_entries_optimized(proc, first)
    os.write(in_w, b"go\n")
    while first.kp.nhit < depth + 1:  # every frame hooked by both, the program at the bottom
        proc.run(timeout=0.1)
    assert support.read_line(out_r, 10) == b"bottom\n"
    proc.detach()  # every frame's real return address back, through both chains
    os.write(in_w, b"go\n")
    want = depth * (depth + 1) // 2
    assert support.read_line(out_r, 10) == f"block={want + 1}\n".encode()
    assert support.read_line(out_r, 10) == f"rec={want}\n".encode()
    status = support.wait_child(proc.pid, 10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_probe_leaving_a_shared_site_leaves_the_others_counts_their_own(spawn, rets):
    """Frames hooked by two probes; one is unregistered while they are live: the other
    counts each of their returns once (its trampoline of before still counts into its own
    block of before), the gone one's trampoline into no one's."""
    depth = 20
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    proc = spawn([rets, "waitblock", depth], stdin=in_r, stdout=out_w)
    os.close(in_r)
    os.close(out_w)
    # The one that goes hooks fewer frames (its 5 instances), the one that stays all.
    gone = Kretprobe(symbol="rec_block", optimize=True, maxactive=5)
    kept = Kretprobe(symbol="rec_block", optimize=True)
    proc.register_kretprobes([gone, kept])
    assert both_entries_optimized(proc, kept)
    os.write(in_w, b"go\n")
    while kept.kp.nhit < depth + 1:
        proc.run(timeout=0.1)
    assert support.read_line(out_r, 10) == b"bottom\n"
    proc.unregister_kretprobe(gone)
    assert optimized(proc, kept)
    os.write(in_w, b"go\n")
    run_to_exit(proc)
    want = depth * (depth + 1) // 2
    assert support.read_line(out_r, 10) == f"block={want + 1}\n".encode()
    assert kept.nhit == depth + 1 and sum(kept.hist_slots) == depth + 1
    assert kept.nmissed == kept.nabandoned == 0 and gone.nmissed > 0


def test_tool_killed_with_frames_hooked_by_two_probes_leaves_a_working_program(popen, rets):
    depth = 50
    symbols = ("rec_block", "rec_block@ret=$retval n=$arg1")  # one counts, one records
    prog, driver = probed_by_a_driver(popen, [rets, "waitblock", depth], *symbols)
    assert prog.stdin is not None and prog.stdout is not None
    prog.stdin.write(b"go\n")
    prog.stdin.flush()
    assert support.read_line(prog.stdout.fileno(), timeout=20) == b"bottom\n"
    driver.send_signal(signal.SIGKILL)  # 51 frames hooked twice, their tool gone
    driver.wait(timeout=10)
    out, err = prog.communicate(b"go\n", timeout=30)
    assert prog.returncode == 0, err.decode()[-2000:]
    want = depth * (depth + 1) // 2
    assert out == f"block={want + 1}\nrec={want}\n".encode()


def test_a_record_probe_placed_beside_an_optimized_one_gets_its_captures(spawn, build, tmp_path):
    """The site's detour is made again for the probes it has now: the second probe's
    fetch-arg (a data symbol, which the first does not read) is captured, as a trap reads it
    (the old detour, kept, gave it ``(fault)``)."""
    argv = [build("target"), 5]
    proc, out = start(spawn, tmp_path, argv)
    first: list[Any] = []
    second: list[Any] = []
    a = Kprobe(
        symbol="work", optimize=True, async_handler=lambda _, ev: first.append(ev), args="i=%di:u32"
    )
    proc.register_kprobe(a)
    assert [e.is_optimized for e in proc.list()] == [True]
    b = Kprobe(
        symbol="work",
        optimize=True,
        async_handler=lambda _, ev: second.append(ev),
        args="c=@counter:s64",
    )
    proc.register_kprobe(b)
    assert [e.is_optimized for e in proc.list()] == [True, True]
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output(argv)
    assert [ev.args[0].value for ev in first] == list(range(5))
    traps = support.cli("trace", "--no-optimize", "-c", f"{argv[0]} 5", "work c=@counter:s64")
    want = [int(line.rpartition("c=")[2]) for line in traps.stdout.splitlines() if " c=" in line]
    assert len(want) == 5 and [ev.args[0].value for ev in second] == want
