"""A jump is written and taken out in three steps, so that no thread runs a mixture (issue 17).

Five bytes over a probed instruction cannot change at once for the program: a tool killed
between two writes, or an exception between them, used to leave the original first byte (or
an int3) before the jump's four others, ``41 0b 47 1a 00`` at ``malloc``, and the threads that
went through it died of SIGSEGV at ``malloc+2``. Now every jump site goes int3, the four
bytes, the first byte (the kernel's ``text_poke_bp``; process/engine/breakpoints.py), and what is
left at any instant is a whole instruction or an int3 followed by the old or the new four
bytes, which the rescue in the program finishes alone (rescue.c).

The program is tests/programs/hammer.c: 8 threads through mix(), every result checked.

1. The tool lives, and an exception (SIGINT's KeyboardInterrupt) comes right after one of the
   writes of a stop that puts jumps in or takes them out: every site is whole afterwards,
   whatever is done next (disable, enable, switching), and the program ends right.
2. The tool is SIGKILLed right after each step, putting jumps in and taking them out: every
   site is whole or an int3 the rescue finishes, and once the threads ran through, whole.
3. Many rounds of the above, a tool attaching again each time to the same program.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import support
from test_fidelity import Site
from test_optimized_fidelity import (
    THREADS,
    finish_hammer,
    hammer_output,
    mix_sites,
    split_in_passes,
    start_hammer,
)

import kprobes
from kprobes.process.engine.tracee import Tracee

pytestmark = pytest.mark.ptrace


@pytest.fixture(scope="module")
def hammer(build: Any) -> Path:
    path: Path = build("hammer")
    return path


def probed_sites(exe: Path) -> tuple[list[Site], Site]:
    """The optimizable sites of mix() that one run can probe together (none inside another
    one's region), and a site inside the first one's region."""
    sites, ends, _ = mix_sites(exe)
    first = split_in_passes(sites, ends)[0]
    probed = [sites[i] for i in first if sites[i].function == "mix" and ends[i] is not None]
    inside = next(s for s in sites if probed[0].vaddr < s.vaddr < (ends[first[0]] or 0))
    return probed, inside


def site_states(pid: int, exe: Path, sites: Sequence[Site]) -> list[str]:
    """What each site of mix() holds: ``original``, ``int3`` (before the original bytes),
    ``jump`` (into an anonymous executable page: a detour), ``int3+jump`` (an int3 before a
    jump's four other bytes: a jump being written or taken out, which the rescue finishes)
    or ``inside a jump``. Every other byte of mix() must be the file's: anything else, an
    original first byte before a jump's bytes above all, is a mixture."""
    sym = support.symbol(exe, "mix")
    bias = support.runtime_address(pid, exe, "mix") - sym.value
    live = support.raw_read(pid, bias + sym.value, sym.size)
    code = support.file_bytes(exe, sym.value, sym.size)
    detours = support.anonymous_exec_mappings(pid)
    states, expected, covered = [], bytearray(code), 0
    for s in sorted(sites, key=lambda s: s.offset):
        at = s.offset
        if at < covered:
            states.append("inside a jump")
            continue
        tail = live[at + 1 : at + 5]
        to = bias + s.vaddr + 5 + int.from_bytes(tail, "little", signed=True)
        is_jump_tail = tail != code[at + 1 : at + 5] and any(m.start <= to < m.end for m in detours)
        if live[at] == 0xCC:
            states.append("int3+jump" if is_jump_tail else "int3")
        elif live[at] == 0xE9 and code[at] != 0xE9 and is_jump_tail:
            states.append("jump")
        else:
            states.append("original")
            continue
        expected[at] = live[at]
        if is_jump_tail:
            expected[at + 1 : at + 5] = tail
            covered = at + 5
    assert live == bytes(expected), f"a mixture in mix(): {live.hex()} (file: {code.hex()})"
    return states


# -- 1. an exception between two writes, the tool alive ---------------------------------------


class ExceptionAfterWrite:
    """KeyboardInterrupt raised right after the ``number``-th write into the 5 bytes of any
    of ``sites`` (runtime addresses) made while ``is_counting``, as SIGINT may raise it
    there (``kprobes.cli.sigint`` raises one after half a second of waiting)."""

    def __init__(self, number: int, sites: Sequence[int]) -> None:
        self.number, self.sites, self.seen, self.is_counting = number, sites, 0, False

    @contextmanager
    def installed(self) -> Iterator[None]:
        write = Tracee.write

        def writing(tracee: Tracee, addr: int, data: bytes) -> None:
            write(tracee, addr, data)
            if self.is_counting and any(a <= addr < a + 5 for a in self.sites):
                self.seen += 1
                if self.seen == self.number:
                    self.is_counting = False
                    raise KeyboardInterrupt

        Tracee.write = writing  # type: ignore[method-assign]
        try:
            yield
        finally:
            Tracee.write = write  # type: ignore[method-assign]


@pytest.mark.parametrize("write", [1, 2, 3, 4])
@pytest.mark.parametrize("switch", ["on", "off"])
def test_an_exception_between_two_writes_leaves_every_site_whole(
    spawn: Any, hammer: Path, tmp_path: Path, switch: str, write: int
) -> None:
    """KeyboardInterrupt right after the ``write``-th write of the stops that switch the
    optimization on (jumps written) or off (jumps taken out), the tool alive: each site is
    left whole, then disabling (the original bytes back), enabling and switching again keep
    it so, and the program ends with every call right."""
    probed, _ = probed_sites(hammer)
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as fout, open(err, "wb") as ferr:
        proc = spawn([hammer, THREADS, -1], stdout=fout.fileno(), stderr=ferr.fileno())
    kps = [kprobes.Kprobe(symbol="mix", offset=s.offset, optimize=True) for s in probed]
    proc.register_kprobes(kps)
    wait_optimized(proc)
    exc = ExceptionAfterWrite(write, [kp.addr or 0 for kp in kps])
    is_raised = False
    with exc.installed():
        for _ in range(200):  # a site waits while a thread is inside its region
            assert not proc.run(timeout=0.005), "the program ended early"
            want = not proc.optimization
            exc.is_counting = want is (switch == "on")
            try:
                proc.optimization = want
            except KeyboardInterrupt:
                is_raised = True
                break
            finally:
                exc.is_counting = False
    assert is_raised, f"only {exc.seen} writes in 200 switches"
    site_states(proc.pid, hammer, probed)
    assert not proc.run(timeout=0.1), "the program ended early"
    site_states(proc.pid, hammer, probed)
    for kp in kps:
        proc.disable_kprobe(kp)
    assert site_states(proc.pid, hammer, probed) == ["original"] * len(probed)
    assert not proc.run(timeout=0.1), "the program ended early"
    for kp in kps:
        proc.enable_kprobe(kp)
    proc.optimization = True
    wait_optimized(proc)
    assert site_states(proc.pid, hammer, probed) == ["jump"] * len(probed)
    proc.optimization = False
    assert site_states(proc.pid, hammer, probed) == ["int3"] * len(probed)
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.run(timeout=30)
    assert proc.exit_code == 0, err.read_text()[-2000:]
    assert out.read_bytes() == hammer_output(THREADS)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_detach_waits_for_its_end(
    attach: Any, popen: Any, hammer: Path, signum: signal.Signals
) -> None:
    """A real signal right after each write of a detach into a jump site (SIGINT's
    KeyboardInterrupt, SIGTERM's SystemExit): the detach goes on to its end and the
    exception comes after it. Raised in the middle, it left the site as an int3 before the
    jump's four bytes: ``kprobes hist`` ended by SIGINT while its atexit detach ran left
    malloc so, the next tool refused it and the program later died of heap corruption."""
    probed, _ = probed_sites(hammer)
    prog = start_hammer(popen, hammer)
    proc = attach(prog.pid)
    kps = [kprobes.Kprobe(symbol="mix", offset=s.offset, optimize=True) for s in probed]
    proc.register_kprobes(kps)
    wait_optimized(proc)
    sites = [kp.addr or 0 for kp in kps]
    write = Tracee.write
    writes = 0

    def writing(tracee: Tracee, addr: int, data: bytes) -> None:
        nonlocal writes
        write(tracee, addr, data)
        if any(a <= addr < a + 5 for a in sites):
            writes += 1
            os.kill(os.getpid(), signum)

    expected = KeyboardInterrupt if signum == signal.SIGINT else SystemExit
    # Python's own SIGINT handler, whatever the suite inherited (a background job's SIG_IGN).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    Tracee.write = writing  # type: ignore[method-assign]
    try:
        with pytest.raises(expected):
            proc.detach()
    finally:
        Tracee.write = write  # type: ignore[method-assign]
        signal.signal(signal.SIGINT, previous)
    assert writes >= 3 * len(sites)  # every step of every site, each followed by a signal
    assert site_states(prog.pid, hammer, probed) == ["original"] * len(probed)
    assert "TracerPid:\t0" in Path(f"/proc/{prog.pid}/status").read_text()
    finish_hammer(prog)


def wait_optimized(proc: Any) -> None:
    """Run until every probe is a jump (a site waits while a thread is in its region)."""
    for _ in range(2000):
        if all(e.is_optimized for e in proc.list()):
            return
        proc.run(timeout=0.01)  # it retries when it returns
    raise AssertionError(proc.list())


# -- 2. the tool killed after each step -----------------------------------------------------

STEPS = [("switch", "patch-tail"), ("switch", "unpatch-int3"), ("switch", "unpatch-tail")]
STEPS += [("toggle", "unpatch-int3"), ("toggle", "unpatch-tail")]
DRIVER = Path(__file__).resolve().parent / "drivers" / "optimize_until_killed.py"


def kill_stalled(
    popen: Any, prog: Any, hammer: Path, sites: Sequence[Site], *args: Any
) -> list[str]:
    """Start the driver on ``prog`` with ``args``; once it says ``stalled`` (holding the
    world, right after the step it was told), read every site, SIGKILL it and return what
    the sites held (each whole or an int3 before 4 bytes: ``site_states``)."""
    env = dict(os.environ, PYTHONPATH=str(DRIVER.parent.parent.parent))
    argv = [sys.executable, DRIVER, prog.pid, *args, *(hex(s.offset) for s in sites[:-1])]
    driver = popen(argv, stdout=subprocess.PIPE, env=env)
    assert support.read_line(driver.stdout.fileno(), 120) == b"ready\n"
    assert support.read_line(driver.stdout.fileno(), 120) == b"stalled\n"
    held = site_states(prog.pid, hammer, sites)
    driver.kill()
    assert driver.wait(10) == -signal.SIGKILL
    support.wait_until(
        lambda: not any(support.tracer_of(prog.pid, t) for t in support.thread_ids(prog.pid)),
        10,
        "the program's threads to be released",
    )
    return held


def finished_by_the_threads(prog: Any, hammer: Path, sites: Sequence[Site]) -> None:
    """The threads run through every site (mix() is hammered): the rescue finishes an int3
    left before 4 bytes of a jump into the jump, and no such int3 stays."""
    support.wait_until(
        lambda: "int3+jump" not in site_states(prog.pid, hammer, sites),
        30,
        "the threads to run through the int3 left between two writes",
    )
    assert prog.poll() is None, f"the program died: {prog.returncode}"


@pytest.mark.parametrize(("mode", "stall"), STEPS, ids=[f"{m}-{s}" for m, s in STEPS])
def test_the_tool_killed_between_two_writes(popen, hammer, mode, stall):
    """SIGKILL right after a step of the writes that put a jump in (the optimization switched
    on) or take it out (switched off, a probe disabled): the site is an int3 before the
    jump's four bytes or before the original four, never a mixture; the rescue finishes it
    when a thread traps there, into the jump or the original instruction, and the program
    ends by itself with every call right."""
    probed, inside = probed_sites(hammer)
    sites = [*probed, inside]
    prog = start_hammer(popen, hammer)
    args = [mode, "--inside", hex(inside.offset), "--stall", stall, "--after", 3]
    held = kill_stalled(popen, prog, hammer, sites, *args)
    assert ("int3" if stall == "unpatch-tail" else "int3+jump") in held, held
    finished_by_the_threads(prog, hammer, sites)
    finish_hammer(prog)


def test_a_later_tool_takes_back_every_jump_left_in_the_function(popen, hammer):
    """A tool SIGKILLed with its jumps in mix(); the next one probes only the last site: the
    decode from mix()'s start to it must not read the other sites' jumps as code (it used to
    fail: NotABoundary), so every jump left in the function is taken back first."""
    probed, inside = probed_sites(hammer)
    prog = start_hammer(popen, hammer)
    held = kill_stalled(popen, prog, hammer, [*probed, inside], "switch", "--stall", "unpatch")
    assert "jump" in held, held
    last = probed[-1]
    with kprobes.attach(prog.pid) as proc:
        proc.register_kprobe(kprobes.Kprobe(symbol="mix", offset=last.offset))
        states = site_states(prog.pid, hammer, probed)
        assert states == ["original"] * (len(probed) - 1) + ["int3"], states
        proc.run(timeout=0.1)
    assert site_states(prog.pid, hammer, probed) == ["original"] * len(probed)
    finish_hammer(prog)


# -- 3. many rounds -------------------------------------------------------------------------

ROUNDS = 6


@pytest.mark.deadline(600)
def test_tools_killed_between_writes_round_after_round(popen, hammer):
    """One program, 6 tools one after the other, each SIGKILLed right after a random step of
    a random write, the next one attaching to what the last one left (its jumps taken back,
    leftover.py): every site whole or an int3 the rescue finishes each time, and the program
    ends right."""
    probed, inside = probed_sites(hammer)
    sites = [*probed, inside]
    prog = start_hammer(popen, hammer)
    rng = random.Random(int(os.environ.get("KPROBES_TEST_SEED", "17")))
    seen = set()
    for _ in range(ROUNDS):
        mode = rng.choice(["switch", "toggle"])
        stall = rng.choice(["patch-tail", "unpatch-int3", "unpatch-tail", "patch", "unpatch"])
        args = [mode, "--inside", hex(inside.offset), "--stall", stall]
        seen.update(kill_stalled(popen, prog, hammer, sites, *args, "--after", rng.randint(1, 6)))
        finished_by_the_threads(prog, hammer, sites)
    assert "int3+jump" in seen, seen
    finish_hammer(prog)


# -- the steps alone, on memory of our own --------------------------------------------------

ORIGINAL = bytes.fromhex("4154555348")  # malloc's first bytes: push %r12; push %rbp; ...
JUMP = bytes.fromhex("e90b471a00")


class Memory:
    """An address space that remembers every state the 5 bytes at ``AT`` went through."""

    AT = 0x1000

    def __init__(self, code: bytes) -> None:
        self.code = bytearray(code)
        self.states = [bytes(code)]

    def read(self, addr: int, size: int) -> bytes:
        return bytes(self.code[addr - self.AT : addr - self.AT + size])

    read_some = read

    def write(self, addr: int, data: bytes) -> None:
        self.code[addr - self.AT : addr - self.AT + len(data)] = data
        self.states.append(bytes(self.code))


WHOLE = {ORIGINAL, JUMP, b"\xcc" + ORIGINAL[1:], b"\xcc" + JUMP[1:]}


def test_every_state_between_the_writes_is_one_the_rescue_finishes():
    """Armed, optimized, unoptimized (re-armed and not), disarmed, restored: each state the
    site goes through is a whole instruction or an int3 before the old or new 4 bytes (never
    ``41 0b 47 1a 00``), and one byte changes at a time unless only the 4 others change."""
    from kprobes.process.engine.breakpoints import Breakpoints

    mem = Memory(ORIGINAL)
    bps = Breakpoints()
    spaces: list[Any] = [mem]
    bps.arm(spaces, Memory.AT, ORIGINAL[0])
    bps.patch_jump(spaces, Memory.AT, JUMP, ORIGINAL)
    assert mem.states[-1] == JUMP
    bps.unpatch_jump(spaces, Memory.AT, rearm=True)
    assert mem.states[-1] == b"\xcc" + ORIGINAL[1:]
    bps.patch_jump(spaces, Memory.AT, JUMP, ORIGINAL)
    bps.unpatch_jump(spaces, Memory.AT, rearm=False)
    assert mem.states[-1] == ORIGINAL
    bps.arm(spaces, Memory.AT, ORIGINAL[0])
    bps.patch_jump(spaces, Memory.AT, JUMP, ORIGINAL)
    bps.restore_all(mem)  # type: ignore[arg-type]
    assert mem.states[-1] == ORIGINAL
    assert set(mem.states) <= WHOLE, [s.hex() for s in mem.states if s not in WHOLE]
    for before, after in itertools.pairwise(mem.states):
        changed = [i for i in range(5) if before[i] != after[i]]
        assert changed == [0] or 0 not in changed, (before.hex(), after.hex())


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("way", ["patch", "unpatch"])
def test_an_exception_after_a_step_puts_the_site_back(way, step):
    """KeyboardInterrupt after a step: the site goes back to what the bookkeeping says, by
    the same steps, and a disarm then restores the original bytes."""
    from kprobes.process.engine.breakpoints import Breakpoints

    mem = Memory(ORIGINAL)
    bps = Breakpoints()
    spaces: list[Any] = [mem]
    bps.arm(spaces, Memory.AT, ORIGINAL[0])
    if way == "unpatch":
        bps.patch_jump(spaces, Memory.AT, JUMP, ORIGINAL)
    before = mem.states[-1]
    poke, count = Breakpoints._poke, 0

    def poking(self: Breakpoints, *args: Any) -> None:
        nonlocal count
        poke(self, *args)
        count += 1
        if count == step:
            raise KeyboardInterrupt

    Breakpoints._poke = poking  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            if way == "patch":
                bps.patch_jump(spaces, Memory.AT, JUMP, ORIGINAL)
            else:
                bps.unpatch_jump(spaces, Memory.AT, rearm=False)
    finally:
        Breakpoints._poke = poke  # type: ignore[method-assign]
    assert mem.states[-1] == before
    assert set(mem.states) <= WHOLE
    if way == "patch":
        bps.disarm(spaces, Memory.AT)
    else:
        bps.unpatch_jump(spaces, Memory.AT, rearm=False)
    assert mem.states[-1] == ORIGINAL
