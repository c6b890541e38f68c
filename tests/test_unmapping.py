"""A clean end leaves no page of ours in the program (issue 17, item 5).

Every session maps pages in the program it probes: out-of-line slots and the return
trampoline, detour pages, a 32 MiB shared area per neighbourhood of optimized probes, the
rescue's 4 MiB. A clean end must give back every one no thread can be in; one session after
another must not add to what the program holds. tests/programs/allocs.c is probed again and
again in libc (malloc, free: entry and return probes, optimized and on traps) and in its own
code (checksum), by the command line and by the API, while its threads run; after each clean
end the program holds no mapping of ours and no shared memory, and it finishes with its
output.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import support

import kprobes
from kprobes.symbols.maps import Mapping

pytestmark = pytest.mark.ptrace

THREADS = 2
AREA = "/memfd:kprobes-area"


def start_allocs(
    popen: Callable[..., subprocess.Popen[bytes]], exe: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """``allocs THREADS`` once every worker runs; (program, address of worker 0's word)."""
    prog = popen([exe, THREADS], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert prog.stderr is not None
    line = support.read_line(prog.stderr.fileno(), timeout=20).decode()
    head, _, word = line.rpartition(" ")
    assert head == f"allocs {prog.pid} ready", line
    return prog, int(word, 16)


def ours(pid: int) -> list[str]:
    """Mappings of ours in ``pid``: the shared areas, and executable pages of no file (in a
    plain C program only an injected page is one)."""
    found = [f"{m.start:#x}-{m.end:#x} {m.path}" for m in support.maps(pid) if AREA in m.path]
    found += [f"{m.start:#x}-{m.end:#x} r-x" for m in support.anonymous_exec_mappings(pid)]
    return found


def shared_kib(pid: int) -> int:
    """RssShmem: the program's resident shared memory (it has none of its own)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/PID/status")


def finish(prog: subprocess.Popen[bytes]) -> None:
    status, out, err = support.stop_busy(prog, timeout=30)
    assert (status, out) == (0, f"allocs: {THREADS} threads, every block checked\n"), err


COMMANDS = [
    ("trace", "-n", "100", "libc:malloc size=%di"),
    ("trace", "-n", "100", "libc:malloc size=%di", "r libc:malloc ret=$retval", "checksum n=%si"),
    ("count", "-d", "1", "libc:malloc", "libc:free", "checksum"),
    ("trace", "--no-optimize", "-n", "100", "libc:free", "r checksum ret=$retval"),
]


@pytest.mark.deadline(300)
def test_clean_command_line_runs_leave_nothing_of_ours(popen, build):
    prog, _ = start_allocs(popen, build("allocs"))
    pid = prog.pid
    assert ours(pid) == []
    for round_ in range(2):
        for command, *args in COMMANDS:
            result = support.cli(command, "-p", pid, *args, timeout=120)
            assert result.returncode == 0, result.stderr
            assert "stay in process" not in result.stderr
            assert ours(pid) == [], (round_, command, args)
            assert shared_kib(pid) == 0, (round_, command, args)
            support.assert_untouched(pid, support.libc_path(build("allocs")))
    finish(prog)


@pytest.mark.deadline(300)
def test_clean_api_sessions_leave_nothing_of_ours(popen, build):
    """Records, counts, return probes with big pools (the rescue's extra records) and a
    detach while every thread runs: three sessions, nothing left after each."""
    prog, _ = start_allocs(popen, build("allocs"))
    pid = prog.pid
    seen: list[int] = []
    for session in range(3):
        with kprobes.attach(pid) as proc:
            proc.register_kprobe(
                kprobes.Kprobe(
                    symbol="libc:malloc",
                    optimize=True,
                    async_handler=lambda probe, hit, s=session: seen.append(s),
                    args="size=%di",
                )
            )
            proc.register_kprobe(kprobes.Kprobe(symbol="libc:free", optimize=True))
            proc.register_kretprobe(
                kprobes.Kretprobe(
                    symbol="checksum", handler=lambda ri, regs: None, maxactive=200_000
                )
            )
            # Until a record came (however slow the machine: no time is taken for granted).
            while session not in seen:
                proc.run(timeout=0.5)
            assert ours(pid) != []  # the session did map pages of its own
        assert proc.kept == [], proc.kept
        assert ours(pid) == []
        assert shared_kib(pid) == 0
    finish(prog)


@pytest.mark.deadline(300)
def test_a_thread_with_its_own_stop_pending_is_lent_for_the_unmapping(popen, build):
    """A single thread that signals itself in a tight loop is nearly always caught, when the
    world stops for the detach, with its own signal's stop already reported (pending). The
    clean end lends the last thread for the injected munmaps; none was free, and every page
    of every session stayed (32 MiB of areas a session, and a rescue growing by 4 MiB), said
    nowhere. Its stop is now handled first and its signal delivered at its release."""
    prog = popen([build("selfsignal")], stdout=subprocess.PIPE)
    assert prog.stdout is not None
    assert prog.stdout.readline() == b"ready\n"
    for cycle in range(12):
        proc = kprobes.attach(prog.pid)
        try:
            proc.register_kprobe(kprobes.Kprobe(symbol="work", optimize=True))
            (entry,) = proc.list()
            assert entry.is_optimized, entry.why_not_optimized
            assert ours(prog.pid) != []
            proc.run(timeout=0.01 * (cycle % 4))
        finally:
            proc.detach()
        assert proc.kept == [], proc.kept
        assert ours(prog.pid) == [], f"cycle {cycle}"
        assert shared_kib(prog.pid) == 0
        assert prog.poll() is None
    prog.send_signal(signal.SIGTERM)
    assert prog.wait(timeout=60) == 0
    out = prog.stdout.read().decode().split()
    assert out[0].startswith("signals=") and out[0][8:] == out[1][6:], out


def poke(pid: int, addr: int, value: int) -> None:
    fd = os.open(f"/proc/{pid}/mem", os.O_WRONLY)
    try:
        os.pwrite(fd, value.to_bytes(8, "little"), addr)
    finally:
        os.close(fd)


def one_session(pid: int) -> list[Mapping]:
    """A trap probe on the program's own checksum(): its out-of-line page (64 KiB) while
    attached, returned."""
    kp = kprobes.Kprobe(symbol="checksum", pre_handler=lambda p, r: None)
    with kprobes.attach(pid) as proc:
        proc.register_kprobe(kp)
        proc.run(timeout=0.3)
        pages = [m for m in support.anonymous_exec_mappings(pid) if m.end - m.start == 0x10000]
    assert kp.nhit > 0
    return pages


@pytest.mark.deadline(120)
def test_a_page_a_thread_may_return_into_stays_until_a_later_session(popen, build):
    """A word above a thread's stack pointer that points into our out-of-line page (what a
    signal frame interrupted in a slot holds) keeps that page, and only it, at the clean
    end; once the word is gone, the next session gives it back with its own pages."""
    prog, word = start_allocs(popen, build("allocs"))
    pid = prog.pid
    with kprobes.attach(pid) as proc:
        proc.register_kprobe(kprobes.Kprobe(symbol="checksum", pre_handler=lambda p, r: None))
        proc.run(timeout=0.3)
        slots = [m for m in support.anonymous_exec_mappings(pid) if m.end - m.start == 0x10000]
        assert len(slots) == 1, slots
        page = slots[0]
        poke(pid, word, page.start + 0x40)
    assert ours(pid) == [f"{page.start:#x}-{page.end:#x} r-x"]
    # and it says why: which thread, which word of its stack, pointing where
    (why,) = proc.kept
    assert why.startswith(f"out-of-line slots at {page.start:#x}: thread "), why
    assert why.endswith(f"'s stack word at {word:#x} is {page.start + 0x40:#x}"), why
    for _ in range(2):  # still there: kept again, not added to
        one_session(pid)
        assert ours(pid) == [f"{page.start:#x}-{page.end:#x} r-x"]
    poke(pid, word, 0)
    one_session(pid)
    assert ours(pid) == []
    finish(prog)
