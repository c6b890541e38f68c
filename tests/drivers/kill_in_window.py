"""A kprobes user that SIGKILLs itself inside the rescue's own mmap (process/inject/selfrestore.py).

    kill_in_window.py WHERE attach PID SYMBOL
    kill_in_window.py WHERE spawn OUT SYMBOL -- ARGV...
    kill_in_window.py WHERE startup OUT SYMBOL -- ARGV...

WHERE is the moment of the injection the tool dies at:

    before  the thread wears the injection's registers, not yet resumed
    entry   the thread is stopped at the entry of the mmap
    exit    the thread is stopped at its exit, the result not yet taken
    home    its own registers are back, our interrupt asked for, not yet resumed
    none    no death: the probe on SYMBOL is placed and hit, and the tool ends cleanly

``attach`` attaches to PID and registers a kprobe on SYMBOL (the registration makes the
injection). ``spawn`` starts ARGV (its stdout to the file OUT) with kprobes.spawn, which makes
the injection at the exit of execve (the loader's rendezvous is probed there). ``startup``
does too, but keeps the rescue back until libc is mapped (and places no rendezvous probe,
whose int3 would precede the rescue): the injection is made at the exit of the loader's mmap
of libc's code, and SYMBOL (in libc) is placed then. In both the driver is a child subreaper,
so the program, orphaned by the tool's death, is its child again: its status is printed as
``program STATUS`` (exit code, or minus the signal), after ``tool STATUS``.

Lines on stdout: ``injecting SYSCALL_FILE RESTORER_FILE`` when the self-restoring injection
starts (the test's proof that it was used, and whose code it borrowed), ``placed`` once the
probe is registered, ``hits N`` when the tool ends cleanly.

With ``KILL_IN_WINDOW_WITHOUT=MASK`` (hex XSAVE feature bits) in the environment, the tool
sees each thread's XSAVE state as a CPU without those features would give it
(``support.xsave_without``): the frame is laid out for that CPU (0xe0: one without AVX-512).

Nothing here is a knob of kprobes: the hooks replace private functions of selfrestore.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import kprobes
from kprobes.linux import ptrace
from kprobes.process.engine.events import SYSCALL_TRAP
from kprobes.process.following import pending
from kprobes.process.inject import program, selfrestore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import support  # tests/support.py, found through the line above

PR_SET_CHILD_SUBREAPER = 36
PROGRAM_DEADLINE = 30.0  # seconds the orphaned program has to end; killed after


def say(line: str) -> None:
    print(line, flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def mask_xfeatures() -> None:
    """The XSAVE state as a CPU without KILL_IN_WINDOW_WITHOUT's features would give it."""
    mask = int(os.environ.get("KILL_IN_WINDOW_WITHOUT", "0"), 16)
    if not mask:
        return
    image = selfrestore._fpu_image

    def image_without(tid: int) -> bytes:
        return support.xsave_without(image(tid), mask)

    selfrestore._fpu_image = image_without  # type: ignore[assignment]


def install_hooks(where: str) -> None:
    mask_xfeatures()
    run = selfrestore.run_syscall

    def injecting(thread: Any, way: Any, *args: Any) -> int:
        with open(f"/proc/{thread.tracee.pid}/maps") as f:
            maps = [line.split() for line in f]

        def owner(addr: int) -> str:
            for fields in maps:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= addr < end:
                    return os.path.basename(fields[5]) if len(fields) > 5 else "?"
            return "?"

        say(f"injecting {owner(way.syscall_ret)} {owner(way.restorer)}")
        return run(thread, way, *args)

    selfrestore.run_syscall = injecting  # type: ignore[assignment]
    if where == "before":
        resume = selfrestore._syscall_resume

        def resume_or_die(tid: int) -> None:
            die()
            resume(tid)

        selfrestore._syscall_resume = resume_or_die  # type: ignore[assignment]
    elif where in ("entry", "exit"):
        op = (
            ptrace.PTRACE_SYSCALL_INFO_ENTRY
            if where == "entry"
            else ptrace.PTRACE_SYSCALL_INFO_EXIT
        )
        wait = selfrestore._wait

        def wait_or_die(thread: Any) -> int:
            status = wait(thread)
            is_syscall = os.WIFSTOPPED(status) and os.WSTOPSIG(status) == SYSCALL_TRAP
            if is_syscall and ptrace.get_syscall_info(thread.tid).op == op:
                die()
            return status

        selfrestore._wait = wait_or_die  # type: ignore[assignment]
    elif where == "home":
        home = selfrestore._resume_home

        def home_or_die(tid: int) -> None:
            die()
            home(tid)

        selfrestore._resume_home = home_or_die  # type: ignore[assignment]


def hold_rescue_until_libc() -> None:
    """No rescue before libc is mapped, and no rendezvous probe (see above)."""
    ensure = program.ProgramCalls.ensure_rescue

    def ensure_with_libc(self: Any) -> None:
        with open(f"/proc/{self.pid}/maps") as f:
            if "libc.so" in f.read():
                ensure(self)

    def watch_nothing(self: Any) -> None:
        if self._watch is pending._Watch.NONE:
            self._watch = pending._Watch.PLACED  # follow the startup's syscalls

    program.ProgramCalls.ensure_rescue = ensure_with_libc  # type: ignore[method-assign]
    pending.Following.watch_loader = watch_nothing  # type: ignore[method-assign]


def attach(where: str, pid: int, symbol: str) -> int:
    install_hooks(where)
    with kprobes.attach(pid) as proc:
        kp = kprobes.Kprobe(symbol=symbol, pre_handler=lambda p, r: None)
        proc.register_kprobe(kp)
        say("placed")
        proc.run(timeout=0.3)
    say(f"hits {kp.nhit}")
    return 0


def tool(where: str, startup: bool, out: str, symbol: str, argv: list[str]) -> int:
    install_hooks(where)
    if startup:
        hold_rescue_until_libc()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    proc = kprobes.spawn(argv, stdout=fd)
    os.close(fd)
    kp = kprobes.Kprobe(symbol=symbol, pre_handler=lambda p, r: None)
    proc.register_kprobe(kp)
    say("placed")
    proc.run()
    say(f"hits {kp.nhit}")
    return 0


def spawn(where: str, startup: bool, out: str, symbol: str, argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    child = os.fork()
    if child == 0:
        code = 1
        try:
            code = tool(where, startup, out, symbol, argv)
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(child, 0)
    say(f"tool {os.waitstatus_to_exitcode(status)}")
    deadline = time.monotonic() + PROGRAM_DEADLINE
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)  # the program, orphaned by the tool
        except ChildProcessError:
            return 0  # the tool saw it end
        if pid:
            say(f"program {os.waitstatus_to_exitcode(status)}")
            return 0
        time.sleep(0.01)
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as f:
        for pid in map(int, f.read().split()):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    say("program hung")
    return 0


def main() -> int:
    where, mode = sys.argv[1], sys.argv[2]
    if mode == "attach":
        return attach(where, int(sys.argv[3]), sys.argv[4])
    out, symbol = sys.argv[3], sys.argv[4]
    assert sys.argv[5] == "--"
    return spawn(where, mode == "startup", out, symbol, sys.argv[6:])


if __name__ == "__main__":
    sys.exit(main())
