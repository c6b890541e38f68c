"""A process attached to early in its life: in its ``execve``, or inside its dynamic loader.

In the middle of its ``execve``, the kernel reports the exec to us
(``PTRACE_EVENT_EXEC``) after we seized it, and a registration's stop of the world finds
that report first.

That is what ``subprocess.Popen`` then ``attach`` does on a busy machine (Popen returns
once the kernel has closed the child's close-on-exec pipe, inside ``execve``, before the
exec's end), and what ``prog & kprobes count -p $!`` does. Made exact here: the process is
seized while a shell waits to ``exec`` the program, then let go on to its exec stop, and
only then is the probe registered. The new image must be the one probed: the exec handled
first (our books of the old image forgotten), then the probe placed with its rescue, and
every call counted, on the trap tier and the jump.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support
from support import threads_of
from test_survival import blocked_in

import kprobes
from kprobes import errors

Build = Callable[[str], Path]


def stopped_at_exec(pid: int) -> bool:
    """The thread sits in a ptrace-stop ('t'), and the exec is done (its exe is ``stacks``)."""
    with open(f"/proc/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    return state == "t" and Path(f"/proc/{pid}/exe").resolve().name == "stacks"


def same_as_file(pid: int, m: support.Mapping) -> bool:
    """The code of mapping ``m`` is its file's (an anonymous one, ours say, is not)."""
    if not m.path.startswith("/"):
        return m.path in ("[vdso]", "[vsyscall]")
    with open(m.path, "rb") as f:
        f.seek(m.offset)
        want = f.read(m.end - m.start)
    return support.raw_read(pid, m.start, len(want)) == want


def shell_before_its_exec(popen: Any, build: Build) -> subprocess.Popen[bytes]:
    """A shell that waits for a line, then execs ``stacks gated``; returned in its read."""
    stacks = build("stacks")
    shell = popen(
        ["sh", "-c", f'read line && exec "{stacks}" gated'],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    support.wait_until(lambda: blocked_in(shell.pid) == 0, 20, "the shell's read")
    return shell


def to_its_exec_stop(shell: subprocess.Popen[bytes], proc: Any) -> None:
    """The (attached) shell let go on to its exec, whose report the tool has not read."""
    assert shell.stdin is not None
    shell.stdin.write(b"exec\n")
    shell.stdin.flush()
    support.wait_until(
        lambda: stopped_at_exec(shell.pid), 20, lambda: f"the exec stop: {threads_of(proc)}"
    )


@pytest.mark.parametrize("optimize", [False, True], ids=["trap", "jump"])
def test_a_registration_after_an_exec_not_yet_handled(
    attach: Any, popen: Any, build: Build, optimize: bool
) -> None:
    shell = shell_before_its_exec(popen, build)
    assert shell.stdin is not None and shell.stdout is not None
    proc = attach(shell.pid)
    proc.optimization = optimize
    to_its_exec_stop(shell, proc)
    hits: list[int] = []
    probe = kprobes.Kprobe(symbol="leaf", pre_handler=lambda p, regs: hits.append(regs.rdi))
    proc.register_kprobe(probe)
    shell.stdin.write(b"go\n")
    shell.stdin.close()
    assert proc.run(timeout=60), threads_of(proc)
    assert proc.exit_code == 0
    out = shell.stdout.read()
    assert out.startswith(b"stacks "), out
    assert hits == [1, 2, 3, 0, 2, 4, 6, 8, 1, 2], hits  # a(0..2), b(0..4), stk_through(0..1)
    assert probe.nhit == 10


def test_a_detach_after_an_exec_not_yet_handled(attach: Any, popen: Any, build: Build) -> None:
    """Probes of the shell's image, then its exec, then the detach: nothing of the old image
    is written into the new one (libc's ``abort`` was probed in the shell: at the exec stop
    the new image has no libc yet), and the program runs on to its end, its output whole."""
    shell = shell_before_its_exec(popen, build)
    assert shell.stdin is not None and shell.stdout is not None
    proc = attach(shell.pid, pending=True)
    proc.register_kprobe(kprobes.Kprobe(symbol="libc:abort"))
    to_its_exec_stop(shell, proc)
    proc.detach()
    changed = [
        m.path for m in support.maps(shell.pid) if "x" in m.perms and not same_as_file(shell.pid, m)
    ]
    assert changed == [], changed
    out, _ = shell.communicate(b"go\n", timeout=30)
    assert shell.returncode == 0 and out.startswith(b"stacks "), (shell.returncode, out)


MARKER_LEN = len("ifunc marker!")


def held_in_its_loader(popen: Any, build: Build, calls: int) -> subprocess.Popen[bytes]:
    """``ifunc`` held by an audit library where its loader has mapped libc, before it
    relocated it."""
    env = dict(os.environ, LD_AUDIT=str(build("libaudit_gate.so")))
    prog = popen(
        [build("ifunc"), calls],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert prog.stderr is not None
    assert support.read_line(prog.stderr.fileno(), timeout=20) == b"libc mapped\n"
    return prog


def test_an_ifunc_is_refused_while_the_loader_has_not_relocated_libc(
    attach: Any, popen: Any, build: Build
) -> None:
    """libc's ``strlen`` is an ifunc: placing it runs its resolver in the program, which
    faulted in a libc not relocated yet ("injected code faulted ... signal 11"). Now the
    registration says why it cannot be placed yet, and the program runs on unharmed."""
    prog = held_in_its_loader(popen, build, 100)
    proc = attach(prog.pid)
    with pytest.raises(errors.NotMapped) as info:
        proc.register_kprobe(kprobes.Kprobe(symbol="libc:strlen"))
    assert "GNU ifunc" in str(info.value) and "relocated libc" in str(info.value), info.value
    proc.detach()
    out, err = prog.communicate(b"go\n", timeout=30)
    assert prog.returncode == 0 and out.endswith(f"total={100 * MARKER_LEN}\n".encode()), err


def test_a_pending_ifunc_is_placed_once_the_loader_has_relocated_libc(
    attach: Any, popen: Any, build: Build
) -> None:
    """With ``pending``, the same probe waits for the loader's rendezvous and then counts
    every call the program makes through the implementation the resolver picked."""
    calls = 300
    prog = held_in_its_loader(popen, build, calls)
    proc = attach(prog.pid, pending=True)
    seen: list[int] = []
    proc.register_kprobe(
        kprobes.Kprobe(symbol="libc:strlen", pre_handler=lambda p, regs: seen.append(regs.rdi))
    )
    assert prog.stdin is not None and prog.stdout is not None
    prog.stdin.write(b"go\n")
    prog.stdin.close()
    assert proc.run(timeout=60), threads_of(proc)
    out = prog.stdout.read().decode()
    assert proc.exit_code == 0 and out.endswith(f"total={calls * MARKER_LEN}\n"), out
    marker = int(out.split("marker=")[1].split()[0], 16)
    assert seen.count(marker) == calls, (len(seen), seen[:5])
