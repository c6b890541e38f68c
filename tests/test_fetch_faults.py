"""A fetch of ours that hits a bad pointer gives ``(fault)``, never a fault of the program; the
program's own faults reach it exactly as they would without us. Tool alive or SIGKILLed.

tests/programs/fetchfault.c holds loads marked as detour code marks its fetches (r11 =
FETCH_FAULT_MAGIC, r10 = where to go on), in its own text; the test declares that range as
code of ours (``ProgramCalls.note_own_code``, which ``map_xol_page`` calls for every page it
maps), as the optimizer's pages will be. ``activate_fetch_faults`` is what the optimizer calls
before the first detour that fetches through a pointer: the rescue becomes the program's
SIGSEGV and SIGBUS handler, for when the tool is dead.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes

pytestmark = pytest.mark.ptrace

DRIVER = Path(__file__).resolve().parent / "drivers" / "fetch_until_killed.py"
REPO = DRIVER.parents[2]
SEGV, BUS = signal.SIGSEGV, signal.SIGBUS

Popen = subprocess.Popen[bytes]


class Program:
    """fetchfault, started and waiting for its "go" line."""

    def __init__(self, popen: Callable[..., Popen], exe: Path, own: str, steps: list[str]):
        self.argv = [exe, own, *steps]
        self.p = popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        code = self.line().split()
        assert code[0] == b"code", code
        self.start, self.end = int(code[1], 16), int(code[2], 16)
        self.actions = self.line()
        assert self.line() == b"ready\n"

    @property
    def pid(self) -> int:
        return self.p.pid

    def line(self) -> bytes:
        assert self.p.stdout is not None
        return support.read_line(self.p.stdout.fileno(), timeout=30)

    def send(self, line: bytes = b"go\n") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line)
        self.p.stdin.flush()

    def rest(self) -> bytes:
        """Everything it prints until it ends."""
        assert self.p.stdout is not None
        out = b""
        while chunk := os.read(self.p.stdout.fileno(), 65536):
            out += chunk
        return out

    def reference(self) -> tuple[bytes, int]:
        """What it prints after "ready", and how it ends, run alone: never traced."""
        done = subprocess.run(self.argv, input=b"go\n", capture_output=True, timeout=60)
        return done.stdout.split(b"ready\n", 1)[1], done.returncode


@pytest.fixture
def fetchfault(popen: Callable[..., Popen], build: Callable[[str], Path]):
    return lambda own, *steps: Program(popen, build("fetchfault"), own, list(steps))


def caught(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    return 0


def task_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2]


def bits(*sigs: int) -> int:
    return sum(1 << (sig - 1) for sig in sigs)


def run_with_tool(
    attach: Callable[..., Any], prog: Program, *, activate: bool
) -> tuple[bytes, Any]:
    """The tool alive from "go" to the program's end: its output and exit code (the tool,
    its tracer and its parent, reaps it: -N for a signal)."""
    proc = attach(prog.pid)
    proc._calls.note_own_code(prog.start, prog.end)
    if activate:
        assert proc._calls.activate_fetch_faults(), proc._tracer.rescue.unavailable
        assert caught(prog.pid) & bits(SEGV, BUS) == bits(SEGV, BUS)
    prog.send()
    assert proc.run(timeout=60), "the program did not end"
    return prog.rest(), proc.exit_code


def kill_tool_after_activation(popen: Callable[..., Popen], prog: Program, *flags: str) -> None:
    """A separate kprobes that declares the code, activates the rescue's fetch faults, and is
    SIGKILLed: the program is on its own from here."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = popen(
        [sys.executable, DRIVER, prog.pid, hex(prog.start), hex(prog.end), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert driver.stdout is not None
    line = support.read_line(driver.stdout.fileno(), timeout=30)
    assert line == b"ready\n", (line, driver.communicate(timeout=10))
    driver.kill()
    driver.wait(timeout=10)
    deadline = time.monotonic() + 10
    while tracer_of(prog.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tracer_of(prog.pid) == 0


def tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def end_alone(prog: Program) -> tuple[bytes, int]:
    prog.send()
    out = prog.rest()
    return out, prog.p.wait(timeout=30)


# -- (a) and (b): fetches of ours --------------------------------------------------------------


@pytest.mark.parametrize("activate", [False, True], ids=["tracer-only", "rescue-active"])
def test_bad_pointers_give_fault_while_the_tool_lives(attach, fetchfault, activate):
    """4 threads, 50 rounds of 4 bad pointers each (NULL, non-canonical, PROT_NONE, past a
    file's end: SEGV_MAPERR, SI_KERNEL, SEGV_ACCERR, SIGBUS): 800 faults, every one fixed by
    the tracer (the rescue, active or not, never sees ours), the program's action SIG_DFL."""
    prog = fetchfault("none", "fetch:4:50")
    out, code = run_with_tool(attach, prog, activate=activate)
    assert (out, code) == (b"fetch: 4 threads x 50 rounds, 0 wrong\n", 0)


def test_bad_pointers_give_fault_after_the_tool_died(popen, fetchfault):
    prog = fetchfault("none", "fetch:4:50")
    kill_tool_after_activation(popen, prog)
    assert end_alone(prog) == (b"fetch: 4 threads x 50 rounds, 0 wrong\n", 0)


def test_without_the_rescues_handlers_the_dead_tool_s_fetch_faults_kill(popen, fetchfault):
    """The counterpart of the test above: what the lazy activation is for."""
    prog = fetchfault("none", "fetch:1:1")
    kill_tool_after_activation(popen, prog, "--no-activate")
    assert end_alone(prog) == (b"", -SEGV)


def test_a_fetch_fault_held_at_detach_is_fixed_not_delivered(attach, fetchfault):
    """The thread faulted on our fetch and waits in its signal-delivery stop, unseen, when
    the tool detaches: the fault is fixed there, not delivered to the program (SIG_DFL)."""
    prog = fetchfault("none", "fetch1")
    proc = attach(prog.pid)
    proc._calls.note_own_code(prog.start, prog.end)
    prog.send()
    deadline = time.monotonic() + 30
    while task_state(prog.pid) != "t":  # stopped on the fault
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.detach()
    assert (prog.rest(), prog.p.wait(timeout=30)) == (b"fetch1: faulted 1\n", 0)


def test_a_thread_that_blocks_sigsegv_keeps_it_blocked_and_the_handler(attach, fetchfault):
    """A fault cannot be blocked: the kernel delivers it with the action made SIG_DFL and the
    signal unblocked. After each of ours, the tracer puts both back; the program's own
    segfault afterwards still reaches its handler."""
    prog = fetchfault("siginfo", "blocked:20", "segv")
    out, code = run_with_tool(attach, prog, activate=True)
    assert out == (
        b"blocked: 0 wrong, still blocked 1, handled 1\n"
        b"segv: sig 11 code 1 addr-ok 1 rip-ok 1 unwound 1\n"
    )
    assert code == 0


# -- (c): the program's own faults -------------------------------------------------------------

OWN_FAULTS = [
    # its SA_SIGINFO handler on an alternate stack: a segfault outside our code, one in our
    # code without the magic, one with the magic outside our code, a SIGBUS, a stack overflow
    # (the frame must go on the alternate stack), a SIGSEGV sent by kill(), one sent by a
    # timer while the thread is in our code, marked as a fetch is
    ("siginfo", ["segv", "segv-ours", "segv-magic", "bus", "overflow", "sent", "sent-marked"]),
    ("plain", ["segv", "segv-ours", "bus", "sent"]),
    # SIG_DFL: it dies of each, with the signal
    ("none", ["segv-ours"]),
    ("none", ["segv-magic"]),
    ("none", ["bus"]),
    ("none", ["sent"]),
    ("none", ["sent-marked"]),
]


@pytest.mark.parametrize("tool", ["alive", "alive-rescue-active", "dead"])
@pytest.mark.parametrize(
    ("own", "steps"), OWN_FAULTS, ids=[f"{own}-{'-'.join(steps)}" for own, steps in OWN_FAULTS]
)
def test_the_programs_own_faults_are_its_own(attach, popen, fetchfault, tool, own, steps):
    """Output and end as in a run without kprobes: the handler sees the fault's signal,
    si_code, si_addr and rip, and unwinds through the signal frame into the faulting code,
    or the program dies of the signal."""
    prog = fetchfault(own, *steps)
    expected = prog.reference()
    if tool == "dead":
        kill_tool_after_activation(popen, prog)
        got = end_alone(prog)
    else:
        got = run_with_tool(attach, prog, activate=tool == "alive-rescue-active")
    assert got == expected
    assert b"not" not in expected[0] and (expected[1] == 0) == (own != "none")


# -- (d): detach --------------------------------------------------------------------------------


@pytest.mark.parametrize("own", ["none", "mixed"])
def test_the_handlers_are_installed_when_asked_and_removed_at_detach(attach, fetchfault, own):
    """The rescue takes SIGTRAP with the first probe, SIGSEGV and SIGBUS only when asked; a
    clean detach gives the program its own actions back, read back by the program itself
    (handler, flags, restorer and mask of the kernel's struct sigaction). ``mixed``: SIGSEGV
    with SA_SIGINFO|SA_ONSTACK|SA_NODEFER|SA_RESTART and a mask, SIGBUS ignored."""
    prog = fetchfault(own, "actions")
    before = caught(prog.pid)
    proc = attach(prog.pid)
    proc.register_kprobe(kprobes.Kprobe(symbol="print_actions", pre_handler=lambda p, r: None))
    assert caught(prog.pid) == before | bits(signal.SIGTRAP)
    proc._calls.note_own_code(prog.start, prog.end)
    assert proc._calls.activate_fetch_faults()
    assert caught(prog.pid) == before | bits(signal.SIGTRAP, SEGV, BUS)
    proc.detach()
    assert caught(prog.pid) == before
    assert end_alone(prog) == (prog.actions, 0)


def test_a_thread_left_in_our_code_keeps_the_rescue_after_detach(attach, fetchfault):
    """Detached while a thread spins in our code before a fetch from NULL: the rescue stays
    the SIGSEGV handler (and hands the program's own faults on), so the fetch gives FAULTED
    instead of killing the program."""
    prog = fetchfault("none", "inside")
    proc = attach(prog.pid)
    proc._calls.note_own_code(prog.start, prog.end)
    assert proc._calls.activate_fetch_faults()
    prog.send()
    assert prog.p.stdout is not None
    deadline = time.monotonic() + 30
    while not select.select([prog.p.stdout], [], [], 0)[0]:  # it makes a thread: run
        assert time.monotonic() < deadline, "no thread waiting"
        proc.run(timeout=0.05)
    assert prog.line() == b"inside: waiting\n"
    proc.run(timeout=0.05)
    proc.detach()
    assert caught(prog.pid) & bits(SEGV, BUS) == bits(SEGV, BUS)
    prog.send()
    assert prog.rest() == b"inside: faulted 1\n"
    assert prog.p.wait(timeout=30) == 0
