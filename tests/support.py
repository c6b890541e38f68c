"""Helpers for the live tests that do not involve kprobes itself: reference tools (nm, objdump,
readelf, the kernel's own uprobes), /proc readers, and bounded waits.

Everything here is independent of the code under test, so that it can serve as the reference.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# ---------------------------------------------------------------------------------------------
# ELF reference data from binutils


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    value: int
    size: int


def nm_symbols(path: Path | str, *, dynamic: bool = False) -> dict[str, Symbol]:
    """Defined symbols with their sizes, by name (version suffixes like ``@@GLIBC_2.8`` removed;
    the default version wins over older ones)."""
    cmd = ["nm", "-S", "--defined-only", *(["-D"] if dynamic else []), str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    table: dict[str, Symbol] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:  # no size (an assembly label)
            parts.insert(1, "0")
        if len(parts) != 4:
            continue
        value, size, _kind, full = parts
        name = full.split("@")[0]
        if name in table and "@@" not in full:
            continue
        table[name] = Symbol(name, int(value, 16), int(size, 16))
    return table


def symbol(path: Path | str, name: str, *, dynamic: bool = False) -> Symbol:
    return nm_symbols(path, dynamic=dynamic)[name]


_OBJDUMP_LINE = re.compile(r"^\s*([0-9a-f]+):\t(?:[0-9a-f]{2} )+\s*\t?(.*)$")


def disassemble(path: Path | str, start: int, end: int) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction objdump decodes in [start, end)."""
    cmd = [
        "objdump",
        "-d",
        "-w",
        f"--start-address={start:#x}",
        f"--stop-address={end:#x}",
        str(path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    insns = []
    for line in out.splitlines():
        m = _OBJDUMP_LINE.match(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(2).strip()))
    return insns


def function_insns(path: Path | str, name: str, *, dynamic: bool = False) -> list[tuple[int, str]]:
    """(offset from the symbol, instruction text) of every instruction of function ``name``
    within the symbol's size, from objdump."""
    sym = symbol(path, name, dynamic=dynamic)
    assert sym.size > 0, f"{name} has no size in {path}"
    return [(a - sym.value, t) for a, t in disassemble(path, sym.value, sym.value + sym.size)]


def boundaries(path: Path | str, name: str, *, dynamic: bool = False) -> list[int]:
    """Offsets of every instruction boundary of ``name``, relative to the symbol."""
    return [off for off, _ in function_insns(path, name, dynamic=dynamic)]


def file_offset(path: Path | str, vaddr: int) -> int:
    """File offset of a link-time virtual address (what uprobe_events wants), from readelf."""
    for line in _readelf(str(path), "-lW").splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD":
            offset, seg_vaddr, filesz = int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)
            if seg_vaddr <= vaddr < seg_vaddr + filesz:
                return vaddr - seg_vaddr + offset
    raise LookupError(f"{vaddr:#x} is in no LOAD segment of {path}")


def libc_path(program: Path | str) -> Path:
    """The libc.so.6 ``program`` loads, resolved (what its /proc/PID/maps will name)."""
    out = subprocess.run(
        ["ldd", str(program)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for line in out.splitlines():
        m = re.search(r"libc\.so\.6 => (\S+)", line)
        if m:
            return Path(m.group(1)).resolve()
    raise LookupError(f"{program} does not load libc.so.6")


# ---------------------------------------------------------------------------------------------
# /proc


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    path: str


def maps(pid: int) -> list[Mapping]:
    result = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            result.append(Mapping(start, end, parts[1], int(parts[2], 16), path))
    return result


def load_base(pid: int, path: Path | str) -> int:
    """Where the file ``path`` is mapped in ``pid`` (start of its offset-0 mapping)."""
    real = str(Path(path).resolve())
    for m in maps(pid):
        if m.path == real and m.offset == 0:
            return m.start
    raise LookupError(f"{real} is not mapped in {pid}")


def runtime_address(pid: int, path: Path | str, name: str, *, dynamic: bool = False) -> int:
    """Run-time address of symbol ``name`` of ``path`` in ``pid`` (PIE or shared: plus the load
    bias; a fixed-address executable: the symbol's value)."""
    sym = symbol(path, name, dynamic=dynamic)
    if _elf_type(path) == "EXEC":
        return sym.value
    return load_base(pid, path) + sym.value


@functools.cache
def _readelf(path: str, option: str) -> str:
    cmd = ["readelf", option, path]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def _elf_type(path: Path | str) -> str:
    m = re.search(r"Type:\s+(\w+)", _readelf(str(path), "-hW"))
    assert m is not None
    return m.group(1)


def anonymous_exec_mappings(pid: int) -> list[Mapping]:
    """Executable mappings that belong to no file and are not [vdso]/[vsyscall]: in a plain C
    program, only an injected page can be one."""
    return [m for m in maps(pid) if "x" in m.perms and m.path == ""]


def raw_read(pid: int, addr: int, n: int) -> bytes:
    """Bytes of ``pid``'s memory as they really are (through /proc/PID/mem, not kprobes)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, n, addr)
    finally:
        os.close(fd)


def exe_text(pid: int, path: Path | str) -> tuple[int, bytes]:
    """(start, bytes) of the executable mapping of ``path`` in ``pid``, read raw."""
    real = str(Path(path).resolve())
    for m in maps(pid):
        if m.path == real and "x" in m.perms:
            return m.start, raw_read(pid, m.start, m.end - m.start)
    raise LookupError(f"no executable mapping of {real} in {pid}")


def thread_ids(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def threads_of(proc: Any) -> str:
    """A traced process's threads as our books hold them and as the kernel shows them: what
    a test that timed out says of where each thread was."""
    said = [f"live {proc._tracer.live}, inbox {proc._tracer.world.inbox}"]
    for tid, t in sorted(proc._tracer.threads.items()):
        said.append(f"{tid}: {t.state.name} pending {t.pending} busy {t.busy}")
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{proc.pid}/task"), key=int):
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{proc.pid}/task/{tid}/stat").read_text()
                wchan = Path(f"/proc/{proc.pid}/task/{tid}/wchan").read_text()
                said.append(f"/proc {tid}: {stat.rsplit(')', 1)[1].split()[0]} {wchan}")
    return "; ".join(said)


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# ---------------------------------------------------------------------------------------------
# Bounded waits and cleanup


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str | Callable[[], str]
) -> None:
    """``what`` names what was awaited; a callable says it at the time out (a state then)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"timed out after {timeout} s waiting for {said}")
        time.sleep(0.01)


def cpu_time(pid: int) -> float:
    """Seconds of CPU the process's threads have run so far (schedstat: ns on the CPU), the
    living ones only; 0 for a process that is gone."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{pid}/task/{task}/schedstat") as f,
            ):
                total += int(f.read().split()[0])
    return total / 1e9


def wait_ran(pid: int, seconds: float, timeout: float = 60) -> None:
    """Wait until the process has run ``seconds`` more of CPU time: "let it run a while" that
    means the same on a loaded machine, where a wall-clock sleep may find it never scheduled."""
    start = cpu_time(pid)
    wait_until(lambda: cpu_time(pid) - start >= seconds, timeout, f"{pid} to run {seconds} s")


def wait_child(pid: int, timeout: float) -> int:
    """waitpid(pid) with a deadline; returns the raw status."""
    deadline = time.monotonic() + timeout
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not exit within {timeout} s")
        time.sleep(0.01)


def cleanup_proc(proc: Any) -> None:
    """Detach from a kprobes process if still attached, then make sure it is gone (a failing
    test must not leave a stopped tracee behind)."""
    if proc.exit_code is not None:
        return
    with contextlib.suppress(Exception):
        proc.detach()
    try:
        got, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:
        return  # already reaped (by the test), or not our child: never kill a reused pid
    if got == proc.pid and not os.WIFSTOPPED(status):
        return  # it has just exited
    os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while True:  # a traced child may report stops before its death
            _, status = os.waitpid(proc.pid, 0)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                break


def read_line(stream: int, timeout: float) -> bytes:
    """One line from a file descriptor (pipe), or AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no line within {timeout} s (got {data!r})")
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream, 1)
            if not chunk:
                raise AssertionError(f"EOF before a complete line (got {data!r})")
            data += chunk
    return data


def file_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def wait_for_lines(path: Path, count: int, timeout: float) -> list[str]:
    """Wait until the file has at least ``count`` complete lines."""
    wait_until(lambda: len(file_lines(path)) >= count, timeout, f"{count} lines in {path}")
    return file_lines(path)


# ---------------------------------------------------------------------------------------------
# tests/programs/busy.c: threads that never sleep (see its header comment for the modes)


def busy_output(threads: int, depth: int, calls: int = -1) -> str:
    """What ``busy THREADS CALLS DEPTH`` prints on stdout when it runs unharmed."""
    want = depth * (depth + 1) // 2
    if calls < 0:
        lines = [f"thread {t}: rec({depth}) = {want}, every call checked" for t in range(threads)]
        return "\n".join([*lines, f"total: {threads} threads stopped"]) + "\n"
    hot_sum = sum(i * 3 + 1 for i in range(calls))
    lines = [
        f"thread {t}: {calls} calls, rec({depth}) = {want}, hot sum = {hot_sum}"
        for t in range(threads)
    ]
    total = threads * calls
    return (
        "\n".join([*lines, f"total: {total * (depth + 1)} calls of rec, {total} calls of hot"])
        + "\n"
    )


def start_busy(
    popen: Callable[..., subprocess.Popen[bytes]], exe: Path, threads: int, depth: int
) -> subprocess.Popen[bytes]:
    """``busy THREADS -1 DEPTH`` (until SIGTERM), returned once every thread runs; its stdout
    and stderr are pipes (``stop_busy`` reads them)."""
    prog = popen(
        [exe, threads, -1, depth],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert prog.stderr is not None
    line = read_line(prog.stderr.fileno(), timeout=10).decode()
    assert line == f"busy {prog.pid} ready\n", line
    return prog


def stop_busy(prog: subprocess.Popen[bytes], timeout: float = 10) -> tuple[int, str, str]:
    """SIGTERM to a ``start_busy`` program: (exit status, stdout, stderr) once it ended."""
    with contextlib.suppress(ProcessLookupError):
        prog.send_signal(signal.SIGTERM)
    out, err = prog.communicate(timeout=timeout)
    return prog.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------------------------------
# The kernel's uprobes, the reference for hit counts

TRACEFS_CANDIDATES = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


def armed(tool_pid: int) -> bool:
    """The kernel's session of ``tool_pid`` has its events defined and every one enabled
    (they are all defined, then enabled one by one: one defined is not one armed)."""
    group = f"kprobes_{tool_pid}"
    events = Path(str(tracefs_root()), "instances", group, "events", group)
    try:
        enables = [e / "enable" for e in events.iterdir() if e.is_dir()]
        return bool(enables) and all(f.read_text().strip() == "1" for f in enables)
    except OSError:
        return False


def tracefs_root() -> Path | None:
    """The mounted tracefs with uprobe_events (mounting it if needed), or None."""
    for root in TRACEFS_CANDIDATES:
        if Path(root, "uprobe_events").exists():
            return Path(root)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            ["mount", "-t", "tracefs", "nodev", TRACEFS_CANDIDATES[0]],
            capture_output=True,
            timeout=10,
        )
    if Path(TRACEFS_CANDIDATES[0], "uprobe_events").exists():
        return Path(TRACEFS_CANDIDATES[0])
    return None


# A test of the kernel's uprobes backend, skipped (saying why) where the kernel has none; and
# the command line's two backends for user programs, as a parameter.
needs_uprobes = pytest.mark.skipif(
    tracefs_root() is None,
    reason="the kernel's uprobes need tracefs with uprobe_events (root, CONFIG_UPROBE_EVENTS)",
)
CLI_BACKENDS = ["ptrace", pytest.param("uprobes", marks=needs_uprobes)]


def _append(path: Path, text: str) -> None:
    """Write a tracefs control file the way the kernel expects: append, never truncate."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


_TRACE_LINE = re.compile(r"^\s*.*?-(\d+)\s+\[\d+\]\s+\S+\s+[\d.]+:\s+\w+:\s+\((0x[0-9a-f]+)\)")
_ENTRIES = re.compile(r"entries-in-buffer/entries-written:\s*(\d+)/(\d+)")

# Errors the kernel gives when enabling a uprobe on an instruction it will not probe.
_REFUSED = {524, errno.EOPNOTSUPP, errno.EINVAL, errno.EILSEQ}  # 524 = the kernel's ENOTSUPP


@dataclass(frozen=True, slots=True)
class UprobeRun:
    counts: list[int | None]  # per location; None = the kernel refused this location
    stdout: bytes
    returncode: int


def kernel_uprobe_counts(
    argv: Sequence[str | Path],
    locations: Sequence[tuple[Path, int]],
    *,
    stdin: bytes,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> UprobeRun:
    """Run ``argv`` with a kernel uprobe on each (file, link-time address) and count the hits
    of that process alone, per location.

    The program must print a line on stderr and then read ``stdin`` before doing its work:
    probes are enabled while it waits, so the files are mapped and the kernel analyses (and
    possibly refuses, ENOTSUPP) each instruction at enable time.

    Each uprobe event of tracefs may hold many locations, and disabling an event costs one
    RCU synchronisation (tens of ms), so the locations are put in one event whose records
    carry the probed address; an event the kernel refuses to enable is split in halves until
    the refused locations are isolated. Events are enabled in a private tracefs instance
    filtered on the program's pid; hits are counted from the trace records, after checking
    that none was dropped.
    """
    root = tracefs_root()
    assert root is not None, "tracefs with uprobe_events is not available"
    group = f"kptref{os.getpid()}"
    instance = root / "instances" / f"kpt_ref_{os.getpid()}"
    defined: list[str] = []
    enabled: list[str] = []
    refused: set[int] = set()
    proc = None
    instance.mkdir()
    try:
        _append(instance / "buffer_size_kb", "16384")
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stderr is not None
        read_line(proc.stderr.fileno(), timeout=10)
        _append(instance / "set_event_pid", str(proc.pid))

        def enable(indices: list[int]) -> None:
            name = f"g{len(defined)}"
            for i in indices:
                path, vaddr = locations[i]
                probe = f"p:{group}/{name} {path}:{file_offset(path, vaddr):#x}\n"
                _append(root / "uprobe_events", probe)
            defined.append(name)
            try:
                _append(instance / "events" / group / name / "enable", "1")
                enabled.append(name)
            except OSError as e:
                if e.errno not in _REFUSED:
                    raise
                if len(indices) == 1:
                    refused.add(indices[0])
                    return
                enable(indices[: len(indices) // 2])
                enable(indices[len(indices) // 2 :])

        enable(list(range(len(locations))))
        runtime = {
            runtime_address_of(proc.pid, path, vaddr): i
            for i, (path, vaddr) in enumerate(locations)
        }
        stdout, _ = proc.communicate(stdin, timeout=timeout)
        _append(instance / "tracing_on", "0")
        trace = (instance / "trace").read_text()
    finally:
        for name in enabled:
            with contextlib.suppress(OSError):
                _append(instance / "events" / group / name / "enable", "0")
        for name in defined:
            with contextlib.suppress(OSError):
                _append(root / "uprobe_events", f"-:{group}/{name}\n")
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            instance.rmdir()
    m = _ENTRIES.search(trace)
    assert m is not None and m.group(1) == m.group(2), (
        f"the kernel dropped trace records: {m and m.group(0)}"
    )
    counts: list[int | None] = [None if i in refused else 0 for i in range(len(locations))]
    for line in trace.splitlines():
        t = _TRACE_LINE.match(line)
        if t and int(t.group(1)) == proc.pid:
            i = runtime[int(t.group(2), 16)]
            counts[i] = (counts[i] or 0) + 1
    return UprobeRun(counts, stdout, proc.returncode)


class ForeignUprobes:
    """Another tool's kernel uprobes (as bpftrace or ``perf probe`` places them), in a tracefs
    instance of their own, named by ``tag``; OSError without tracefs. The kernel puts each
    into every process that maps its file."""

    def __init__(self, tag: str) -> None:
        root = tracefs_root()
        if root is None:
            raise OSError("tracefs with uprobe_events is not available")
        self.root = root
        self.group = f"kpt{tag}{os.getpid()}"
        self.instance = root / "instances" / f"kpt_{tag}_{os.getpid()}"
        self.instance.mkdir(exist_ok=True)
        _append(self.instance / "buffer_size_kb", "16384")
        self.names: list[str] = []
        self._made = 0

    def define(self, path: Path | str, vaddr: int) -> str:
        """A uprobe event at link-time address ``vaddr`` of ``path``, not enabled yet."""
        self._made += 1
        name = f"p{self._made}"
        _append(
            self.root / "uprobe_events",
            f"p:{self.group}/{name} {path}:{file_offset(path, vaddr):#x}\n",
        )
        self.names.append(name)
        return name

    def enable(self, name: str, on: bool = True) -> None:
        _append(self.instance / "events" / self.group / name / "enable", "1" if on else "0")

    def remove(self, name: str) -> None:
        """The uprobe goes, as when its tool ends."""
        self.names.remove(name)
        with contextlib.suppress(OSError):
            self.enable(name, False)
        _append(self.root / "uprobe_events", f"-:{self.group}/{name}\n")

    def hits(self) -> int:
        """The hits recorded so far, of every process (none dropped)."""
        trace = (self.instance / "trace").read_text()
        m = _ENTRIES.search(trace)
        assert m is not None and m.group(1) == m.group(2), f"records dropped: {m and m[0]}"
        return sum(1 for line in trace.splitlines() if _TRACE_LINE.match(line))

    def close(self) -> None:
        for name in list(self.names):
            with contextlib.suppress(OSError):
                self.remove(name)
        with contextlib.suppress(OSError):
            self.instance.rmdir()


def runtime_address_of(pid: int, path: Path | str, vaddr: int) -> int:
    """Run-time address in ``pid`` of link-time address ``vaddr`` of the file ``path``."""
    if _elf_type(path) == "EXEC":
        return vaddr
    return load_base(pid, path) + vaddr


def file_bytes(path: Path | str, vaddr: int, n: int) -> bytes:
    """``n`` bytes of the file ``path`` at link-time address ``vaddr`` (the pristine code)."""
    with open(path, "rb") as f:
        f.seek(file_offset(path, vaddr))
        return f.read(n)


KPROBES = Path(sys.executable).parent / "kprobes"  # the console script of the install


def perf_event_fds(pid: int) -> int:
    """How many perf event files process ``pid`` holds (the kernel's counters of a ``count``
    on the kernel's backends: kprobes/linux/perf.py)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]"
    return n


def cli(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``kprobes ARGS...`` to its end, its output captured as text."""
    return subprocess.run(
        [str(KPROBES), *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def without_output_of(text: str, output: bytes) -> str:
    """``text`` (a ``-c`` trace's stdout) less each line of ``output`` (the command's own,
    written to the same stdout), once each: the command may write in the middle of one of
    the tool's lines, which a block write split in two."""
    for line in output.decode().splitlines(keepends=True):
        if line not in text:
            raise AssertionError(f"the command's line {line!r} is not in the output")
        text = text.replace(line, "", 1)
    return text


def reference_output(
    argv: Sequence[str | Path], *, stdin: bytes = b"", timeout: float = 30
) -> bytes:
    """stdout of an unprobed run (which must exit 0)."""
    result = subprocess.run(
        [str(a) for a in argv], input=stdin, capture_output=True, timeout=timeout, check=True
    )
    return result.stdout


# ---------------------------------------------------------------------------------------------
# Nothing of ours left behind


def tracer_of(pid: int, tid: int) -> int:
    """TracerPid of one thread of ``pid`` (0: untraced, or the thread is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split(":", 1)[1])
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        pass
    return 0


def assert_untouched(pid: int, path: Path | str) -> None:
    """Every executable byte of the file ``path`` mapped in ``pid`` is the file's (no int3,
    no jump of a tracer left), and no thread of ``pid`` is traced."""
    real = str(Path(path).resolve())
    compared = 0
    with open(real, "rb") as f:
        for m in maps(pid):
            if m.path != real or "x" not in m.perms:
                continue
            live = raw_read(pid, m.start, m.end - m.start)
            f.seek(m.offset)
            disk = f.read(m.end - m.start)
            for i, (a, b) in enumerate(zip(live, disk, strict=False)):
                if a != b:
                    raise AssertionError(
                        f"byte {m.start + i:#x} of {Path(real).name} is {a:#04x} in process "
                        f"{pid}, {b:#04x} in the file: left patched"
                    )
            compared += len(disk)
    assert compared > 0, f"no executable mapping of {real} in {pid}"
    traced = {tid: tracer_of(pid, tid) for tid in thread_ids(pid)}
    traced = {tid: by for tid, by in traced.items() if by}
    assert not traced, f"threads of {pid} still traced (tid: tracer): {traced}"


# ---------------------------------------------------------------------------------------------
# A CPU without some XSAVE features, on one that has them

XFEATURES_AVX512 = 0xE0  # opmask, ZMM_Hi256, Hi16_ZMM (XCR0 bits 5-7)
_XSAVE_XCR0 = 464  # the user's XCR0: the first word of the FXSAVE area's software bytes
_XSAVE_XSTATE_BV = 512  # the XSAVE header's first word


def xsave_without(image: bytes, features: int) -> bytes:
    """An XSAVE image (as PTRACE_GETREGSET NT_X86_XSTATE gives it: standard format, the user's
    XCR0 at 464) as a CPU without ``features`` would give it: those bits clear in XCR0 and in
    XSTATE_BV. The standard format's offsets are the architecture's, so nothing moves: PKRU
    stays after where the AVX-512 state would be, as on a CPU that has none."""
    if len(image) <= _XSAVE_XSTATE_BV:  # FXSAVE alone: no features to mask
        return image
    out = bytearray(image)
    for at in (_XSAVE_XCR0, _XSAVE_XSTATE_BV):
        word = int.from_bytes(out[at : at + 8], "little")
        out[at : at + 8] = (word & ~features).to_bytes(8, "little")
    return bytes(out)


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo (what this CPU and kernel offer: avx, avx512f, ...)."""
    with open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def default_signals() -> None:
    """``preexec_fn`` for a process a test signals: SIGINT, SIGHUP and SIGTERM at SIG_DFL.
    A test suite started in a script's background job inherits SIGINT ignored (and under
    ``nohup`` SIGHUP too), and Python keeps an inherited SIG_IGN."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def run_main(*args: object) -> tuple[str, str]:
    """stdout and stderr of ``kprobes ARGS`` run in this process, through the command line's
    ``main()`` (no interpreter start-up per run); the command must succeed."""
    from kprobes.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main.main([str(a) for a in args])
    assert code == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


def read_then_close(popen: Any, argv: list[Any], n: int) -> tuple[list[bytes], str, int]:
    """``argv | head -n``: its first ``n`` lines, then its stdout closed as head closes it;
    (those lines, its stderr, its exit status)."""
    tool = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert tool.stdout is not None and tool.stderr is not None
    lines = [tool.stdout.readline() for _ in range(n)]
    tool.stdout.close()
    err = tool.stderr.read().decode()
    return lines, err, tool.wait(timeout=120)


def run_build_script(name: str, out: Path) -> str:
    """Run ``scripts/NAME OUT`` (a generator of one of the package's tables) with this
    interpreter; what it wrote."""
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(
        ["sh", str(repo / "scripts" / name), str(out)],
        check=True,
        cwd=repo,
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return out.read_text()
