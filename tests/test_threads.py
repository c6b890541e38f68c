"""Threads: every thread is traced, every hit is counted, handlers see which thread hit.

tests/programs/threads.c starts T threads together (a barrier) that each call hammer(t, i) for
i in 0..N-1, so the exact number of hits per thread and per argument is known in advance.
"""

from __future__ import annotations

import collections
import itertools
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes

pytestmark = pytest.mark.ptrace

T = 8


@pytest.fixture
def threads(build: Callable[[str], Path]) -> Path:
    return build("threads")


class Recorder:
    """Pre handler that records (tid, thread index, call index) of every hit."""

    def __init__(self) -> None:
        self.hits: list[tuple[int, int, int]] = []

    def __call__(self, p: Any, regs: Any) -> None:
        self.hits.append((regs.tid, regs.rdi, regs.rsi))


def check_hits(hits: list[tuple[int, int, int]], pid: int, n: int) -> None:
    """Exactly n calls per thread index, each index from one thread, T threads, not main."""
    assert len(hits) == T * n
    per_index = collections.Counter(t for _, t, _ in hits)
    assert per_index == {t: n for t in range(T)}
    tids_of_index = collections.defaultdict(set)
    for tid, t, _ in hits:
        tids_of_index[t].add(tid)
    assert all(len(tids) == 1 for tids in tids_of_index.values()), tids_of_index
    tids = {tid for tid, _, _ in hits}
    assert len(tids) == T
    assert pid not in tids
    for t in range(T):
        assert sorted(i for _, idx, i in hits if idx == t) == list(range(n))


@pytest.mark.parametrize("handlers", ["pre", "pre+post"])
def test_eight_threads_hammering_one_function(spawn, threads, tmp_path, handlers):
    n = 1000
    expected = support.reference_output([threads, T, n])
    out = tmp_path / "out"
    with open(out, "wb") as f:
        proc = spawn([threads, T, n], stdout=f)
    entry = Recorder()
    posts: list[int] = []
    post = (lambda p, r, f: posts.append(r.tid)) if handlers == "pre+post" else None
    kp = kprobes.Kprobe(symbol="hammer", pre_handler=entry, post_handler=post)
    # Every other instruction of hammer() too: hits on several probes at once.
    others = [
        kprobes.Kprobe(symbol="hammer", offset=off, post_handler=post)
        for off in support.boundaries(threads, "hammer")[1:]
    ]
    proc.register_kprobes([kp, *others])
    assert proc.run(timeout=60), "program did not finish"
    assert proc.exit_code == 0
    assert out.read_bytes() == expected
    assert kp.nhit == T * n
    assert kp.nmissed == 0
    assert [o.nhit for o in others] == [T * n] * len(others)
    check_hits(entry.hits, proc.pid, n)
    if post is not None:
        assert len(posts) == T * n * (1 + len(others))
    # The threads really ran at the same time: their hits interleave.
    switches = sum(1 for a, b in itertools.pairwise(entry.hits) if a[0] != b[0])
    assert switches > T


def test_threads_created_after_attach(attach, popen, threads, tmp_path):
    n = 500
    out = tmp_path / "out"
    with open(out, "wb") as f:
        child = popen([threads, T, n, "wait"], stdin=subprocess.PIPE, stdout=f)
    support.wait_for_lines(out, 1, timeout=10)
    assert len(support.thread_ids(child.pid)) == 1
    proc = attach(child.pid)
    entry = Recorder()
    kp = kprobes.Kprobe(symbol="hammer", pre_handler=entry)
    proc.register_kprobe(kp)
    assert child.stdin is not None
    child.stdin.write(b"x")
    child.stdin.close()
    assert proc.run(timeout=60), "program did not finish"
    assert proc.exit_code == 0
    assert kp.nhit == T * n
    check_hits(entry.hits, proc.pid, n)
    lines = out.read_text().splitlines()
    assert lines[0] == "ready"
    assert (
        lines[-1] == f"total {sum((t + 1) * 1000003 * n + 7 * n * (n - 1) // 2 for t in range(T))}"
    )


def test_attach_to_running_threads(attach, popen, threads, tmp_path):
    """Attach while T threads are running: from its first hit on, each thread's calls are all
    seen, in order, up to its last."""
    n = 600
    out = tmp_path / "out"
    with open(out, "wb") as f:
        child = popen([threads, T, n, "slow"], stdout=f)
    support.wait_for_lines(out, 1, timeout=10)
    support.wait_until(
        lambda: len(support.thread_ids(child.pid)) == T + 1, timeout=10, what="threads"
    )
    proc = attach(child.pid)
    entry = Recorder()
    kp = kprobes.Kprobe(symbol="hammer", pre_handler=entry)
    proc.register_kprobe(kp)
    assert proc.run(timeout=60), "program did not finish"
    assert proc.exit_code == 0
    seen = collections.defaultdict(list)
    for _, t, i in entry.hits:
        seen[t].append(i)
    assert sorted(seen) == list(range(T))
    for t, calls in seen.items():
        assert calls == list(range(calls[0], n)), f"thread {t} missed calls"
    assert len({tid for tid, _, _ in entry.hits}) == T
    assert kp.nhit == len(entry.hits)
    assert out.read_text().splitlines()[-1].startswith("total ")
