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

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import support

from kprobes.cli import main as cli_main
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


# -- live, on the kernel's uprobes -----------------------------------------------------------


def kprobes(*args: object) -> tuple[str, str]:
    """stdout and stderr of ``kprobes ARGS`` run in this process (it must succeed)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main.main([str(a) for a in args])
    assert code == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


@pytest.mark.tracefs
@support.needs_uprobes
def test_trace_on_uprobes_prints_the_kernel_s_frame_pointer_stacks(build: Build) -> None:
    program = build("stacks-fp")
    out, err = kprobes("trace", "--backend", "uprobes", "-U", "-c", program, "leaf")
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
def test_stackcount_and_json_on_uprobes(build: Build) -> None:
    program = build("stacks-fp")
    out, err = kprobes("stackcount", "--backend", "uprobes", "--folded", "-c", program, "leaf")
    assert "# user stacks: the kernel's userstacktrace" in err  # not in the folded lines
    rows = [line.rpartition(" ") for line in out.splitlines()]
    assert sum(int(n) for _, _, n in rows) == 10
    assert sum(int(n) for names, _, n in rows if names.endswith(";main;leaf")) == 8, out
    out, _ = kprobes("trace", "--backend", "uprobes", "-U", "--json", "-c", program, "leaf")
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(records) == 10
    assert all(r["stack"][0]["func"] == "leaf" and r["stack"][0]["offset"] == 0 for r in records)
