"""The program survives a SIGKILL of the tool inside the rescue's own mmap (selfrestore.py).

The tool (tests/drivers/kill_in_window.py) SIGKILLs itself at each moment of that injection:
before the thread is resumed into it, at the syscall's entry, at its exit, and with the
thread's own registers back but the thread not yet let go. The program must go on as if
nothing had happened: busy.c with its unprobed output and status 0, window.c with every
register, its vector and FPU state, its signal mask and alternate stack as they were.
Attached (libc mapped), spawned (stopped at the exit of execve: only the loader is mapped)
and during the loader's startup (the exit of its mmap of libc's code).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import support

import kprobes
from kprobes.arch.x86_64 import sigframe
from kprobes.arch.x86_64.regs import REG_INDEX, REGS_SIZE
from kprobes.linux import ptrace

pytestmark = pytest.mark.ptrace

DRIVER = Path(__file__).resolve().parent / "drivers" / "kill_in_window.py"
REPO = DRIVER.parent.parent.parent
MOMENTS = ["before", "entry", "exit", "home"]
AREA = 0x400000  # the rescue's mapping (arch/x86_64/rescue.py AREA_SIZE)


def driver(popen, *args, without: int = 0):
    """The driver; ``without``: XSAVE features its tool must see the CPU as lacking."""
    env = dict(os.environ, PYTHONPATH=str(REPO), KILL_IN_WINDOW_WITHOUT=f"{without:x}")
    return popen(
        [sys.executable, DRIVER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def finish(tool) -> tuple[list[str], int]:
    """The driver's lines and status (dead of our SIGKILL, or ended by itself). A few seconds
    on an idle 2-vCPU guest; more than 60 at a load average of 32 with make test-loaded."""
    out, err = tool.communicate(timeout=200)
    assert tool.returncode in (0, -signal.SIGKILL), err.decode()[-2000:]
    return out.decode().splitlines(), tool.returncode


def anonymous_code(pid: int) -> list[int]:
    """Sizes of the program's anonymous executable mappings (the rescue's is 4 MiB)."""
    sizes = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if "x" in fields[1] and len(fields) == 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                sizes.append(end - start)
    return sizes


def caught(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    return 0


def traced_stop(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        return "State:\tt (tracing stop)\n" in f.read()


def wait_untraced(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            if "TracerPid:\t0\n" in f.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} is still traced")


def start(popen, build, *argv) -> subprocess.Popen[bytes]:
    prog = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert prog.stderr is not None
    line = support.read_line(prog.stderr.fileno(), timeout=20)
    assert line.endswith(b"ready\n"), line
    return prog


def end(prog: subprocess.Popen[bytes]) -> bytes:
    assert prog.poll() is None, f"the program died: status {prog.returncode}"
    os.kill(prog.pid, signal.SIGUSR1)
    out, err = prog.communicate(timeout=30)
    assert prog.returncode == 0, (prog.returncode, err.decode()[-2000:])
    return out


def killed_attached(popen, prog, where: str, symbol: str, without: int = 0) -> None:
    """The driver attaches, registers a probe on ``symbol`` and dies at ``where``."""
    before = anonymous_code(prog.pid)
    lines, code = finish(driver(popen, where, "attach", prog.pid, symbol, without=without))
    assert lines[:1] == ["injecting libc.so.6 libc.so.6"], lines
    if where == "none":
        assert code == 0 and lines[1] == "placed", lines
        return
    assert code == -signal.SIGKILL, lines
    wait_untraced(prog.pid)
    time.sleep(0.2)  # the thread goes home, the program runs on alone
    after = anonymous_code(prog.pid)
    assert after.count(AREA) == before.count(AREA) + 1  # the mmap ran, and only it
    assert not caught(prog.pid) & (1 << (signal.SIGTRAP - 1))  # no rescue handler yet


@pytest.mark.parametrize("where", [*MOMENTS, "none"])
@pytest.mark.parametrize("mode", ["spin", "sleep"])
def test_every_register_comes_home(popen, build, mode, where):
    """window.c, in registers (spin) or in nanosleep (sleep): vector, FPU and general
    registers, signal mask and alternate stack as they were, and nanosleep restarted or
    EINTR, never anything else."""
    prog = start(popen, build, build("window"), mode)
    killed_attached(popen, prog, where, "window_round")
    assert end(prog) == b"window: every register kept\n"


@pytest.mark.parametrize("where", [*MOMENTS, "none"])
def test_every_register_comes_home_without_avx512(popen, build, where):
    """As on a CPU without AVX-512, whatever this one has: the program uses AVX at most, and
    the tool sees each thread's XSAVE state with AVX-512 masked out (XCR0 and XSTATE_BV: the
    frame's features and size are those of such a CPU). On a CPU without AVX-512 the mask
    changes nothing, and this is test_every_register_comes_home again."""
    prog = start(popen, build, build("window"), "spin", "avx")
    killed_attached(popen, prog, where, "window_round", without=support.XFEATURES_AVX512)
    assert end(prog) == b"window: every register kept\n"


@pytest.mark.skipif(
    "avx512f" not in support.cpu_flags(), reason="shows the mask's effect on AVX-512 state"
)
def test_the_mask_reaches_the_frame(popen, build):
    """The counterpart on a CPU with AVX-512: the program uses it, the frame says it has none,
    and rt_sigreturn resets the AVX-512 state (the kernel puts features absent from a frame in
    their initial state), which the program sees: the masked frame is the one that was used."""
    prog = start(popen, build, build("window"), "spin")
    killed_attached(popen, prog, "exit", "window_round", without=support.XFEATURES_AVX512)
    os.kill(prog.pid, signal.SIGUSR1)
    out, err = prog.communicate(timeout=30)
    assert prog.returncode == 1 and out == b"", err.decode()[-2000:]
    assert b"changed" in err and b"at level 2" in err, err.decode()[-2000:]


def busy_reference(build, *args) -> bytes:
    argv = [str(a) for a in (build("busy"), *args)]
    out = subprocess.run(argv, capture_output=True, timeout=60, check=True)
    return out.stdout


@pytest.mark.parametrize("where", [*MOMENTS, "none"])
def test_a_busy_program_attached(popen, build, where):
    prog = start(popen, build, build("busy"), 4, -1, 5)
    killed_attached(popen, prog, where, "rec")
    want = "".join(f"thread {t}: rec(5) = 15, every call checked\n" for t in range(4))
    assert end(prog) == (want + "total: 4 threads stopped\n").encode()


@pytest.mark.parametrize("where", [*MOMENTS, "none"])
def test_a_busy_program_spawned(popen, build, tmp_path, where):
    """Killed inside kprobes.spawn: the injection is made at the exit of execve, with the
    loader's code alone (no libc yet)."""
    args = (2, 3000, 5)
    out = tmp_path / "out"
    lines, code = finish(driver(popen, where, "spawn", out, "rec", "--", build("busy"), *args))
    assert code == 0, lines
    injecting = lines[0].split()
    assert injecting[0] == "injecting" and all(name.startswith("ld-") for name in injecting[1:])
    if where == "none":
        assert lines[1:] == ["placed", "hits 36000", "tool 0"], lines
    else:
        assert lines[1:] == ["tool -9", "program 0"], lines
    assert out.read_bytes() == busy_reference(build, *args)


@pytest.mark.parametrize("where", ["exit", "home", "none"])
def test_a_program_in_its_loader_startup(popen, build, tmp_path, where):
    """The first injection at the exit of the loader's mmap of libc's code (libc mapped, not
    yet relocated): the thread comes home with that mmap's own result."""
    args = (2, 3000, 5)
    out = tmp_path / "out"
    argv = ["--", build("busy"), *args]
    lines, code = finish(driver(popen, where, "startup", out, "libc:write", *argv))
    assert code == 0, lines
    assert lines[:2] == ["placed", "injecting libc.so.6 libc.so.6"], lines
    if where == "none":
        assert lines[2:] == ["hits 2", "tool 0"], lines  # busy's two writes
    else:
        assert lines[2:] == ["tool -9", "program 0"], lines
    assert out.read_bytes() == busy_reference(build, *args)


def test_our_frame_is_the_kernels(popen, build):
    """A frame of ours and one the kernel built in the same thread: the same place below the
    same stack pointer, the same flags, the same FPU software bytes and end magic."""
    prog = start(popen, build, build("window"), "frame")
    pid = prog.pid
    ptrace.seize(pid, 0)
    try:
        ptrace.interrupt(pid)
        ptrace.waitpid(pid, 0)
        image = ptrace.getregset(pid, ptrace.NT_X86_XSTATE, 0x10000)
    finally:
        ptrace.detach(pid)
    os.kill(pid, signal.SIGUSR2)
    out, _ = prog.communicate(timeout=30)
    word, rsp, frame_at, fp_at, uc_flags, sw, magic2 = out.decode().split()
    assert word == "frame"
    fpu = sigframe.fpstate(image)
    regs = bytearray(REGS_SIZE)
    struct.pack_into("<Q", regs, 8 * REG_INDEX["rsp"], int(rsp, 16))
    ours = sigframe.build(bytes(regs), 0, fpu, restorer=0)
    assert (ours.address, ours.fpstate) == (int(frame_at, 16), int(fp_at, 16))
    assert int.from_bytes(ours.data[sigframe.UC : sigframe.UC + 8], "little") == int(uc_flags, 16)
    assert fpu[sigframe.SW_BYTES : sigframe.SW_BYTES + 48].hex() == sw
    assert int(magic2, 16) == sigframe.FP_XSTATE_MAGIC2


def test_without_a_way_home_the_mapping_is_made_as_before(popen, build, monkeypatch):
    """No restorer in the program's code: the borrowed-syscall injection, rescue and all (the
    clean end's last injections go home on the rescue's own code: selfrestore.py)."""
    from kprobes.process.inject import selfrestore

    monkeypatch.setattr(sigframe, "find_restorer", lambda code, base: None)
    used = []
    real = selfrestore.run_syscall

    def spy(thread, way, nr, *args):
        if not way.restarter:  # a way home of the program's own code
            used.append(nr)
        return real(thread, way, nr, *args)

    monkeypatch.setattr(selfrestore, "run_syscall", spy)
    prog = start(popen, build, build("busy"), 2, -1, 5)
    with kprobes.attach(prog.pid) as proc:
        kp = kprobes.Kprobe(symbol="rec", pre_handler=lambda p, r: None)
        proc.register_kprobe(kp)
        assert proc._tracer.rescue.is_installed
        proc.run(timeout=0.2)
    assert kp.nhit > 0 and not used
    end(prog)


def test_a_thread_lent_while_its_signal_came(popen, build, monkeypatch):
    """The only thread is held in the delivery of a signal of its own when the first probe
    is registered: it is lent for the mmap, gets the signal again at the end, stops on its
    delivery with its own siginfo, and the program's handler runs once."""
    from kprobes.process.inject import selfrestore

    lent = []
    delivered = selfrestore._delivered_signal
    monkeypatch.setattr(
        selfrestore, "_delivered_signal", lambda t: lent.append(delivered(t)) or lent[-1]
    )
    prog = start(popen, build, build("busy"), 1, -1, 5)
    with kprobes.attach(prog.pid) as proc:
        assert not traced_stop(prog.pid)
        os.kill(prog.pid, signal.SIGUSR2)
        # The thread stops in its delivery (a tracing stop), not yet reported to the tool.
        support.wait_until(lambda: traced_stop(prog.pid), 30, "the signal-delivery stop")
        usr2 = kprobes.Kprobe(symbol="on_usr2")
        proc.register_kprobe(usr2)
        assert lent == [signal.SIGUSR2]
        deadline = time.monotonic() + 30
        while usr2.nhit == 0 and time.monotonic() < deadline:
            proc.run(timeout=0.05)
        assert usr2.nhit == 1
    want = "thread 0: rec(5) = 15, every call checked\ntotal: 1 threads stopped\n"
    assert end(prog) == want.encode()
