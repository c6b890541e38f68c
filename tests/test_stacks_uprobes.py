"""User stacks on the kernel's uprobes backend (issue 23, item 4): ``trace --stack`` and
``stackcount`` with ``--backend uprobes``, where the kernel's ``userstacktrace`` option in our
instance records them (tracefs/userstacks.py).

The kernel follows frame pointers only, and at most 8 frames: the program is ``stacks-fp``,
stacks.c built with frame pointers (libstk.so still without). At a function's first
instruction its frame pointer is not pushed yet, so the kernel's walk goes from the probed
function straight to its caller's caller: ``a`` and ``b`` are missing between ``leaf`` and
``main`` (8 hits), and from ``stk_through``, which makes no frame, even ``main`` (2 hits):
the tests hold it to what it can do, and the output must say what it is (a header line).

The pairing of the kernel's stack records with their events is tested first, on events made
here (no tracefs).
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import support

from kprobes.model import Event, StackFrame, UserStack
from kprobes.tracefs import userstacks

Build = Callable[[str], Path]
MARKER = "<user stack trace>"


def _event(tid: int, cpu: int, name: str = "p_leaf") -> Event:
    return Event("kprobes", name, tid, tid, "stacks", cpu, 1.0, 0x1000, "leaf+0x0/0x18")


def _marker(tid: int, cpu: int, *addrs: int, stop: str = "") -> Event:
    stack = UserStack(tuple(StackFrame(a) for a in addrs), stop)
    return Event("ftrace", MARKER, 0, tid, "", cpu, 1.0, 0, "", stack=stack)


def _named(addrs: list[int], tid: int) -> UserStack:
    return UserStack(tuple(StackFrame(a, f"f{a:x}") for a in addrs))


def test_each_stack_goes_to_the_event_before_it_on_its_cpu() -> None:
    events = [
        _event(1, 0),
        _event(2, 1),
        _marker(1, 0, 0x10, 0x20),
        _marker(2, 1, 0x30),
        _event(1, 0, "r_leaf"),
    ]
    out = userstacks.attach(events, _named, 127)
    assert [e.event for e in out] == ["p_leaf", "p_leaf", "r_leaf"]
    assert out[0].stack == UserStack((StackFrame(0x10, "f10"), StackFrame(0x20, "f20")))
    assert out[1].stack == UserStack((StackFrame(0x30, "f30"),))
    assert out[2].stack is None  # its record has not come yet


def test_a_stack_of_no_event_of_ours_is_dropped() -> None:
    # Another thread's stack after ours (its event was another process's, not decoded), and
    # a second stack in a row (a watcher's record between them): neither is ours.
    events = [_event(1, 0), _marker(1, 0, 0x10), _marker(1, 0, 0x99), _marker(7, 1, 0x5)]
    out = userstacks.attach(events, _named, 127)
    assert out == [_event(1, 0)._replace(stack=_named([0x10], 1))]
    assert userstacks.attach([_event(1, 0), _marker(2, 0, 0x10)], _named, 127)[0].stack is None


def test_a_stack_is_cut_at_the_depth_and_the_kernel_s_limit_said() -> None:
    out = userstacks.attach([_event(1, 0), _marker(1, 0, 1, 2, 3)], _named, 2)
    assert out[0].stack == UserStack(_named([1, 2], 1).frames, "depth limit")
    full = _marker(1, 0, *range(1, 9), stop="depth limit")  # the kernel's 8 entries, all used
    assert userstacks.attach([_event(1, 0), full], _named, 127)[0].stack.stop == "depth limit"


def test_a_read_between_an_event_and_its_stack_keeps_them_together() -> None:
    """The kernel commits an event, then its stack: a read may fall between them. The
    event waits for the next read (once), where its marker is; a final read holds none."""
    pairing = userstacks.Pairing(_named, 127)
    first = [_event(1, 0)._replace(timestamp=1.0), _event(2, 1)._replace(timestamp=2.0)]
    first.append(_marker(2, 1, 0x30)._replace(timestamp=2.0))
    out = pairing(first)
    assert out == [] and pairing.is_holding  # cpu 0's last record is an event: held from it
    second = [_marker(1, 0, 0x10)._replace(timestamp=1.5), _event(1, 0)._replace(timestamp=3.0)]
    out = pairing(second)
    assert [(e.tid, e.stack) for e in out] == [(1, _named([0x10], 1)), (2, _named([0x30], 2))]
    assert pairing.is_holding  # the new last event of cpu 0
    out = pairing([])  # held once: goes, with or without its stack
    assert [(e.tid, e.timestamp, e.stack) for e in out] == [(1, 3.0, None)]
    assert not pairing.is_holding
    assert [e.tid for e in pairing([_event(4, 0)], final=True)] == [4]
    assert not pairing.is_holding


# -- live, on the kernel's uprobes -----------------------------------------------------------


def kprobes_on_live_program(program: Path, tmp_path: Path, *args: object) -> tuple[str, str]:
    """stdout and stderr of ``kprobes ARGS -p PID`` on ``PROGRAM gated``: the program makes
    its calls once the kernel's probes are armed, and lives on until the command has ended
    (SIGINT once the program has made its calls), so that every event is read while its
    process is there to name its frames in (its memory map)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out, err = tmp_path / "out", tmp_path / "err"
    prog = subprocess.Popen([program, "gated"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert prog.stdin is not None and prog.stdout is not None
    try:
        with open(out, "wb") as o, open(err, "wb") as e:
            tool = subprocess.Popen(
                [support.KPROBES, *map(str, args), "-p", str(prog.pid)], stdout=o, stderr=e
            )
        try:

            def armed() -> bool:
                assert tool.poll() is None, err.read_text()
                return support.armed(tool.pid)

            support.wait_until(armed, 60, "the uprobes armed")
            prog.stdin.write(b"go\n")
            prog.stdin.flush()
            assert prog.stdout.readline().startswith(b"stacks ")  # its calls are made
            tool.send_signal(signal.SIGINT)
            assert tool.wait(timeout=120) == 0, err.read_text()
        finally:
            if tool.poll() is None:
                tool.kill()
                tool.wait()
    finally:
        prog.stdin.close()
        prog.wait(timeout=60)
    return out.read_text(), err.read_text()


@pytest.mark.tracefs
@support.needs_uprobes
def test_trace_on_uprobes_prints_the_kernel_s_frame_pointer_stacks(
    build: Build, tmp_path: Path
) -> None:
    program = build("stacks-fp")
    out, err = kprobes_on_live_program(
        program, tmp_path, "trace", "--backend", "uprobes", "-U", "leaf"
    )
    assert "breakpoint" not in err  # the tier note is our own backend's
    lines = out.splitlines()
    assert lines[0].startswith("# user stacks: the kernel's userstacktrace, which follows")
    stacks = [i for i, line in enumerate(lines) if line.endswith(MARKER)]
    assert len(stacks) == 10
    leaf = f"leaf+0x0/{support.symbol(program, 'leaf').size:#x}"
    seconds = []
    for i in stacks:
        assert "p_leaf_0: (leaf+0x0/" in lines[i - 1]
        frames = []
        for line in lines[i + 1 :]:
            if not line.startswith(" => "):
                break
            frames.append(line[4:])
        assert frames[0] == leaf and 2 <= len(frames) <= 9, frames
        seconds.append(frames[1])
    # At leaf's first instruction its frame is not made: the kernel skips its caller.
    assert sum(f.startswith("main+") for f in seconds) == 8, seconds
    assert sum(f.endswith("[libc.so.6]") for f in seconds) == 2, seconds


@pytest.mark.tracefs
@support.needs_uprobes
def test_stackcount_and_json_on_uprobes(build: Build, tmp_path: Path) -> None:
    program = build("stacks-fp")
    out, err = kprobes_on_live_program(
        program, tmp_path / "count", "stackcount", "--backend", "uprobes", "--folded", "leaf"
    )
    assert "# user stacks: the kernel's userstacktrace" in err  # not in the folded lines
    rows = [line.rpartition(" ") for line in out.splitlines()]
    assert sum(int(n) for _, _, n in rows) == 10
    assert sum(int(n) for names, _, n in rows if names.endswith(";main;leaf")) == 8, out
    out, _ = kprobes_on_live_program(
        program, tmp_path / "json", "trace", "--backend", "uprobes", "-U", "--json", "leaf"
    )
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(records) == 10
    assert all(r["stack"][0]["func"] == "leaf" and r["stack"][0]["offset"] == 0 for r in records)
