"""Signals: the program's own signals reach it unchanged while probes fire around them.

tests/programs/signals.c: a SIGALRM itimer firing during a hot probed loop; the program's own
raise(SIGTRAP) and int3 caught by its own handler; a blocking syscall, single-stepped out of
line under a probe, interrupted by a signal.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes.linux import ptrace
from kprobes.process.engine import threads

pytestmark = pytest.mark.ptrace


PERIODS = 1.0  # the fast timers' period, in probed iterations (three stops each)


@pytest.fixture
def signals(build: Callable[[str], Path]) -> Path:
    return build("signals")


def run_traced(
    spawn: Callable[..., Any],
    tmp_path: Path,
    argv: list[Any],
    probes: list[Any],
    before_run: Callable[[Any], None] = lambda proc: None,
    timeout: float = 60,
    took: list[float] | None = None,
) -> tuple[Any, bytes, bytes]:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = spawn(argv, stdout=fo, stderr=fe)
    proc.register_kprobes(probes)
    before_run(proc)
    start = time.monotonic()
    assert proc.run(timeout=timeout), "program did not finish"
    if took is not None:
        took.append(time.monotonic() - start)
    return proc, out.read_bytes(), err.read_bytes()


@pytest.mark.parametrize("handlers", ["pre", "pre+post"])
def test_itimer_during_a_hot_probed_loop(spawn, signals, tmp_path, handlers):
    n, interval_us = 3000, 500
    argv = [signals, "alarm", n, interval_us]
    expected = support.reference_output(argv)
    post = (lambda p, r, f: None) if handlers == "pre+post" else None
    # Every instruction of mix(): alarms land on probes, in out-of-line copies, anywhere.
    mix = [
        kprobes.Kprobe(symbol="mix", offset=off, post_handler=post)
        for off in support.boundaries(signals, "mix")
    ]
    on_alarm = kprobes.Kprobe(symbol="on_alarm", post_handler=post)
    proc, stdout, stderr = run_traced(spawn, tmp_path, argv, [*mix, on_alarm])
    assert proc.exit_code == 0
    assert stdout == expected
    m = re.fullmatch(rb"alarms=(\d+) on_alarm=(\d+)\n", stderr)
    assert m is not None, stderr
    alarms = int(m.group(1))
    assert alarms >= 1, "no SIGALRM arrived during the loop: the test proves nothing"
    assert int(m.group(2)) == alarms
    assert [kp.nhit for kp in mix] == [n] * len(mix)
    assert on_alarm.nhit == alarms
    assert all(kp.nmissed == 0 for kp in [*mix, on_alarm])


def test_programs_own_sigtrap_is_passed_through(spawn, signals, tmp_path):
    argv = [signals, "trap"]
    expected = support.reference_output(argv)
    assert expected == (
        b"raise: traps=1 code=-6\nint3: traps=2 code=128 rip_ok=1\nwork=4\n"
    )  # SI_TKILL for raise(), SI_KERNEL for int3, with rip after the int3
    hits: list[int] = []
    work = kprobes.Kprobe(symbol="work", pre_handler=lambda p, r: hits.append(r.rdi))
    # The program's SIGTRAP handler, and the instruction right after its int3: the trap of
    # the program's int3 at A leaves rip = A + 1, which is where our own int3 sits.
    handler = kprobes.Kprobe(symbol="trap_handler")
    after = kprobes.Kprobe(symbol="kpt_after_int3")
    int3_site: list[int] = []
    proc, stdout, _ = run_traced(
        spawn,
        tmp_path,
        argv,
        [work, handler, after],
        lambda proc: int3_site.append(support.runtime_address(proc.pid, signals, "kpt_int3_site")),
    )
    assert after.addr == int3_site[0] + 1
    assert proc.exit_code == 0
    assert stdout == expected
    assert hits == [0, 1]  # work() called from the SIGTRAP handler, twice
    assert (handler.nhit, after.nhit) == (2, 1)


def test_a_handlers_register_writes_survive_the_sigtrap_guard(spawn, signals, tmp_path):
    """Inside the program's own SIGTRAP handler our trap resets that handler, and the guard
    puts it back with an injected rt_sigaction after the pre handler ran: the pre handler's
    register writes must survive that injection."""

    def plus_ten(p: Any, regs: Any) -> None:
        regs.rdi = regs.rdi + 10

    work = kprobes.Kprobe(symbol="work", pre_handler=plus_ten)
    proc, stdout, _ = run_traced(spawn, tmp_path, [signals, "trap"], [work])
    assert proc.exit_code == 0
    # work(x) = 2x + 1, called with 0 and 1 from the handler: 4 unprobed, 21 + 23 here.
    assert stdout.endswith(b"work=44\n"), stdout
    assert work.nhit == 2


def test_signal_during_a_single_stepped_syscall(spawn, signals, tmp_path):
    """pause() is single-stepped out of line under the probe: it blocks until SIGALRM, which
    must be delivered to the program's handler (not held until the step completes)."""
    insns = dict(support.function_insns(signals, "kpt_pause"))
    assert insns[5] == "syscall"
    argv = [signals, "pause"]
    expected = support.reference_output(argv)
    assert expected == b"pause=-4 alarms=1\n"
    post_ips: list[int] = []
    kp = kprobes.Kprobe(
        symbol="kpt_pause", offset=5, post_handler=lambda p, r, f: post_ips.append(r.ip)
    )
    on_alarm = kprobes.Kprobe(symbol="on_alarm")
    proc, stdout, _ = run_traced(spawn, tmp_path, argv, [kp, on_alarm])
    assert proc.exit_code == 0
    assert stdout == expected
    assert kp.nhit == 1
    assert on_alarm.nhit == 1
    assert post_ips == [kp.addr + 2]


def sysloop_probes() -> list[Any]:
    """The probes of issue 18: the single-stepped ``syscall`` (a post handler) and the
    boosted ``mov`` before it."""
    return [
        kprobes.Kprobe(symbol="kpt_getppid", offset=5, post_handler=lambda p, r, f: None),
        kprobes.Kprobe(symbol="kpt_getppid"),
    ]


def check_sysloop(proc: Any, stdout: bytes, stderr: bytes, n: int, probes: list[Any]) -> int:
    """A sysloop run that ended well, every call hit; the alarms the program handled."""
    assert proc.exit_code == 0
    assert stdout == f"sysloop ok={n} of {n}\n".encode()
    m = re.fullmatch(rb"alarms=(\d+)\n", stderr)
    assert m is not None, stderr
    assert [kp.nhit for kp in probes] == [n, n]
    return int(m.group(1))


def test_signals_during_stepped_syscalls_in_a_loop(spawn, signals, tmp_path):
    n = 2000
    probes = sysloop_probes()
    proc, stdout, stderr = run_traced(spawn, tmp_path, [signals, "sysloop", n, 200], probes)
    check_sysloop(proc, stdout, stderr, n, probes)


def _wait_pending(pid: int, signo: int, limit: float = 30.0) -> None:
    """Until ``signo`` is pending for the (single-threaded) process ``pid``."""
    bit = 1 << (signo - 1)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
                return
        time.sleep(0.0002)
    raise AssertionError(f"signal {signo} never pending in {pid}")


def test_a_signal_before_every_stepped_syscall_does_not_restart_it(
    spawn, signals, tmp_path, monkeypatch
):
    """The worst case of a timer as fast as our stops, made certain: the tool waits, before
    each single-step of the probed ``syscall`` begins, until the itimer's SIGALRM is pending,
    so that it lands before the syscall every time. A step abandoned for the signal and begun
    again from the probed address (issue 18) meets the same wait and never ends; held until
    the syscall is under way, the signal is delivered after it and the loop goes on."""
    step = threads.Thread.step

    def step_after_a_signal(self: threads.Thread) -> None:
        if self.step_prep.plan.is_syscall:
            _wait_pending(self.tracee.pid, signal.SIGALRM)
        step(self)

    monkeypatch.setattr(threads.Thread, "step", step_after_a_signal)
    n = 200
    probes = sysloop_probes()
    proc, stdout, stderr = run_traced(spawn, tmp_path, [signals, "sysloop", n, 2000], probes)
    alarms = check_sysloop(proc, stdout, stderr, n, probes)
    assert alarms >= n  # one at least before each step: the wait saw it pending


@pytest.mark.deadline(1300)
def test_stepped_syscalls_under_a_timer_as_fast_as_the_probes(spawn, signals, tmp_path):
    """The sysloop case of issue 18 at a timer period of one probed iteration (three stops),
    measured here first: the program slows down, it does not stall (on the issue's machine
    the old code never ended at two iterations)."""
    n = 400
    probes: list[Any] = []
    took: list[float] = []

    def traced(us: int) -> tuple[Any, bytes, bytes]:
        probes[:] = sysloop_probes()
        argv = [signals, "sysloop", n, us]
        return run_traced(spawn, tmp_path, argv, probes, timeout=600, took=took)

    traced(0)  # no timer: what a probed iteration costs
    period_us = max(1, int(PERIODS * took[0] / n * 1e6))
    alarms = check_sysloop(*traced(period_us), n, probes)
    assert alarms >= 1, f"no SIGALRM at {period_us} us: the test proves nothing"


@pytest.mark.deadline(1300)
def test_every_plan_under_a_timer_as_fast_as_the_probes(spawn, signals, tmp_path):
    """Every instruction of mix() probed (emulated, boosted and, with a post handler on the
    odd ones, stepped copies) and a return probe on it, under a timer whose period is one
    probed call, measured here first: output and counts exact, every alarm handled."""
    n = 300
    offsets = support.boundaries(signals, "mix")
    probes: list[Any] = []
    rets: list[Any] = []
    took: list[float] = []

    def traced(us: int) -> tuple[Any, bytes, bytes]:
        probes[:] = [
            kprobes.Kprobe(
                symbol="mix", offset=off, post_handler=(lambda p, r, f: None) if i % 2 else None
            )
            for i, off in enumerate(offsets)
        ] + [kprobes.Kprobe(symbol="on_alarm")]
        rets[:] = [kprobes.Kretprobe(symbol="mix", handler=lambda ri, regs: None)]
        return run_traced(
            spawn,
            tmp_path,
            [signals, "alarm", n, us],
            probes,
            lambda proc: proc.register_kretprobes(rets),
            timeout=600,
            took=took,
        )

    traced(0)  # no timer: what a probed call costs
    period_us = max(1, int(PERIODS * took[0] / n * 1e6))
    argv = [signals, "alarm", n, period_us]
    expected = support.reference_output(argv)
    proc, stdout, stderr = traced(period_us)
    assert proc.exit_code == 0
    assert stdout == expected
    m = re.fullmatch(rb"alarms=(\d+) on_alarm=(\d+)\n", stderr)
    assert m is not None, stderr
    alarms = int(m.group(1))
    assert alarms >= 1, f"no SIGALRM at {period_us} us: the test proves nothing"
    assert int(m.group(2)) == alarms
    assert [kp.nhit for kp in probes] == [n] * len(offsets) + [alarms]
    assert rets[0].nhit == n
    assert all(kp.nmissed == 0 for kp in [*probes, *rets])


def test_a_signal_at_every_hit_as_the_copies_begin(spawn, build, tmp_path):
    """Every instruction of fidelity.c's hand() probed, and each hit sends the thread a
    SIGURG (ignored by default, as Go's preemption signal is by a C program): it is pending
    as the thread is resumed into its copy, so every boosted copy begins with a signal (and
    is single-stepped; a pushf's is not, it would store the trap flag, which the program
    checks). Output and counts as in the same run without signals."""
    exe = build("fidelity")
    argv = [exe, "200", "64", "1000"]
    insns = support.function_insns(exe, "hand")
    offsets = [off for off, _ in insns]
    pushf = next(i for i, (_, text) in enumerate(insns) if text.startswith("pushf"))

    def traced(send: bool) -> tuple[Any, bytes, list[int]]:
        def pre(p: Any, regs: Any) -> None:
            if send:
                ptrace.tgkill(proc_box[0].pid, regs.tid, signal.SIGURG)

        probes = [kprobes.Kprobe(symbol="hand", offset=off, pre_handler=pre) for off in offsets]
        proc_box: list[Any] = []
        where = tmp_path / ("sent" if send else "quiet")
        where.mkdir()
        out, stdin = where / "stdout", where / "stdin"
        stdin.write_bytes(b"go\n")
        with open(stdin, "rb") as fi, open(out, "wb") as fo:
            proc = spawn(argv, stdin=fi, stdout=fo)
        proc_box.append(proc)
        proc.register_kprobes(probes)
        assert proc.run(timeout=300), "program did not finish"
        return proc, out.read_bytes(), [kp.nhit for kp in probes]

    expected = support.reference_output(argv, stdin=b"go\n")
    assert b" tf=0 flags=200\n" in expected
    quiet, quiet_out, quiet_hits = traced(send=False)
    sent, sent_out, sent_hits = traced(send=True)
    assert (quiet.exit_code, sent.exit_code) == (0, 0)
    assert quiet_out == sent_out == expected
    assert sent_hits == quiet_hits
    assert quiet_hits[pushf] > 0


def test_fatal_signal_is_reported(spawn, build, tmp_path):
    exe = build("procs")
    kp = kprobes.Kprobe(symbol="work")
    proc, stdout, _ = run_traced(spawn, tmp_path, [exe, "abort"], [kp])
    assert proc.exit_code == -6  # SIGABRT
    assert kp.nhit == 3
    assert stdout == b"works=15\n"
