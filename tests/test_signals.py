"""Signals: the program's own signals reach it unchanged while probes fire around them.

tests/programs/signals.c: a SIGALRM itimer firing during a hot probed loop; the program's own
raise(SIGTRAP) and int3 caught by its own handler; a blocking syscall, single-stepped out of
line under a probe, interrupted by a signal.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes

pytestmark = pytest.mark.ptrace


@pytest.fixture
def signals(build: Callable[[str], Path]) -> Path:
    return build("signals")


def run_traced(
    spawn: Callable[..., Any],
    tmp_path: Path,
    argv: list[Any],
    probes: list[Any],
    before_run: Callable[[Any], None] = lambda proc: None,
) -> tuple[Any, bytes, bytes]:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = spawn(argv, stdout=fo, stderr=fe)
    proc.register_kprobes(probes)
    before_run(proc)
    assert proc.run(timeout=60), "program did not finish"
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


def test_signals_during_stepped_syscalls_in_a_loop(spawn, signals, tmp_path):
    n = 2000
    argv = [signals, "sysloop", n, 200]
    kp = kprobes.Kprobe(symbol="kpt_getppid", offset=5, post_handler=lambda p, r, f: None)
    entry = kprobes.Kprobe(symbol="kpt_getppid")
    proc, stdout, stderr = run_traced(spawn, tmp_path, argv, [kp, entry])
    assert proc.exit_code == 0
    assert stdout == f"sysloop ok={n} of {n}\n".encode()
    assert re.fullmatch(rb"alarms=\d+\n", stderr)
    assert (kp.nhit, entry.nhit) == (n, n)


def test_fatal_signal_is_reported(spawn, build, tmp_path):
    exe = build("procs")
    kp = kprobes.Kprobe(symbol="work")
    proc, stdout, _ = run_traced(spawn, tmp_path, [exe, "abort"], [kp])
    assert proc.exit_code == -6  # SIGABRT
    assert kp.nhit == 3
    assert stdout == b"works=15\n"
