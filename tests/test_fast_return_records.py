"""Records of returns written in the program (arch/x86_64/retstack.py's trampoline with a
record, process/fast/returns.py, reader.py): ``trace 'r ...'`` and
``Kretprobe(optimize=True, async_handler=...)`` without a trap on either side.

The proof is the trap tier: the same program traced with ``--no-optimize`` (or with the
optimization off) must print the same lines, field for field; the programs print what
their calls computed, so an unchanged output says every return reached its caller.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support
from test_fast_returns import optimized, probed_by_a_driver, register_on_tier
from test_retprobes import run_to_exit, start

from kprobes import Kretprobe
from kprobes.errors import UnsupportedOption

pytestmark = pytest.mark.ptrace

# "  rets-1234  [001]  11809.581642: " : the thread, the CPU and the time differ from run to run.
_PREFIX = re.compile(r"^\s*\S+-\d+\s+\[\d+\]\s+[\d.]+: ")


# Every argument register of mix(a, b, c, d, e, f) (tests/programs/rets.c), kept by the
# entry for the return's record, each cut to a type of its own; $arg2 twice.
SIX_ARGS = "a=$arg1:s64 b=$arg2:s64 c=$arg3 d=$arg4:u8 e=$arg5:s32 f=$arg6:s16 g=$arg2:x16"


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def event_lines(stdout: str, output: bytes) -> list[str]:
    """The trace's lines without the program's own and without their thread, CPU and time,
    sorted (threads' events interleave differently from run to run)."""
    text = support.without_output_of(stdout, output)
    return sorted(_PREFIX.sub("", line) for line in text.splitlines() if _PREFIX.match(line))


@pytest.mark.parametrize(
    ("command", "spec", "n"),
    [
        ("names 9", "r name_of s=+0($retval):string n=$retval:s8 c=+1($retval):char", 9),
        ("rec 30", "r rec ret=$retval:s32 ax=%ax bx=%bx bad=+0($retval):u64", 31),
        ("threads 4 3 40", "r rec ret=$retval:u64 at=%ip:symbol", 4 * 3 * 41),
        ("threads 2 3 30", "r rec n=$arg1 ret=$retval:s32 m=$arg1:s8 k=$arg1:symbol", 186),
        ("mix 40", f"r mix ret=$retval:s64 {SIX_ARGS}", 40),
    ],
    ids=["strings", "registers", "threads", "entry-arg", "six-entry-args"],
)
def test_trace_of_returns_in_the_program_prints_the_trap_tiers_lines(rets, command, spec, n):
    argv = [rets, *command.split()]
    output = support.reference_output(argv)
    fast = support.cli("trace", "-c", " ".join(map(str, argv)), spec, timeout=120)
    traps = support.cli("trace", "--no-optimize", "-c", " ".join(map(str, argv)), spec)
    assert fast.returncode == traps.returncode == 0, fast.stderr + traps.stderr
    assert "uses a breakpoint" not in fast.stderr  # the entry took the jump: no trap at all
    lines = event_lines(fast.stdout, output)
    assert len(lines) == n
    assert lines == event_lines(traps.stdout, output)
    assert output.decode() in fast.stdout
    assert f"{n} events, {n} hits, 0 missed, 0 dropped" in fast.stderr


def test_entry_and_return_of_one_function_share_its_jump(rets):
    """``'p rec' 'r rec'``: one site, one detour writing the entry's record then hooking
    the return, whose trampoline writes the return's: in the order the trap tier prints
    them (one thread), and no breakpoint."""
    argv = [rets, "rec", 25]
    specs = ["p rec k=%di", "r rec ret=$retval:s32 n=$arg1"]
    output = support.reference_output(argv)
    fast = support.cli("trace", "-c", " ".join(map(str, argv)), *specs)
    traps = support.cli("trace", "--no-optimize", "-c", " ".join(map(str, argv)), *specs)
    assert fast.returncode == traps.returncode == 0, fast.stderr + traps.stderr
    assert "uses a breakpoint" not in fast.stderr

    def in_order(stdout: str) -> list[str]:
        text = support.without_output_of(stdout, output)
        return [_PREFIX.sub("", line) for line in text.splitlines() if _PREFIX.match(line)]

    lines = in_order(fast.stdout)
    assert lines == in_order(traps.stdout) and len(lines) == 52
    assert "52 events, 52 hits, 0 missed, 0 dropped" in fast.stderr


def test_trace_block_keeps_every_record_of_returns(rets):
    """``--block``: a return that finds the ring full waits for the reader (the same wait
    as an entry's record), so every return of 16,160 is printed."""
    argv = [rets, "threads", 4, 40, 100]
    n = 4 * 40 * 101
    r = support.cli("trace", "--block", "-c", " ".join(map(str, argv)), "r rec ret=$retval")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("<- rec) ret=") == n
    assert f"{n} events, {n} hits, 0 missed, 0 dropped" in r.stderr


def test_block_when_full_keeps_every_return_through_a_small_ring(spawn, rets, tmp_path):
    """A ring of 128 records and 4 threads returning 16,160 times: each return that finds
    the ring full waits for the reader (the wait of an entry's record, ``--block``), none
    is dropped, and every return of each thread comes in the order it returned."""
    argv = [rets, "threads", 4, 40, 100]
    proc, out = start(spawn, tmp_path, argv)
    proc.records.ring_size = 8192
    proc.records.block_when_full = True
    seen: list[tuple[int, int]] = []
    rp = Kretprobe(
        symbol="rec",
        optimize=True,
        async_handler=lambda _, ev: seen.append((ev.tid, ev.args[0].value)),
        args="ret=$retval:u64",
    )
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    run_to_exit(proc, timeout=300)
    assert out.read_bytes() == support.reference_output(argv)
    n = 4 * 40 * 101
    assert len(seen) == rp.nhit == n and proc.dropped == 0
    descent = [k * (k + 1) // 2 for k in range(101)]
    for tid in {tid for tid, _ in seen}:
        assert [v for t, v in seen if t == tid] == descent * 40


def test_record_and_script_of_returns_in_the_program(rets, tmp_path):
    argv = [rets, "names", 6]
    spec = "r name_of s=+0($retval):string"
    data = tmp_path / "names.kpr"
    recorded = support.cli("record", "-o", data, "-c", " ".join(map(str, argv)), spec)
    assert recorded.returncode == 0, recorded.stderr
    assert "uses a breakpoint" not in recorded.stderr
    script = support.cli("script", data)
    traps = support.cli("trace", "--no-optimize", "-c", " ".join(map(str, argv)), spec)
    output = support.reference_output(argv)
    assert event_lines(script.stdout, b"") == event_lines(traps.stdout, output)
    assert len(event_lines(script.stdout, b"")) == 6


def returns_of(spawn: Any, rets: Path, tmp_path: Path, *, fast: bool) -> tuple[Kretprobe, list]:
    """rets rec 30 under a return probe with an async_handler, on the fast tier or (the
    optimization off) on traps: the probe and the events its handler was given."""
    argv = [rets, "rec", 30]
    proc, out = start(spawn, tmp_path, argv)
    events: list[Any] = []
    rp = Kretprobe(
        symbol="rec",
        optimize=True,
        async_handler=lambda probe, ev: events.append((probe, ev)),
        args="ret=$retval:s64 n=$arg1:u32",
        with_regs=True,
        maxactive=64,  # on traps the default is the document's max(10, 2 * threads)
    )
    register_on_tier(proc, rp, fast=fast)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output(argv)
    return rp, events


@pytest.mark.parametrize("fast", [True, False], ids=["in-the-program", "on-traps"])
def test_kretprobe_async_handler_gets_each_return_after_the_fact(spawn, rets, tmp_path, fast):
    rp, events = returns_of(spawn, rets, tmp_path, fast=fast)
    assert rp.nhit == rp.kp.nhit == 31 and rp.nmissed == rp.nabandoned == 0
    assert [probe for probe, _ in events] == [rp] * 31
    evs = [ev for _, ev in events]
    # rec(0) returns first, rec(30) last: n(n+1)/2, in the order they returned.
    assert [ev.args[0].value for ev in evs] == [k * (k + 1) // 2 for k in range(31)]
    assert [ev.args[0].name for ev in evs] == ["ret"] * 31
    assert [ev.args[1].value for ev in evs] == list(range(31))  # $arg1, kept at the entry
    for ev in evs:
        assert ev.is_return and ev.func == "rec" and ev.func_ip == rp.addr
        assert ev.regs is not None and ev.regs.rax == ev.args[0].value and ev.regs.rip == ev.ip
        assert 0 < ev.entry_timestamp <= ev.timestamp
    assert {ev.location.split("+")[0] for ev in evs} == {"rec", "main"}  # the callers


def test_both_tiers_give_a_return_probe_the_same_events(spawn, rets, tmp_path):
    def fields(events: list) -> list[tuple[Any, ...]]:
        first = events[0][1].regs.rsp  # the stack's place differs from run to run
        return [
            (ev.location, ev.func, ev.args, ev.is_return, ev.regs.rbx, ev.regs.rsp - first)
            for _, ev in events
        ]

    _, fast = returns_of(spawn, rets, tmp_path, fast=True)
    _, traps = returns_of(spawn, rets, tmp_path, fast=False)
    assert fields(fast) == fields(traps)


def test_every_argument_register_is_kept_by_the_entry_for_the_return(spawn, rets, tmp_path):
    """``$arg1``..``$arg6`` of one return: six words of the shadow entry, each event's
    values the call's own (mix(i, -i, 2i, i^5, 7, 1000 - i)), on the fast tier."""
    argv = [rets, "mix", 25]
    proc, out = start(spawn, tmp_path, argv)
    events: list[Any] = []
    rp = Kretprobe(
        symbol="mix",
        optimize=True,
        async_handler=lambda _rp, ev: events.append(ev),
        args=f"ret=$retval:s64 {SIX_ARGS}",
    )
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output(argv)
    assert rp.kp.nhit == rp.nhit == len(events) == 25  # every entry by the detour: no trap
    for i, ev in enumerate(events):
        a, b, c, d, e, f = i, -i, 2 * i, i ^ 5, 7, 1000 - i
        values = {arg.name: arg.value for arg in ev.args}
        assert values == {
            "ret": a + 2 * b + 3 * c + 5 * d + 7 * e + 11 * f,
            "a": a, "b": b, "c": c, "d": d, "e": e, "f": f, "g": b & 0xFFFF,
        }  # fmt: skip


def test_a_return_reading_an_argument_on_the_stack_keeps_its_trap(rets):
    spec = "r mix a=$arg1 h=$arg7"  # the seventh argument is on the stack: read at the entry
    r = support.cli("trace", "-c", f"{rets} mix 3", spec)
    assert r.returncode == 0, r.stderr
    assert "r_mix_0 uses a breakpoint: a fetch-arg reads $argN's memory or stack" in r.stderr
    assert r.stdout.count("<- mix) a=0x") == 3


def test_an_async_handler_does_not_go_with_synchronous_handlers(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "leaf", 3])
    both = Kretprobe(
        symbol="leaf", optimize=True, async_handler=print, entry_handler=lambda ri, regs: None
    )
    with pytest.raises(UnsupportedOption, match="entry_handler"):
        proc.register_kretprobe(both)
    with pytest.raises(UnsupportedOption, match="async_handler"):
        proc.register_kretprobe(Kretprobe(symbol="leaf", handler=print), ["x=$retval"])
    assert not proc.list()
    run_to_exit(proc)


def test_tool_killed_with_recording_returns_pending_leaves_a_working_program(popen, rets):
    """51 frames hooked to a trampoline that writes a record of each return, with a fetch
    that faults (``+0($retval)`` of small numbers), then SIGKILL of the tool: the returns
    still reach their callers, the faults are the rescue's, and the program's output is
    its own."""
    depth = 50
    spec = "rec_block@ret=$retval bad=+0($retval):u64 s=+0(%ax):string"
    prog, driver = probed_by_a_driver(popen, [rets, "waitblock", depth], spec)
    assert prog.stdin is not None and prog.stdout is not None
    prog.stdin.write(b"go\n")
    prog.stdin.flush()
    assert support.read_line(prog.stdout.fileno(), timeout=20) == b"bottom\n"
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=10)
    out, err = prog.communicate(b"go\n", timeout=30)
    assert prog.returncode == 0, err.decode()[-2000:]
    want = depth * (depth + 1) // 2
    assert out == f"block={want + 1}\nrec={want}\n".encode()
