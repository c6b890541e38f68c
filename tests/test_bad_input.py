"""Bad input: a program that leaves, one that someone else traces, threads that come and go.

Each case must end in one clear line (a ``kprobes.errors.ProbeError`` that says what happened,
never an ``InternalError``, never a raw ``OSError``), and the program must be left as it was:
its code the file's, no thread traced, and it finishes normally with its unprobed output.

    (a) a pid that exits between attach and registration (tests/programs/shy.c leaves as soon
        as it is traced), or in the middle of registrations;
    (b) a program already traced: one of its threads by strace, all of it by gdb or by
        another kprobes in another process;
    (c) threads that exit (and are created) while the world is stopped
        (tests/programs/churn.c creates and joins threads in a loop).

The command line is checked for (a) and (b) with ``kprobes count -p PID hot -d 1``: one line
on stderr, a non-zero exit status.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes.errors import InternalError, ProbeError, TargetError

pytestmark = pytest.mark.ptrace

WALL = 0x40000000  # __WALL: wait for threads too
REPO = Path(__file__).resolve().parent.parent
KPROBES = REPO / ".venv" / "bin" / "kprobes"
PYTHON = REPO / ".venv" / "bin" / "python"


class Program:
    """A test program started with its stdout and stderr in files; ``ready`` is the text its
    stderr shows once it runs (time to attach)."""

    def __init__(self, argv: list[Any], where: Path, ready: bytes) -> None:
        self.out = where / "stdout"
        self.err = where / "stderr"
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.popen = subprocess.Popen([str(a) for a in argv], stdout=o, stderr=e)
        support.wait_until(
            lambda: ready in self.err.read_bytes() or self.popen.poll() is not None,
            10,
            f"{argv[0]} ready",
        )
        self.check_alive()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def report(self) -> str:
        return f"\n--- the program's stderr ---\n{self.err.read_text(errors='replace')}"

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise AssertionError(f"the program ended (status {code})" + self.report())

    def finish(self, sig: int = signal.SIGUSR1, timeout: float = 20) -> bytes:
        """End it with ``sig`` (its handler ends it normally); its stdout, once it exited 0."""
        self.check_alive()
        os.kill(self.pid, sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 20) -> bytes:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            states = {t: support.tracer_of(self.pid, t) for t in support.thread_ids(self.pid)}
            self.popen.kill()
            raise AssertionError(
                f"the program did not end (its threads' tracers: {states})" + self.report()
            ) from None
        assert code == 0, f"exit status {code}" + self.report()
        return self.out.read_bytes()

    def kill(self) -> None:
        """SIGKILL; a thread that a failed test left traced by us dies as a zombie only its
        tracer (this process) can reap, before the program itself can be reaped."""
        if self.popen.poll() is not None:
            return
        self.popen.kill()
        deadline = time.monotonic() + 10
        while self.popen.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                for tid in support.thread_ids(self.pid) - {self.pid}:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(tid, os.WNOHANG | WALL)
            time.sleep(0.01)


@pytest.fixture
def program(tmp_path: Path) -> Iterator[Callable[..., Program]]:
    started: list[Program] = []

    def start(argv: list[Any], ready: bytes = b"ready") -> Program:
        where = tmp_path / f"p{len(started)}"
        where.mkdir()
        p = Program(argv, where, ready)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def reference(argv: list[Any], program: Callable[..., Program]) -> bytes:
    """stdout of an unprobed run of a ``-1`` (until SIGUSR1) program."""
    return program(argv).finish()


def one_line(exc: BaseException) -> str:
    """The error as the command line would print it: one line, not an InternalError."""
    assert isinstance(exc, ProbeError), f"{type(exc).__name__}: {exc}"
    assert not isinstance(exc, InternalError), f"InternalError: {exc}"
    text = str(exc)
    assert text and "\n" not in text, repr(text)
    return text


def run_cli(*args: Any, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """A command that failed as a user should see it: status 1, one line on stderr."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kprobes: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def busy(build: Callable[[str], Path]) -> Path:
    return build("busy")


@pytest.fixture
def shy(build: Callable[[str], Path]) -> Path:
    return build("shy")


@pytest.fixture
def churn(build: Callable[[str], Path]) -> Path:
    return build("churn")


# ---------------------------------------------------------------------------------------------
# (a) a pid that exits between attach and registration


def is_gone(pid: int) -> bool:
    return not support.is_alive(pid)


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_pid_that_exits_between_attach_and_registration(program, shy):
    prog = program([shy])
    with kprobes.attach(prog.pid) as proc:
        support.wait_until(lambda: is_gone(prog.pid), 10, "shy to leave once traced")
        attempts: list[Callable[[], None]] = [
            lambda: proc.register_kprobe(kprobes.Kprobe(symbol="hot")),
            lambda: proc.register_kprobes([kprobes.Kprobe(symbol="hot")]),
            lambda: proc.register_kretprobe(kprobes.Kretprobe(symbol="hot", handler=print)),
        ]
        for attempt in attempts:
            with pytest.raises(TargetError) as caught:
                attempt()
            assert one_line(caught.value) == f"process {prog.pid} has exited (exit status 0)"
        assert proc.run(timeout=10)
        assert proc.exit_code == 0
    assert prog.wait() == b"shy: left\n"


def test_pid_that_exits_in_the_middle_of_registrations(program, busy):
    """The program ends by itself while probes are registered one after another (on a
    function it never calls, so that it runs on freely): whichever step of a registration
    notices, the error says that the process exited."""
    calls = 3_000_000  # about half a second of work for 4 threads
    expected = support.reference_output([busy, 4, calls, 3])
    prog = program([busy, 4, calls, 3])
    registered = 0
    with kprobes.attach(prog.pid) as proc:
        ret = kprobes.Kretprobe(symbol="fail", handler=print)
        proc.register_kretprobe(ret)
        deadline = time.monotonic() + 30
        with pytest.raises(ProbeError) as caught:
            while time.monotonic() < deadline:
                proc.register_kprobe(kprobes.Kprobe(symbol="fail", post_handler=print))
                registered += 1
        text = one_line(caught.value)
        assert isinstance(caught.value, TargetError), text
        assert text.startswith(f"process {prog.pid} has exited"), text
        assert proc.run(timeout=10)
        assert proc.exit_code == 0
    assert registered > 0
    assert prog.wait() == expected


def test_cli_pid_that_exits_between_attach_and_registration(program, shy, tmp_path):
    """``kprobes count -p PID`` whose program leaves after the attach and before the probes
    are placed. To be sure of the order, the command runs with ``attach`` (of
    kprobes/process/launch.py, which the command line imports when it runs) made to wait
    until the program is gone."""
    prog = program([shy])
    wrapper = tmp_path / "late_kprobes.py"
    wrapper.write_text(
        textwrap.dedent(
            """\
            import sys, time
            import kprobes.cli.main as cli
            import kprobes.process.launch as launch

            attach_now = launch.attach

            def attach_then_wait(pid, **kwargs):
                proc = attach_now(pid, **kwargs)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                            break
                    time.sleep(0.005)
                return proc

            launch.attach = attach_then_wait
            sys.exit(cli.main(sys.argv[1:]))
            """
        )
    )
    result = run_cli(PYTHON, wrapper, "count", "-p", prog.pid, "hot", "-d", 1)
    line = assert_one_error_line(result)
    assert line == f"kprobes: process {prog.pid} has exited (exit status 0)"
    assert prog.wait() == b"shy: left\n"


def test_cli_on_a_pid_that_leaves_when_traced(program, shy):
    """The real command on shy: whichever comes first, the program's exit or the placing of
    the probe, the command ends by itself, either normally (the program ended the run) or
    with one line; never a traceback."""
    for _ in range(3):
        prog = program([shy])
        result = run_cli(KPROBES, "count", "-p", prog.pid, "hot", "-d", 1)
        if result.returncode == 0:  # placed in time: the program's exit ended the count
            assert result.stdout.startswith("FUNC"), result.stdout
            assert "Traceback" not in result.stderr, result.stderr
        else:
            line = assert_one_error_line(result)
            assert line == f"kprobes: process {prog.pid} has exited (exit status 0)"
        assert prog.wait() == b"shy: left\n"


def test_attach_refuses_what_cannot_be_traced(program, busy):
    """A zombie, a kernel thread, a thread id, a pid that does not exist: one line each."""
    zombie = subprocess.Popen([str(busy), "1", "0", "0"], stdout=subprocess.DEVNULL)
    try:
        support.wait_until(lambda: is_gone(zombie.pid), 10, "busy 1 0 0 to exit")
        with pytest.raises(TargetError) as caught:
            kprobes.attach(zombie.pid)
        assert "has exited" in one_line(caught.value)
    finally:
        zombie.wait(timeout=10)
    with pytest.raises(TargetError) as caught:
        kprobes.attach(2)  # kthreadd
    assert "kernel thread" in one_line(caught.value)
    prog = program([busy, 2, -1, 2])
    worker = max(support.thread_ids(prog.pid))
    with pytest.raises(TargetError) as caught:
        kprobes.attach(worker)
    assert one_line(caught.value).startswith(f"{worker} is a thread of process {prog.pid}")
    support.assert_untouched(prog.pid, busy)
    with pytest.raises(TargetError) as caught:
        kprobes.attach(4_000_000)
    assert one_line(caught.value) == "no process 4000000"
    prog.finish()


# ---------------------------------------------------------------------------------------------
# (b) a program that is itself being traced


class Tracer:
    """A tracer of another kind, started by the test; ``leave()`` makes it detach."""

    def __init__(self, argv: list[Any], attached: bytes, stream: str = "stderr") -> None:
        self.popen = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out = self.popen.stderr if stream == "stderr" else self.popen.stdout
        assert out is not None
        seen = b""
        deadline = time.monotonic() + 30
        while attached not in seen:
            assert time.monotonic() < deadline, f"{argv[0]} did not attach: {seen!r}"
            seen += support.read_line(out.fileno(), timeout=30)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def leave(self) -> None:
        """Make it detach and end: strace on SIGTERM, gdb and a kprobes child at the end of
        their stdin."""
        if self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
            if Path(str(self.popen.args[0])).name == "strace":
                self.popen.terminate()
            self.popen.wait(timeout=20)


@pytest.fixture
def tracers() -> Iterator[Callable[..., Tracer]]:
    started: list[Tracer] = []

    def start(argv: list[Any], attached: bytes, stream: str = "stderr") -> Tracer:
        t = Tracer(argv, attached, stream)
        started.append(t)
        return t

    yield start
    for t in started:
        if t.popen.poll() is None:
            t.popen.kill()
            t.popen.wait(timeout=10)


needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb")


def strace(tracers: Callable[..., Tracer], tid: int) -> Tracer:
    return tracers(["strace", "-o", "/dev/null", "-p", tid], f"Process {tid} attached".encode())


@needs_strace
def test_a_thread_traced_by_strace(program, tracers, busy):
    """strace traces one worker thread only: attach seizes the others first, then finds that
    one taken. It must say by whom, and let go of the threads it had seized (a thread left
    seized stops at its next signal and waits for us forever)."""
    expected = reference([busy, 4, -1, 3], program)
    prog = program([busy, 4, -1, 3])
    worker = max(support.thread_ids(prog.pid))
    tracer = strace(tracers, worker)
    with pytest.raises(TargetError) as caught:
        kprobes.attach(prog.pid)
    text = one_line(caught.value)
    assert f"already traced by process {tracer.pid} (strace)" in text, text
    assert f"thread {worker}" in text, text
    others = {t: support.tracer_of(prog.pid, t) for t in support.thread_ids(prog.pid)}
    assert others == {t: (tracer.pid if t == worker else 0) for t in others}, others
    tracer.leave()
    support.assert_untouched(prog.pid, busy)
    assert prog.finish() == expected


def gdb_holding(pid: int) -> list[object]:
    """GDB attached to ``pid``, saying so, then holding it until its stdin gives a line."""
    return [
        "gdb",
        "-nx",
        "-q",
        "-batch",
        "-p",
        pid,
        "-ex",
        "echo kprobes-test: attached\\n",
        "-ex",
        "shell read line",
    ]


@needs_gdb
def test_a_program_in_gdb(program, tracers, busy):
    expected = reference([busy, 4, -1, 3], program)
    prog = program([busy, 4, -1, 3])
    gdb = tracers(
        gdb_holding(prog.pid),
        b"kprobes-test: attached",
        stream="stdout",
    )
    with pytest.raises(TargetError) as caught:
        kprobes.attach(prog.pid)
    text = one_line(caught.value)
    assert text.startswith(f"process {prog.pid} is already traced by process {gdb.pid} (gdb)")
    gdb.leave()
    support.assert_untouched(prog.pid, busy)
    assert prog.finish() == expected


def test_a_program_probed_by_another_kprobes(program, tracers, busy):
    expected = reference([busy, 4, -1, 3], program)
    prog = program([busy, 4, -1, 3])
    holder = tracers(
        [
            PYTHON,
            "-c",
            "import sys, kprobes\n"
            "with kprobes.attach(int(sys.argv[1])):\n"
            "    print('attached', flush=True)\n"
            "    sys.stdin.read()\n",
            prog.pid,
        ],
        b"attached",
        stream="stdout",
    )
    with pytest.raises(TargetError) as caught:
        kprobes.attach(prog.pid)
    text = one_line(caught.value)
    assert text.startswith(f"process {prog.pid} is already traced by process {holder.pid} ")
    holder.leave()
    assert holder.popen.returncode == 0
    support.assert_untouched(prog.pid, busy)
    assert prog.finish() == expected


@needs_strace
@needs_gdb
def test_cli_on_a_traced_program(program, tracers, busy):
    """``kprobes count -p PID`` on a program that strace (all of it) or gdb traces."""
    expected = reference([busy, 4, -1, 3], program)
    prog = program([busy, 4, -1, 3])
    for who in ("strace", "gdb"):
        if who == "strace":
            tracer = tracers(
                ["strace", "-f", "-o", "/dev/null", "-p", prog.pid],
                f"Process {prog.pid} attached".encode(),
            )
        else:
            tracer = tracers(
                gdb_holding(prog.pid),
                b"kprobes-test: attached",
                stream="stdout",
            )
        result = run_cli(KPROBES, "count", "-p", prog.pid, "hot", "-d", 1)
        line = assert_one_error_line(result)
        assert f"already traced by process {tracer.pid} ({who})" in line, line
        tracer.leave()
        support.assert_untouched(prog.pid, busy)
    assert prog.finish() == expected


# ---------------------------------------------------------------------------------------------
# (c) threads that exit during a stop of the world


def test_registration_while_threads_come_and_go(program, churn):
    """A kprobe and a kretprobe registered and unregistered again and again while the
    program creates and joins 8 threads in a loop (each calls hot a few times): threads
    exit and are born while the world is stopped. Every registration succeeds, and after
    detach the program finishes normally with nothing of ours left."""
    argv = [churn, -1, 8, 50]
    expected = reference(argv, program)
    prog = program(argv)
    cycles = 0
    with kprobes.attach(prog.pid) as proc:
        started = time.monotonic()
        while cycles < 10 or time.monotonic() - started < 5:  # at least 10, however slow
            kp = kprobes.Kprobe(symbol="hot", post_handler=lambda *_: None)
            rp = kprobes.Kretprobe(symbol="hot", handler=lambda *_: None)
            try:
                proc.register_kprobe(kp)
                proc.register_kretprobe(rp)
                proc.run(timeout=0.005)
                proc.unregister_kprobe(kp)
                proc.unregister_kretprobe(rp)
                proc.run(timeout=0.005)
            except ProbeError as exc:
                raise AssertionError(
                    f"cycle {cycles}: {type(exc).__name__}: {exc}" + prog.report()
                ) from exc
            cycles += 1
    support.assert_untouched(prog.pid, churn)
    assert prog.finish() == expected


def test_attach_and_detach_while_threads_come_and_go(program, churn):
    """Attach, run a moment, detach, again and again while threads are born and exit."""
    argv = [churn, -1, 8, 0]
    expected = reference(argv, program)
    prog = program(argv)
    cycles = 0
    while cycles < 60:
        hung = threading.Event()

        def end_the_hang(hung: threading.Event = hung) -> None:
            hung.set()  # a detach takes milliseconds: it has nothing to wait for
            prog.popen.kill()

        watchdog = threading.Timer(5.0, end_the_hang)
        watchdog.start()
        try:
            with kprobes.attach(prog.pid) as proc:
                proc.run(timeout=0.002)
        except ProbeError as exc:
            raise AssertionError(f"cycle {cycles}: {type(exc).__name__}: {exc}") from exc
        finally:
            watchdog.cancel()
        assert not hung.is_set(), f"cycle {cycles}: detach hung (the program was killed)"
        cycles += 1
        prog.check_alive()
    support.assert_untouched(prog.pid, churn)
    assert prog.finish() == expected


# ---------------------------------------------------------------------------------------------
# a stopped program


def test_a_stopped_program(program, busy):
    """A program stopped by SIGSTOP: a probe is registered (or one line says why not), and
    after detach and SIGCONT it carries on normally."""
    expected = reference([busy, 2, -1, 2], program)
    prog = program([busy, 2, -1, 2])
    os.kill(prog.pid, signal.SIGSTOP)
    support.wait_until(lambda: state_of(prog.pid) == "T", 10, "group stop")
    try:
        with kprobes.attach(prog.pid) as proc:
            try:
                proc.register_kprobe(kprobes.Kprobe(symbol="hot"))
            except ProbeError as exc:
                one_line(exc)
        support.assert_untouched(prog.pid, busy)
    finally:
        os.kill(prog.pid, signal.SIGCONT)
    assert prog.finish() == expected
