"""CPU placement (process/engine/cpus.py): a thread that stops often runs on the tool's CPU,
one that stops rarely keeps every CPU it had, and every mask we changed comes back.

These check the behaviour (which masks are set, when, and that they are given back), not the
time a hit takes: that is ``python -m bench.placement``'s job. The policy's unit tests drive
``Placement`` on threads of this test process with a fake clock; the live ones run
tests/programs/placement.c and threads.c. A live test that wants a thread pinned raises the
pace threshold, so that a loaded machine (slower hits) cannot make it flaky.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes.process.engine import cpus as placement_module
from kprobes.process.engine.cpus import WINDOW, Placement

ALL = os.sched_getaffinity(0)
needs_two_cpus = pytest.mark.skipif(
    len(ALL) < 2, reason="needs two CPUs: on one, there is no placement to choose"
)
pytestmark = needs_two_cpus


@pytest.fixture(autouse=True)
def tool_affinity() -> Iterator[None]:
    """Every test starts and must end with the tool (this thread) free on all its CPUs."""
    os.sched_setaffinity(0, ALL)
    yield
    now = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL)
    assert now == ALL, "the tool's own mask was not given back"


class Idle:
    """A thread of this process that sleeps until the test ends: something to pin."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._ready = threading.Event()
        self.tid = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        self._ready.set()
        self._done.wait(30)

    @property
    def mask(self) -> set[int]:
        return os.sched_getaffinity(self.tid)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


@pytest.fixture
def idle() -> Iterator[Callable[[], Idle]]:
    made: list[Idle] = []

    def make() -> Idle:
        made.append(Idle())
        return made[-1]

    yield make
    for thread in made:
        thread.stop()


class Clock:
    """``time.monotonic_ns`` for cpus.py, moved by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now

    def windows(self, placement: Placement, tid: int, per_stop_ns: int, count: int = 1) -> None:
        """``count`` windows of WINDOW stops of ``tid``, one every ``per_stop_ns``."""
        for _ in range(count):
            self.now += per_stop_ns * WINDOW
            placement.check_pace(os.getpid(), tid)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(placement_module.time, "monotonic_ns", fake)
    return fake


# -- the policy, on threads of this process ----------------------------------------------------


def test_a_fast_thread_is_pinned_with_the_tool_and_let_go_when_it_slows(
    idle: Callable[[], Idle], clock: Clock
) -> None:
    thread, placement = idle(), Placement()
    clock.windows(placement, thread.tid, 0)  # the first look only starts a window
    assert thread.mask == ALL
    clock.windows(placement, thread.tid, placement_module.PIN_BELOW_NS // 2)
    cpu = placement.cpu
    assert cpu is not None and thread.mask == {cpu} == os.sched_getaffinity(0)
    # Between the two thresholds it stays; past the upper one it goes, and the tool with it.
    clock.windows(placement, thread.tid, placement_module.LET_GO_ABOVE_NS - 1, count=3)
    assert thread.mask == {cpu}
    clock.windows(placement, thread.tid, placement_module.LET_GO_ABOVE_NS + 1)
    assert thread.mask == ALL and os.sched_getaffinity(0) == ALL
    assert placement.cpu is None and placement.pins == 1


def test_the_last_pinned_thread_gone_lets_the_tool_go(
    idle: Callable[[], Idle], clock: Clock
) -> None:
    thread, placement = idle(), Placement()
    clock.windows(placement, thread.tid, 1_000, count=2)
    assert placement.cpu is not None and os.sched_getaffinity(0) == {placement.cpu}
    placement.forget(thread.tid)  # it exited
    assert placement.cpu is None and os.sched_getaffinity(0) == ALL


def test_a_slow_thread_is_never_pinned(idle: Callable[[], Idle], clock: Clock) -> None:
    thread, placement = idle(), Placement()
    clock.windows(placement, thread.tid, placement_module.PIN_BELOW_NS + 1, count=10)
    assert thread.mask == ALL and os.sched_getaffinity(0) == ALL and placement.pins == 0


def test_off_pins_nothing_and_close_gives_every_mask_back(
    idle: Callable[[], Idle], clock: Clock
) -> None:
    fast, other, placement = idle(), idle(), Placement()
    placement.is_on = False
    clock.windows(placement, fast.tid, 1_000, count=3)
    assert fast.mask == ALL and placement.pins == 0
    placement.is_on = True
    clock.windows(placement, fast.tid, 1_000)
    clock.windows(placement, other.tid, 1_000, count=2)
    assert fast.mask == other.mask == {placement.cpu}
    placement.close()
    assert fast.mask == other.mask == ALL and os.sched_getaffinity(0) == ALL


def test_a_mask_the_program_changed_is_not_overwritten(
    idle: Callable[[], Idle], clock: Clock
) -> None:
    thread, placement = idle(), Placement()
    clock.windows(placement, thread.tid, 1_000, count=2)
    cpu = placement.cpu
    assert cpu is not None
    elsewhere = {min(ALL - {cpu})}
    os.sched_setaffinity(thread.tid, elsewhere)  # the program pins itself meanwhile
    placement.close()
    assert thread.mask == elsewhere


def test_a_thread_that_may_not_run_on_the_tools_cpu_is_left_alone(
    idle: Callable[[], Idle], clock: Clock
) -> None:
    first, second, placement = idle(), idle(), Placement()
    clock.windows(placement, first.tid, 1_000, count=2)
    cpu = placement.cpu
    assert cpu is not None
    elsewhere = {min(ALL - {cpu})}
    os.sched_setaffinity(second.tid, elsewhere)
    clock.windows(placement, second.tid, 1_000, count=2)
    assert second.mask == elsewhere and first.mask == {cpu}
    placement.close()


def test_what_a_pinned_thread_creates_gets_its_own_mask(
    idle: Callable[[], Idle], clock: Clock
) -> None:
    parent, child, placement = idle(), idle(), Placement()
    clock.windows(placement, parent.tid, 1_000, count=2)
    cpu = placement.cpu
    os.sched_setaffinity(child.tid, {cpu})  # as a clone of the pinned thread inherits it
    placement.on_new_task(parent.tid, child.tid, is_thread=True)
    assert child.mask == ALL
    placement.close()


def test_colocate_keeps_every_thread_and_new_ones_until_close(idle: Callable[[], Idle]) -> None:
    one, two, later, placement = idle(), idle(), idle(), Placement()
    cpu = placement.colocate([one.tid, two.tid], None)
    assert one.mask == two.mask == os.sched_getaffinity(0) == {cpu}
    os.sched_setaffinity(later.tid, {cpu})  # a clone inherits the pin ...
    placement.on_new_task(one.tid, later.tid, is_thread=True)
    assert later.mask == {cpu}  # ... and keeps it while colocated
    placement.close()
    assert one.mask == two.mask == later.mask == ALL


# -- live ----------------------------------------------------------------------------------------


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any thread that keeps stopping counts as hot, however loaded the machine is."""
    monkeypatch.setattr(placement_module, "PIN_BELOW_NS", 50_000_000)
    monkeypatch.setattr(placement_module, "LET_GO_ABOVE_NS", 100_000_000)


def run_placement(
    spawn: Callable[..., Any], program: Path, tmp_path: Path, **kwargs: Any
) -> tuple[list[str], list[set[int]], list[set[int]]]:
    """Run ``placement 3000`` with a probe on hot(); its output lines, and the program's and
    the tool's masks seen by the handler at each hit."""
    seen: list[set[int]] = []
    tools: list[set[int]] = []

    def pre(kp: Any, regs: Any) -> None:
        seen.append(os.sched_getaffinity(regs.tid))
        tools.append(os.sched_getaffinity(0))

    out = tmp_path / "out"
    with open(out, "wb") as stdout:
        proc = spawn([program, 3000], stdout=stdout, **kwargs)
    proc.register_kprobe(kprobes.Kprobe(symbol="hot", pre_handler=pre))
    assert proc.run(timeout=60)
    assert proc.exit_code == 0 and len(seen) == 3000
    return out.read_text().splitlines(), seen, tools


@pytest.mark.ptrace
@pytest.mark.parametrize("follow_forks", [False, True])
def test_a_hot_thread_is_pinned_and_what_it_creates_is_not(
    spawn: Callable[..., Any],
    build: Callable[[str], Path],
    tmp_path: Path,
    eager: None,
    follow_forks: bool,
) -> None:
    lines, seen, tools = run_placement(
        spawn, build("placement"), tmp_path, follow_forks=follow_forks
    )
    assert seen[0] == ALL and tools[0] == ALL  # nothing is moved before the first window
    assert len(seen[-1]) == 1 and seen[-1] == tools[-1]  # then both on one CPU
    n = len(ALL)
    assert lines == ["main: 1 cpus", f"thread: {n} cpus", f"child: {n} cpus", "done"]


@pytest.mark.ptrace
def test_pin_hot_threads_off_moves_nothing(
    spawn: Callable[..., Any], build: Callable[[str], Path], tmp_path: Path, eager: None
) -> None:
    lines, seen, tools = run_placement(spawn, build("placement"), tmp_path, pin_hot_threads=False)
    assert all(mask == ALL for mask in seen) and all(mask == ALL for mask in tools)
    assert lines[0] == f"main: {len(ALL)} cpus"


@pytest.mark.ptrace
def test_an_attached_program_gets_its_mask_back_at_detach(
    attach: Callable[..., Any],
    build: Callable[[str], Path],
    popen: Callable[..., subprocess.Popen[bytes]],
    eager: None,
) -> None:
    program = popen([build("placement"), 0, -1], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert program.stdout is not None and program.stderr is not None
    assert support.read_line(program.stderr.fileno(), 10).endswith(b"ready\n")
    proc = attach(program.pid)
    proc.register_kprobe(kprobes.Kprobe(symbol="hot"))

    def pinned() -> bool:
        proc.run(timeout=0.05)
        return len(os.sched_getaffinity(program.pid)) == 1

    support.wait_until(pinned, 20, "the hot thread pinned")
    assert os.sched_getaffinity(0) == os.sched_getaffinity(program.pid)
    proc.detach()
    assert os.sched_getaffinity(program.pid) == ALL
    os.kill(program.pid, signal.SIGTERM)
    out, _ = program.communicate(timeout=10)
    assert out.decode().splitlines()[0] == f"main: {len(ALL)} cpus"


@pytest.mark.ptrace
def test_four_threads_hit_rarely_keep_every_cpu(
    spawn: Callable[..., Any], build: Callable[[str], Path]
) -> None:
    """threads.c's slow mode: each thread sleeps 1 ms after each hit, far slower than the
    pace that pins; the threads and the tool must keep every CPU they had."""
    masks: list[set[int]] = []

    def pre(kp: Any, regs: Any) -> None:
        masks.append(os.sched_getaffinity(regs.tid) & os.sched_getaffinity(0))

    with open(os.devnull, "wb") as null:
        proc = spawn([build("threads"), 4, 200, "slow"], stdout=null)
    proc.register_kprobe(kprobes.Kprobe(symbol="hammer", pre_handler=pre))
    assert proc.run(timeout=60)
    assert len(masks) == 800 and all(mask == ALL for mask in masks)


@pytest.mark.ptrace
def test_four_hot_threads_share_the_tools_cpu_and_their_own_come_back(
    spawn: Callable[..., Any], build: Callable[[str], Path], eager: None
) -> None:
    hits: dict[int, int] = {}
    late: dict[int, set[int]] = {}  # tid → its mask and the tool's, at its last hits

    def pre(kp: Any, regs: Any) -> None:
        hits[regs.tid] = hits.get(regs.tid, 0) + 1
        if hits[regs.tid] > 10 * WINDOW:
            late[regs.tid] = os.sched_getaffinity(regs.tid) | os.sched_getaffinity(0)

    with open(os.devnull, "wb") as null:
        proc = spawn([build("threads"), 4, 2000], stdout=null)
    proc.register_kprobe(kprobes.Kprobe(symbol="hammer", pre_handler=pre))
    assert proc.run(timeout=60)
    assert len(late) == 4 and all(len(mask) == 1 for mask in late.values())
    assert len({frozenset(mask) for mask in late.values()}) == 1  # one CPU for all
