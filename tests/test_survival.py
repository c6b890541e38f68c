"""The probed program never dies because of us: detached in flight, busy, or with the tool killed.

The program is tests/programs/busy.c, started by the test (not by kprobes), its threads
calling ``rec`` and ``hot`` in tight loops with every result checked; SIGUSR1 makes it finish
its iterations and print its deterministic summary. Whatever happens to the tool, the program
must print exactly what an unprobed run prints, and exit 0: one int3, one trampoline address
or one borrowed register left behind would kill it with SIGTRAP or SIGSEGV, or make a check
fail.
"""

from __future__ import annotations

import os
import random
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

DRIVERS = Path(__file__).resolve().parent / "drivers"
REPO = DRIVERS.parent.parent
THREADS = 4
DEPTH = 5


def expected_output(threads: int = THREADS, depth: int = DEPTH) -> bytes:
    want = depth * (depth + 1) // 2
    lines = [f"thread {t}: rec({depth}) = {want}, every call checked" for t in range(threads)]
    return ("\n".join([*lines, f"total: {threads} threads stopped"]) + "\n").encode()


def start_busy(
    popen: Callable[..., subprocess.Popen[bytes]], build: Callable[[str], Path], threads: int
) -> subprocess.Popen[bytes]:
    prog = popen(
        [build("busy"), threads, -1, DEPTH], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert prog.stderr is not None
    line = support.read_line(prog.stderr.fileno(), timeout=20)
    assert line.startswith(b"busy ") and line.endswith(b"ready\n"), line
    return prog


def finish_busy(prog: subprocess.Popen[bytes], threads: int = THREADS) -> None:
    """Stop the program; it must end by itself with the unprobed output and status 0."""
    assert prog.poll() is None, f"the program died: status {prog.returncode}"
    os.kill(prog.pid, signal.SIGUSR1)
    out, err = prog.communicate(timeout=30)
    assert prog.returncode == 0, (prog.returncode, err.decode()[-2000:])
    assert out == expected_output(threads), err.decode()[-2000:]


def test_unprobed_reference(popen, build):
    finish_busy(start_busy(popen, build, THREADS))


def test_attach_and_detach_with_return_probes_in_flight(popen, build):
    """15 attach/run/detach cycles on 4 busy threads, a kprobe and a kretprobe on ``rec``."""
    prog = start_busy(popen, build, THREADS)
    hits = 0
    for _ in range(15):
        with kprobes.attach(prog.pid) as proc:
            kp = kprobes.Kprobe(symbol="rec", pre_handler=lambda p, r: None)
            rp = kprobes.Kretprobe(symbol="rec", handler=lambda ri, r: None)
            proc.register_kprobe(kp)
            proc.register_kretprobe(rp)
            proc.run(timeout=0.2)
        hits += rp.nhit
        assert prog.poll() is None, f"the program died after a detach: {prog.returncode}"
    assert hits > 0
    finish_busy(prog)


def start_driver(
    popen: Callable[..., subprocess.Popen[bytes]], pid: int, *args: Any
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = popen(
        [sys.executable, DRIVERS / "probe_until_killed.py", pid, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    return driver


def wait_for(driver: subprocess.Popen[bytes], word: bytes) -> None:
    assert driver.stdout is not None
    while True:
        line = support.read_line(driver.stdout.fileno(), timeout=30)
        if not line:
            _, err = driver.communicate(timeout=5)
            raise AssertionError(f"the driver ended before {word!r}: {err.decode()[-2000:]}")
        if line.rstrip(b"\n") == word:
            return


def tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def kill_tool(driver: subprocess.Popen[bytes], prog: subprocess.Popen[bytes]) -> None:
    driver.kill()
    driver.wait(timeout=10)
    deadline = time.monotonic() + 10
    while tracer_of(prog.pid) != 0 and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("where", "after"),
    [("pre", 50), ("ret", 50), ("post", 50), ("inject", 1), ("inject", 2)],
    ids=[
        "in-a-hit",
        "in-a-trampoline-return",
        "in-an-out-of-line-step",
        "in-the-rescue-install",
        "in-a-page-mapping",
    ],
)
def test_tool_killed_in_the_middle(popen, build, where, after):
    """SIGKILL while the tool holds a thread in each of the states it can hold one in."""
    prog = start_busy(popen, build, THREADS)
    driver = start_driver(popen, prog.pid, "--stall", where, "--after", after)
    wait_for(driver, b"stalled")
    kill_tool(driver, prog)
    time.sleep(0.3)  # the program runs on alone, through every probe it still has
    finish_busy(prog)


def test_tool_killed_at_random_moments(popen, build):
    """8 SIGKILLs at random moments over one run, probes on entries, returns and steps."""
    prog = start_busy(popen, build, THREADS)
    rng = random.Random(int(os.environ.get("KPROBES_TEST_SEED", "10")))
    for _ in range(8):
        driver = start_driver(popen, prog.pid)
        wait_for(driver, b"ready")
        time.sleep(rng.uniform(0.0, 0.5))
        kill_tool(driver, prog)
        assert prog.poll() is None, f"the program died: status {prog.returncode}"
    finish_busy(prog)


def test_commands_killed_at_random_moments(popen, build):
    """``kprobes count`` and ``kprobes latency``, alternately, SIGKILLed 8 times at random
    moments (attaching, registering, tracing) over one run of the program."""
    prog = start_busy(popen, build, THREADS)
    rng = random.Random(int(os.environ.get("KPROBES_TEST_SEED", "20")))
    kprobes_cmd = Path(sys.executable).with_name("kprobes")
    for i in range(8):
        command = "count" if i % 2 == 0 else "latency"
        tool = popen(
            [kprobes_cmd, command, "-p", prog.pid, "rec", "-d", "60"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.2, 1.2))
        kill_tool(tool, prog)
        assert prog.poll() is None, f"the program died: status {prog.returncode}"
    finish_busy(prog)


def caught_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    return 0


def test_the_rescue_is_the_sigtrap_handler_only_while_attached(popen, build):
    """Attached, the program catches SIGTRAP (the rescue); detached, its own action is back."""
    prog = start_busy(popen, build, 2)
    trap = 1 << (signal.SIGTRAP - 1)
    before = caught_signals(prog.pid)
    assert not before & trap
    with kprobes.attach(prog.pid) as proc:
        proc.register_kprobe(kprobes.Kprobe(symbol="hot", pre_handler=lambda p, r: None))
        assert caught_signals(prog.pid) & trap
        assert any(e.reason == "kprobes rescue area" for e in proc.blacklist())
        proc.run(timeout=0.1)
    assert caught_signals(prog.pid) == before
    finish_busy(prog, 2)


def test_return_records_beyond_the_first_range(popen, build):
    """Pools larger than the rescue area's records get a range of their own; the program
    still finds every frame's way home when the tool is killed."""
    prog = start_busy(popen, build, 2)
    script = f"""
import kprobes
proc = kprobes.attach({prog.pid})
proc.register_kretprobe(kprobes.Kretprobe(symbol="rec", handler=lambda ri, r: None,
                                          maxactive=60000))
proc.register_kretprobe(kprobes.Kretprobe(symbol="hot", handler=lambda ri, r: None,
                                          maxactive=150000))
print(len(proc._tracer.rescue._ranges), flush=True)
proc.run()
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    tool = popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    assert tool.stdout is not None
    assert support.read_line(tool.stdout.fileno(), timeout=60).strip() == b"2"
    time.sleep(0.3)
    kill_tool(tool, prog)
    finish_busy(prog, 2)


@pytest.mark.parametrize("threads", [1, 4])
def test_detach_after_a_lost_stop_report(popen, build, threads):
    """A stop whose report the tool took and lost (as a KeyboardInterrupt between waitpid
    and the code that records it would lose it): detach finds the trap from the thread's
    siginfo and puts it back on its int3, instead of letting it go on mid-instruction."""
    prog = start_busy(popen, build, threads)
    with kprobes.attach(prog.pid) as proc:
        # rec+0x11 is `mov $0x0,%eax` (b8 00 00 00 00): one byte on, `add %al,(%rax)`
        # writes to wherever rax points (the value of a counter: a fault).
        assert dict(support.function_insns(build("busy"), "rec"))[0x11] == "mov    $0x0,%eax"
        proc.register_kprobe(kprobes.Kprobe(symbol="rec+0x11", pre_handler=lambda p, r: None))
        proc.run(timeout=0.05)
        stolen, status = os.waitpid(-1, 0x40000000)  # __WALL: the report the tool loses
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTRAP, status
        assert stolen in proc.threads
    time.sleep(0.2)
    finish_busy(prog, threads)


def test_a_program_that_cannot_take_the_rescue_is_still_probed(popen, build):
    """rt_sigaction refused by a seccomp filter: no rescue, the probes work as before."""
    argv = [build("nosigaction"), 5000]
    prog = popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert prog.stderr is not None and prog.stdin is not None
    assert support.read_line(prog.stderr.fileno(), timeout=20) == b"ready\n"
    with kprobes.attach(prog.pid) as proc:
        kp = kprobes.Kprobe(symbol="hot", pre_handler=lambda p, r: None)
        proc.register_kprobe(kp)
        assert "rt_sigaction" in (proc._tracer.rescue.unavailable or "")
        prog.stdin.write(b"go\n")  # every call is made with the probe in place
        prog.stdin.flush()
        assert proc.run(timeout=60)
    out, _ = prog.communicate(timeout=30)
    assert prog.returncode == 0 and out == f"sum={sum(i * 3 + 1 for i in range(5000))}\n".encode()
    assert kp.nhit == 5000


def blocked_in(pid: int) -> int:
    """The number of the syscall ``pid`` is blocked in (/proc/PID/syscall), else -1."""
    with open(f"/proc/{pid}/syscall") as f:
        first = f.read().split()[0]
    return int(first) if first.lstrip("-").isdigit() else -1


def thread_state(pid: int) -> str:
    """What a test says of a thread that is not where it should be."""
    said = []
    for name in ("stat", "syscall", "wchan"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                said.append(f"{name}: {f.read().strip()}")
        except OSError as e:
            said.append(f"{name}: {e}")
    return "; ".join(said)


def how_it_ended(prog: subprocess.Popen[bytes]) -> str:
    """What a program that ended where it should still wait said (read after its state)."""
    if prog.poll() is None:
        return ""
    out, err = prog.communicate(timeout=10)
    return f"; it ended with {prog.returncode}: {out!r} {err[-500:]!r}"


@pytest.mark.parametrize(("mode", "nr"), [("read", 0), ("poll", 7)])
def test_tool_killed_inside_an_injection_into_a_blocked_syscall(popen, build, mode, nr):
    """The thread the tool borrows is blocked in ``read`` (restarted by the kernel from its
    syscall instruction: -ERESTARTSYS) or in ``poll`` with a timeout (restarted through the
    kernel's restart block: -ERESTART_RESTARTBLOCK). Killed inside each of the injections on
    the rescue's stub, the tool leaves the call to go on waiting, as if nothing had happened:
    it returns what it would have, not errno 512 or EINTR (which a program with no signal
    handler never expects)."""
    driver_py = DRIVERS / "inject_until_killed.py"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for stall_at in range(1, 20):
        prog = popen(
            [build("blocked"), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert prog.stderr is not None and prog.stdin is not None
        assert support.read_line(prog.stderr.fileno(), timeout=20) == b"waiting\n"
        support.wait_until(lambda p=prog: blocked_in(p.pid) == nr, 20, f"blocked in {mode}")
        driver = popen(
            [sys.executable, driver_py, prog.pid, stall_at, "probed"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert driver.stdout is not None
        said = support.read_line(driver.stdout.fileno(), timeout=60)
        if said == b"placed\n":  # and the detach's injections
            said = driver.stdout.readline()
        stalled = said.startswith(b"stalled")
        if stalled:
            kill_tool(driver, prog)
        else:
            assert said == b"" and driver.wait(timeout=30) == 0, said
        want = (b"poll 1\n" if mode == "poll" else b"") + b"read 6: hello\n"
        if mode == "poll" and said == b"stalled in the rescue's munmap\n":
            # The one window left (selfrestore.py): the thread is already in restart_syscall
            # (the kernel restarted its poll when the tool let it go on after the probe was
            # placed), whose restart block rt_sigreturn cancels, and no code of ours is left
            # to restart it before: EINTR, as after a handler of the program's.
            out, err = prog.communicate(b"hello\n", timeout=30)
            assert out in (want, b"poll failed: errno 4\n"), (out, err.decode()[-2000:])
            continue
        # poll goes on in restart_syscall (219) where the rescue finished it
        again = {nr, 219} if mode == "poll" else {nr}
        support.wait_until(
            lambda p=prog, a=again: blocked_in(p.pid) in a,
            20,
            lambda p=prog, k=stall_at, s=said: (
                f"{mode} again ({k}, {s!r}): {thread_state(p.pid)}{how_it_ended(p)}"
            ),
        )
        out, err = prog.communicate(b"hello\n", timeout=30)
        assert (prog.returncode, out) == (0, want), (stall_at, out, err.decode()[-2000:])
        if not stalled:  # every injection was tried
            assert stall_at > 2, "the registration made injections on the stub"
            return
    raise AssertionError("more injections than stall points tried: try more")
