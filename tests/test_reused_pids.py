"""A pid the kernel gives again: what a tracer reaped of its earlier process is not the new
one's.

One ``wait`` of a tracer sees every child of this Python process: a stop or an exit of a
pid no tracer owns is kept for a thread whose clone event has not been seen yet
(owners.py). A child of the host program that no tracer traces (a ``Popen`` of a test, of
a program that imports us) is reaped so when it exits, and its exit was kept under its pid
for good. With the pids of a long-lived process going round (``pid_max`` is 32,768 on many
machines; the test suite starts more processes than that), a program later given the same
pid was handed that exit at its attach or spawn: our books said it had exited (0) while
it sat held in a ptrace stop, and ``run()`` waited for its deadline (CI, stops 38 and 40:
``test_fast_stacks``'s attach test, "live 0 ... exited (0)"). Made exact here by keeping
such an exit under the pid of the next program before it is traced.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import kprobes
from kprobes.process.engine import owners

pytestmark = pytest.mark.ptrace

EXITED_0 = 0  # the wait status of a process that exited with status 0


@pytest.fixture
def target_bin(build):
    return build("target")


def test_an_attach_is_not_handed_an_earlier_process_s_exit(build) -> None:
    """``stacks gated`` waits for a line on stdin, then calls ``leaf`` and waits for the end
    of stdin: attached while it waits."""
    prog = subprocess.Popen(
        [build("stacks"), "gated"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    try:
        owners._UNCLAIMED.setdefault(prog.pid, []).append(EXITED_0)  # of an earlier pid
        with kprobes.attach(prog.pid) as proc:
            hits = []
            proc.register_kprobe(
                kprobes.Kprobe(symbol="leaf", pre_handler=lambda p, r: hits.append(1))
            )
            assert prog.stdin is not None
            prog.stdin.write(b"go\n")
            prog.stdin.close()
            assert proc.run(timeout=60), "the program's own exit never came"
        assert hits
    finally:
        owners._UNCLAIMED.pop(prog.pid, None)
        if prog.poll() is None:
            prog.kill()
        prog.wait()


def test_a_spawn_is_not_handed_an_earlier_process_s_exit(target_bin, monkeypatch) -> None:
    forked: list[int] = []
    fork = os.fork

    def fork_and_stale() -> int:
        pid = fork()
        if pid:
            forked.append(pid)
            owners._UNCLAIMED.setdefault(pid, []).append(EXITED_0)  # of an earlier pid
        return pid

    monkeypatch.setattr(os, "fork", fork_and_stale)
    hits = []
    with kprobes.spawn([str(target_bin), "20"]) as proc:
        monkeypatch.undo()
        proc.register_kprobe(kprobes.Kprobe(symbol="work", pre_handler=lambda p, r: hits.append(1)))
        assert proc.run(timeout=60), "the program's own exit never came"
    assert len(hits) == 20
    for pid in forked:
        owners._UNCLAIMED.pop(pid, None)


def test_a_new_thread_keeps_its_own_stops_and_not_an_earlier_exit() -> None:
    """A clone's stops may come before its clone event (kept, then claimed); an exit kept
    before its first stop is an earlier process's."""
    tid, tracer = 1 << 30, object()  # no real pid is this high (pid_max is at most 2**22)
    stop, killed = 0x137F, 9  # a SIGSTOP stop; killed by SIGKILL
    try:
        owners._UNCLAIMED[tid] = [EXITED_0, killed, stop, EXITED_0]
        assert owners.claim(tracer, tid) == [stop, EXITED_0]  # type: ignore[arg-type]
        owners._UNCLAIMED[tid] = [EXITED_0, stop]
        assert owners.claim(tracer, tid, seized=True) == []  # type: ignore[arg-type]
        assert tid not in owners._UNCLAIMED
    finally:
        owners._UNCLAIMED.pop(tid, None)
        owners._OWNERS.pop(tid, None)
