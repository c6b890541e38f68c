"""The kernel's own uprobe counts for a process tree: the reference the uprobes backend's counts
are held to, written with raw tracefs writes and nothing of kprobes.

    probes = [RefProbe("malloc", libc, "malloc"), RefProbe("free", libc, "free")]
    with KernelReference(probes) as ref:
        run = ref.run(["python3", "-c", "pass"])      # the command and every process it starts
    run.counts          # {"malloc": 50087, "free": ...}, the whole tree
    run.counts_of(run.root)                           # the command's own process only

How, step by step (each undone on every way out, in reverse):

    Step 1  a private instance ``instances/kpref_<pid>_<n>``: a large per-CPU buffer,
            ``options/record-tgid`` (each trace line says its thread's process) and
            ``options/event-fork`` (a task created by a recorded task is recorded too)
    Step 2  one uprobe event per probe: ``p:GROUP/NAME PATH:0xOFFSET``, the file offset of the
            symbol computed here with pyelftools (symbol value → the PT_LOAD that holds it);
            ``grouped=True``: the probes are locations of a few events instead (Step 4)
    Step 3  the process: a command forked and held before its exec (``run``), or a running
            process (``attach``); its threads go in ``set_event_pid``
    Step 4  the events, and ``sched/sched_process_exec``, enabled in the instance only, with
            every probed file mapped here meanwhile: the kernel analyses an instruction when
            it inserts the breakpoint in a mapping, so a file that no process maps at enable
            time (a private copy, a program not yet executed) would have the instructions the
            kernel will not probe skipped silently later instead of refused now
    Step 5  release the command; wait for it to exit (``run``) or for ``until`` (``attach``)
    Step 6  tracing off; every per-CPU ``stats`` must say 0 overrun and 0 dropped events
    Step 7  read the instance's ``trace`` (the kernel's text, CPUs merged in time order) and
            count lines per event name and per process; a ``run``'s held child executes a little
            Python between its release and its exec, so its lines before its first
            ``sched_process_exec`` line are not the command's and are left out.

Creating or removing an event costs tens of milliseconds here (hundreds of probes: half a
minute), adding a location to an event a few. ``grouped=True`` puts every probe in one event as
a location whose records carry the probe's index (an immediate argument, ``id=\\N``); an event
the kernel refuses to enable is split in halves until the refused probes are isolated.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import mmap
import os
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

TRACEFS = Path("/sys/kernel/tracing")
BUFFER_KB = 65536  # per CPU: ~3 million uprobe records, far more than any test makes
_counter = itertools.count(1)
# "comm-tid (tgid) [cpu] flags timestamp: event: ..." (record-tgid adds the "(tgid)").
_LINE = re.compile(
    r"^\s*(?P<comm>.*?)-(?P<tid>\d+)\s+\(\s*(?P<tgid>[-\d]+)\)\s+\[\d+\]\s+\S+\s+"
    r"(?P<ts>[\d.]+):\s+(?P<event>\w+):"
)
_ID = re.compile(r" id=(\d+)$")  # a grouped location's index


@dataclass(frozen=True, slots=True)
class RefProbe:
    """An entry uprobe on ``symbol`` of the ELF file ``path``, counted as ``name``."""

    name: str
    path: Path | str
    symbol: str
    offset: int = 0  # bytes into the function: a probe on one of its instructions


# Errors the kernel gives when enabling a uprobe on an instruction it will not probe.
_REFUSED = {524, errno.EOPNOTSUPP, errno.EINVAL, errno.EILSEQ}  # 524 = the kernel's ENOTSUPP


def file_offset(path: Path | str, symbol: str) -> int:
    """The offset in ``path`` of ``symbol``'s first byte (what ``uprobe_events`` wants).

    Cached per file version: parsing libc's symbol tables takes a tenth of a second, and a
    test asks for the same few symbols hundreds of times."""
    st = os.stat(path)
    return _file_offset(os.path.realpath(path), symbol, st.st_ino, st.st_mtime_ns)


@functools.cache
def _file_offset(path: str, symbol: str, _ino: int, _mtime_ns: int) -> int:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        value = None
        for section in elf.iter_sections():
            if not isinstance(section, SymbolTableSection):
                continue
            for sym in section.get_symbol_by_name(symbol) or ():
                if sym["st_shndx"] != "SHN_UNDEF" and sym["st_value"]:
                    value = sym["st_value"]
                    break
            if value is not None:
                break
        if value is None:
            raise LookupError(f"no symbol {symbol!r} defined in {path}")
        for segment in elf.iter_segments():
            if segment["p_type"] != "PT_LOAD":
                continue
            start = segment["p_vaddr"]
            if start <= value < start + segment["p_filesz"]:
                return int(value - start + segment["p_offset"])
    raise LookupError(f"{symbol} ({value:#x}) is in no PT_LOAD of {path}")


def _write(path: Path, text: str, *, append: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(slots=True)
class ReferenceRun:
    """What the kernel counted: hits per event name, per process (tgid)."""

    root: int  # the command's pid, or the attached process's
    returncode: int | None  # a run's exit status (negative: killed by that signal)
    by_process: dict[int, Counter[str]] = field(default_factory=dict)
    threads: dict[str, set[int]] = field(default_factory=dict)  # event name → tids that hit it

    @property
    def counts(self) -> Counter[str]:
        """Hits of the whole tree, per event name."""
        total: Counter[str] = Counter()
        for counts in self.by_process.values():
            total.update(counts)
        return total

    def counts_of(self, pid: int) -> Counter[str]:
        return Counter(self.by_process.get(pid, Counter()))


class KernelReference:
    """The kernel's uprobes on ``probes``, in a private instance; one ``run`` or ``attach``."""

    def __init__(
        self, probes: Sequence[RefProbe], *, buffer_kb: int = BUFFER_KB, grouped: bool = False
    ) -> None:
        self.probes = list(probes)
        self.grouped = grouped
        tag = f"{os.getpid()}_{next(_counter)}"
        self.group = f"kpref_{tag}"
        self.instance = TRACEFS / "instances" / f"kpref_{tag}"
        self.defined: list[str] = []
        self.refused: set[str] = set()  # probes the kernel would not enable (ENOTSUPP...)
        # Step 1: the instance.
        self.instance.mkdir()
        try:
            _write(self.instance / "buffer_size_kb", str(buffer_kb), append=False)
            _write(self.instance / "options" / "record-tgid", "1", append=False)
            _write(self.instance / "options" / "event-fork", "1", append=False)
            # Step 2: the events, defined (not enabled); grouped ones in Step 4.
            for probe in [] if grouped else self.probes:
                _write(TRACEFS / "uprobe_events", f"p:{self.group}/{probe.name} {_where(probe)}\n")
                self.defined.append(probe.name)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> KernelReference:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove the instance (which disables the events in it), then the events."""
        with contextlib.suppress(FileNotFoundError):
            self.instance.rmdir()
        for name in reversed(self.defined):
            with contextlib.suppress(OSError):
                _write(TRACEFS / "uprobe_events", f"-:{self.group}/{name}\n")
        self.defined.clear()

    # -- Step 3 to 7 ------------------------------------------------------------------------------

    def _follow(self, tids: Sequence[int]) -> None:
        _write(self.instance / "set_event_pid", " ".join(map(str, tids)), append=False)
        _write(self.instance / "events" / "sched" / "sched_process_exec" / "enable", "1")
        with _mapped({os.path.realpath(p.path) for p in self.probes}):
            if self.grouped:
                self._enable_group(list(range(len(self.probes))))
            for name in [] if self.grouped else self.defined:
                try:
                    _write(self.instance / "events" / self.group / name / "enable", "1")
                except OSError as exc:  # an instruction the kernel will not probe
                    if exc.errno not in _REFUSED:
                        raise
                    self.refused.add(name)

    def _enable_group(self, indices: list[int]) -> None:
        """One event holding the probes ``indices``, enabled, or split until it can be."""
        name = f"all{len(self.defined)}"
        for i in indices:
            line = f"p:{self.group}/{name} {_where(self.probes[i])} id=\\{i}:u32"
            _write(TRACEFS / "uprobe_events", line + "\n")
        self.defined.append(name)
        try:
            _write(self.instance / "events" / self.group / name / "enable", "1")
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            _write(TRACEFS / "uprobe_events", f"-:{self.group}/{name}\n")
            self.defined.remove(name)
            if len(indices) == 1:
                self.refused.add(self.probes[indices[0]].name)
                return
            self._enable_group(indices[: len(indices) // 2])
            self._enable_group(indices[len(indices) // 2 :])

    def run(
        self,
        argv: Sequence[str | Path],
        *,
        env: dict[str, str] | None = None,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        timeout: float = 20,
    ) -> ReferenceRun:
        """Run ``argv`` (PATH searched) and count the hits of it and every process it starts,
        from the first instruction after its exec. ``stdin``/``stdout``/``stderr``: file
        descriptors it gets (default: ours)."""
        args = [str(a) for a in argv]
        env = dict(os.environ if env is None else env)
        path = args[0] if "/" in args[0] else shutil.which(args[0], path=env.get("PATH"))
        assert path is not None, f"{args[0]} is not in PATH"
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # Step 3: held until the instance follows it
            try:
                os.close(go_w)
                for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
                    if fd is not None:
                        os.dup2(fd, target)
                if os.read(go_r, 1):
                    os.execve(path, args, env)
            finally:
                os._exit(127)
        os.close(go_r)
        status = None
        try:
            self._follow([pid])  # Step 3 and 4
            os.write(go_w, b"g")  # Step 5
            os.close(go_w)
            go_w = -1
            status = _wait(pid, timeout)
        finally:
            if go_w >= 0:
                os.close(go_w)
            if status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return self._collect(pid, code, exec_cut=True)

    def attach(
        self, pid: int, go: Callable[[], None], until: Callable[[], bool], *, timeout: float = 20
    ) -> ReferenceRun:
        """Count the hits of the running process ``pid`` and every process it starts after
        ``go()`` is called, until ``until()`` is true."""
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        self._follow(tids)
        go()
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} did not finish within {timeout} s")
            time.sleep(0.01)
        return self._collect(pid, None, exec_cut=False)

    def _collect(self, root: int, code: int | None, *, exec_cut: bool) -> ReferenceRun:
        _write(self.instance / "tracing_on", "0", append=False)  # Step 6
        lost = {}
        for cpu_dir in sorted((self.instance / "per_cpu").iterdir()):
            stats = dict(
                line.split(":", 1) for line in (cpu_dir / "stats").read_text().splitlines()
            )
            for key in ("overrun", "dropped events"):
                if int(stats[key]) != 0:
                    lost[f"{cpu_dir.name} {key}"] = int(stats[key])
        if lost:
            raise AssertionError(f"the reference lost trace records: {lost}")
        result = ReferenceRun(root, code)
        names = set(self.defined)
        started = not exec_cut
        for line in (self.instance / "trace").read_text().splitlines():  # Step 7
            m = _LINE.match(line)
            if m is None:
                continue
            tid, event = int(m["tid"]), m["event"]
            if event == "sched_process_exec":
                started = started or tid == root
                continue
            if event not in names or (tid == root and not started):
                continue
            if self.grouped:
                found = _ID.search(line)
                if found is None:
                    raise AssertionError(f"a grouped record without its id: {line}")
                event = self.probes[int(found[1])].name
            if not m["tgid"].isdigit():
                raise AssertionError(f"the kernel did not record the process of: {line}")
            result.by_process.setdefault(int(m["tgid"]), Counter())[event] += 1
            result.threads.setdefault(event, set()).add(tid)
        return result


def _where(probe: RefProbe) -> str:
    """``PATH:0xOFFSET`` of a probe, as ``uprobe_events`` wants it."""
    offset = file_offset(probe.path, probe.symbol) + probe.offset
    return f"{os.path.realpath(probe.path)}:{offset:#x}"


@contextlib.contextmanager
def _mapped(paths: set[str]) -> Iterator[None]:
    """The files mapped in this process, private and read-only: executable to the kernel's
    uprobes (VM_MAYEXEC), which insert their breakpoints in this copy too, and analyse the
    instruction as they do."""
    maps = []
    try:
        for path in sorted(paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                maps.append(mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
            finally:
                os.close(fd)
        yield
    finally:
        for m in maps:
            m.close()


def _wait(pid: int, timeout: float) -> int | None:
    """The wait status of child ``pid`` once it exits, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError as exc:
            raise OSError(errno.ECHILD, f"{pid} is not our child") from exc
        if done:
            return status
        time.sleep(0.005)
    return None
