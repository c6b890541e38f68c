"""Starting and seizing a program: ``spawn`` and ``attach``, and what each refuses and why.

``spawn`` starts the program stopped at its entry point, after the dynamic loader has mapped
its libraries, so that ``libc:malloc`` can be probed before ``main`` runs. ``attach`` seizes
every thread of a running program and leaves it running; each way it can fail is one
``TargetError`` that says what happened, and leaves the program as it was.
"""

from __future__ import annotations

import errno
import os
import pwd
import signal
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import IO, Any

from kprobes.errors import TargetError
from kprobes.linux import procfs, ptrace
from kprobes.linux.childstart import restore_signals
from kprobes.process.engine.events import SYSCALL_TRAP
from kprobes.process.engine.threads import ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind
from kprobes.process.engine.tracer import Tracer
from kprobes.process.survival import cleanup
from kprobes.process.target import Process

OPTIONS = (
    ptrace.PTRACE_O_TRACECLONE
    | ptrace.PTRACE_O_TRACEFORK
    | ptrace.PTRACE_O_TRACEVFORK
    | ptrace.PTRACE_O_TRACEVFORKDONE  # the parent back from a vfork: records name it again
    | ptrace.PTRACE_O_TRACEEXEC
    | ptrace.PTRACE_O_TRACESYSGOOD  # syscall stops (the loader's startup) say they are
)
_PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread
_RELEASE_TIMEOUT = 2.0  # a failed attach waits this long for each seized thread to stop

StdStream = int | IO[Any] | None


def _fd_of(stream: StdStream) -> int | None:
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def spawn(
    argv: Sequence[str],
    *,
    stdin: StdStream = None,
    stdout: StdStream = None,
    stderr: StdStream = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    follow_forks: bool = False,
    pending: bool = True,
    pin_hot_threads: bool = True,
) -> Process:
    """Start ``argv`` traced, stopped before its first instruction (at the exit of execve).

    Its executable and dynamic loader are mapped, its libraries are not yet: a probe on a
    library is pending (``pending=True``) and is placed the moment the loader maps it,
    before any of its code runs (pending.py). ``pin_hot_threads``: see
    ``Process.pin_hot_threads`` (cpus.py).
    """
    if not argv:
        raise TargetError("nothing to run: empty argv", errno=errno.EINVAL)
    fds = (_fd_of(stdin), _fd_of(stdout), _fd_of(stderr))
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the child: stop, let the parent seize us, then exec
        try:
            restore_signals()  # as the command would start without us (childstart.py)
            os.close(err_r)
            for target_fd, fd in enumerate(fds):
                if fd is not None and fd != target_fd:
                    os.dup2(fd, target_fd)
            if cwd is not None:
                os.chdir(cwd)
            os.kill(os.getpid(), signal.SIGSTOP)
            if env is None:
                os.execvp(argv[0], list(argv))
            else:
                os.execvpe(argv[0], list(argv), env)
        except BaseException as exc:
            code = getattr(exc, "errno", None) or errno.ENOEXEC
            os.write(err_w, f"{code}:{exc}".encode(errors="replace"))
        finally:
            os._exit(127)
    os.close(err_w)
    try:
        proc = _seize_spawned(pid, argv, err_r, follow_forks, pending)
        proc.pin_hot_threads = pin_hot_threads
    finally:
        os.close(err_r)
    return proc


def _seize_spawned(
    pid: int, argv: Sequence[str], err_r: int, follow_forks: bool, pending: bool
) -> Process:
    _, status = os.waitpid(pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        raise _spawn_failure(argv, err_r)
    ptrace.seize(pid, OPTIONS)
    os.kill(pid, signal.SIGCONT)
    # Step 1: let it exec (group-stop and SIGCONT reports come first).
    while True:
        _, status = ptrace.waitpid(pid, 0)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            raise _spawn_failure(argv, err_r)
        event = (status >> 16) & 0xFF
        if event == ptrace.PTRACE_EVENT_EXEC:
            break
        sig = os.WSTOPSIG(status)
        if event == 0 and sig not in (signal.SIGCONT, signal.SIGSTOP):
            ptrace.cont(pid, sig)
        else:
            ptrace.cont(pid, 0)
    # Step 2: to the exit of execve: the new image is in place, none of it has run.
    ptrace.syscall_cont(pid, 0)
    while True:
        _, status = ptrace.waitpid(pid, 0)
        if not os.WIFSTOPPED(status):
            raise TargetError(f"{argv[0]} ended at its exec (status {status:#x})")
        sig = os.WSTOPSIG(status)
        if sig == SYSCALL_TRAP:
            break
        # A signal sent meanwhile: the new image gets it, as it would without us.
        ptrace.syscall_cont(pid, sig if status >> 16 == 0 else 0)
    proc = Process(pid, follow_forks=follow_forks, pending=pending)
    # Step 3: the new image's probes, and the loader's startup followed (pending.py); every
    # thread held until the first run().
    proc._land_at_exec(pid, hold=True)
    cleanup.remember(proc)
    return proc


def _spawn_failure(argv: Sequence[str], err_r: int) -> TargetError:
    report = os.read(err_r, 4096).decode(errors="replace")
    code_text, _, message = report.partition(":")
    code = int(code_text) if code_text.isdigit() else errno.ENOEXEC
    return TargetError(f"cannot run {argv[0]}: {message or 'it exited at once'}", errno=code)


def attach(
    pid: int,
    *,
    follow_forks: bool = False,
    pending: bool = False,
    pin_hot_threads: bool = True,
    beside: Process | None = None,
) -> Process:
    """Seize every thread of the running process ``pid``; it keeps running between hits.

    Each way this can fail is one ``TargetError`` that says what happened (no such process,
    a thread id, a kernel thread, a zombie, already traced and by whom, gone meanwhile), and
    leaves the program as it was: every thread seized before the failure is let go again.
    A thread that exits while we seize it is no failure: it is simply not there any more.
    ``pin_hot_threads``: see ``Process.pin_hot_threads``; the program gets every thread's
    own CPU mask back at detach.

    ``beside``: the process joins the family of that one (following/family.py), as a
    followed child that exec'd does: ``beside.run()`` handles its stops too (one thread
    must wait for every tracee of this tool), ``beside.close()`` lets it go first, and it
    shares ``beside``'s thread placement. It gets no probes of ``beside``: register its own.
    """
    if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
        raise TargetError(f"no process {pid}", errno=errno.ESRCH)
    if pid == os.getpid():
        raise TargetError("a process cannot trace itself", errno=errno.EINVAL)
    _check_attachable(pid)
    if beside is not None and beside.family.root is not beside:
        raise TargetError(f"process {beside.pid} is a member of a family, not its root")
    family = None if beside is None else beside.family
    proc = Process(
        pid,
        follow_forks=follow_forks,
        pending=pending,
        pin_hot_threads=pin_hot_threads,
        family=family,
    )
    tracer = proc._tracer
    if beside is not None:
        tracer.placement = beside._tracer.placement  # one tool, one CPU for the family
    try:
        main = tracer.add_tracee(pid, TraceeKind.MAIN)
    except TargetError as exc:
        _check_attachable(pid)  # it exited meanwhile: say so
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise _not_permitted(pid) from exc
        raise TargetError(f"cannot trace process {pid}: {exc}", errno=exc.errno) from exc
    try:
        _seize_all(tracer, main)
    except BaseException:
        _release_seized(tracer, main)
        raise
    if beside is not None:
        beside.family.join(proc)
        beside._tracer.family.append(tracer)  # its stops, handled by beside's run()
    cleanup.remember(proc)
    return proc


def _seize_all(tracer: Tracer, main: Tracee) -> None:
    """Seize every thread of ``main``, including those it creates while we do."""
    pid = main.pid
    seen: set[int] = set()
    while True:
        try:
            tids = [t for t in procfs.list_tasks(pid) if t not in seen]
        except FileNotFoundError as exc:
            raise TargetError(
                f"process {pid} exited while being attached", errno=errno.ESRCH
            ) from exc
        if not tids:
            break
        for tid in tids:
            seen.add(tid)
            try:
                ptrace.seize(tid, OPTIONS)
            except ProcessLookupError:
                continue  # exited since it was listed
            except PermissionError as exc:
                if procfs.task_state(pid, tid) in ("", "Z", "X"):
                    continue  # exiting: the kernel refuses to trace a dead thread
                if _tracer_of(pid, tid) == os.getpid() and tid != pid:
                    # Created by a thread we had seized: the kernel attached it to us, and
                    # its first stop is on its way, as for any thread created while traced.
                    tracer.add_thread(main, tid, ThreadState.NEW)
                    continue
                raise _not_traceable(pid, tid, exc) from exc
            tracer.add_thread(main, tid, ThreadState.RUNNING, seized=True)
    if not main.threads:
        raise TargetError(f"process {pid} exited while being attached", errno=errno.ESRCH)


def _check_attachable(pid: int) -> None:
    """Refuse, with the reason, a pid that no tracer could attach to."""
    try:
        status = procfs.read_status(pid)
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError) as exc:
        raise TargetError(f"process {pid} exited", errno=errno.ESRCH) from exc
    name = status.get("Name", "?")
    tgid = int(status.get("Tgid", pid))
    if tgid != pid:
        raise TargetError(
            f"{pid} is a thread of process {tgid}, not a process: attach to {tgid}",
            errno=errno.EINVAL,
        )
    if flags & _PF_KTHREAD:
        raise TargetError(
            f"process {pid} ({name}) is a kernel thread: only user processes can be traced",
            errno=errno.EPERM,
        )
    if status.get("State", "")[:1] in ("Z", "X"):
        raise TargetError(
            f"process {pid} ({name}) has exited (a zombie its parent has not reaped)",
            errno=errno.ESRCH,
        )
    _check_tracer(pid, pid, status.get("TracerPid", "0"))


def _check_tracer(pid: int, tid: int, tracer_pid: str) -> None:
    if tracer_pid in ("", "0"):
        return
    who = int(tracer_pid)
    if who == os.getpid():
        what = f"this process itself (pid {who}: another Process object still attached?)"
    else:
        what = f"process {who} ({procfs.comm(who) or '?'})"
    thread = "" if tid == pid else f" (its thread {tid})"
    raise TargetError(
        f"process {pid}{thread} is already traced by {what}: a thread can have one tracer only",
        errno=errno.EPERM,
    )


def _tracer_of(pid: int, tid: int) -> int:
    """The TracerPid of one thread (0: none, or the thread is gone)."""
    with suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split(":", 1)[1])
    return 0


def _not_traceable(pid: int, tid: int, exc: OSError) -> TargetError:
    try:
        _check_tracer(pid, tid, str(_tracer_of(pid, tid)))
    except TargetError as traced:
        return traced
    if exc.errno in (errno.EACCES, errno.EPERM):
        return _not_permitted(pid)
    return TargetError(f"cannot trace process {pid}: {exc.strerror}", errno=exc.errno)


def _not_permitted(pid: int) -> TargetError:
    """The kernel refused to let us trace ``pid``: say whose it is and what would do.

    The rules are ptrace's access mode check (same user, or CAP_SYS_PTRACE; root has it)
    and, on a kernel with Yama, ``kernel.yama.ptrace_scope``: 1 lets a user trace only its
    own descendants (``-c``), 2 only CAP_SYS_PTRACE, 3 nobody until a reboot.
    """
    try:
        status = procfs.read_status(pid)
        uid = int(status.get("Uid", "").split()[0])
        user = pwd.getpwuid(uid).pw_name
    except (OSError, ValueError, IndexError, KeyError):
        status, user = {}, "?"
    scope = procfs.ptrace_scope()
    if scope is None:
        needs = "needs root, CAP_SYS_PTRACE, or the same user"
    elif scope == 0:
        needs = "needs root, CAP_SYS_PTRACE, or the same user (kernel.yama.ptrace_scope is 0)"
    elif scope == 1:
        needs = (
            "needs root or CAP_SYS_PTRACE: kernel.yama.ptrace_scope is 1, so a user may "
            "trace only the programs it starts (-c)"
        )
    elif scope == 2:
        needs = "needs root or CAP_SYS_PTRACE (kernel.yama.ptrace_scope is 2)"
    else:
        needs = f"no process may be traced: kernel.yama.ptrace_scope is {scope} until a reboot"
    name = status.get("Name", "?")
    return TargetError(
        f"cannot trace process {pid} ({name}, user {user}): permission denied; {needs}",
        errno=errno.EPERM,
    )


def _release_seized(tracer: Tracer, main: Tracee) -> None:
    """Undo a failed attach: let go of every thread seized, as it was.

    PTRACE_DETACH needs a stopped tracee, so each one is interrupted first and detached at
    its next stop, with the signal that stop was for (if it was one). A thread (or child) it
    created meanwhile was seized with it by the kernel and is let go the same way.
    """
    todo = list(main.threads)
    for tid in todo:
        with suppress(ProcessLookupError):
            ptrace.interrupt(tid)
    deadline = time.monotonic() + _RELEASE_TIMEOUT
    while todo:
        tid = todo.pop()
        status = _next_stop(tid, deadline)
        if status is None:
            continue
        event = (status >> 16) & 0xFF
        sig = os.WSTOPSIG(status) if event == 0 else 0  # a signal-delivery stop: give it back
        if event in (
            ptrace.PTRACE_EVENT_CLONE,
            ptrace.PTRACE_EVENT_FORK,
            ptrace.PTRACE_EVENT_VFORK,
        ):
            with suppress(OSError):
                todo.append(ptrace.geteventmsg(tid))
        with suppress(ProcessLookupError):
            ptrace.detach(tid, sig)
    tracer.drop_tracee(main)


def _next_stop(tid: int, deadline: float) -> int | None:
    """The wait status of ``tid``'s next stop; None once it is gone (or after ``deadline``)."""
    while True:
        try:
            got, status = ptrace.waitpid(tid, ptrace.WNOHANG)
        except ChildProcessError:
            return None
        if got == tid:
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                return None
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)
