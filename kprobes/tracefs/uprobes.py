"""The Uprobes target: the kernel's uprobes on user programs, through ``uprobe_events``.

    with kprobes.Uprobes(pid=1234) as u:
        u.register_kprobe(Kprobe(symbol="libc:malloc", pre_handler=h), ["size=%di:u64"])
        u.run()          # until process 1234 exits

The kernel places a uprobe on a *file* and an offset *in the file*, not on a process and an
address: every process that maps the file hits it. So a symbol is resolved to its link-time
address (ELF symbol table) and then to the file offset through the PT_LOAD program header that
contains it (``ElfImage.vaddr_to_offset``); section headers and load biases play no part.

``Uprobes(path=...)`` probes a file for every process that runs it. ``Uprobes(pid=...)``
resolves names in that process's mappings (``libc:malloc`` finds the libc it loaded) and keeps
only its events: the instance's ``set_event_pid`` holds its threads and ``options/event-fork``
adds the tasks it creates, so other processes' hits are not even recorded; children it forks
are told from its threads by the ``task_newtask`` records of the same instance, and dropped.
The profile's hit count, like the kernel's, counts every process that hit the probe.
``run()`` returns True when the process exits.

Places in definition lines (``add``) are the kernel's ``PATH:0xOFFSET`` (a file offset), or
``[MODULE:]SYMBOL[+OFFS]`` resolved as above.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
import select

from kprobes.core.probes import Kprobe, ProbeFlags
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeRejected, SpecError, SymbolNotFound, TargetError
from kprobes.symbols.elf import ElfImage
from kprobes.symbols.resolve import SymbolResolver
from kprobes.tracefs.eventformat import EventFormat
from kprobes.tracefs.lines import ProbeLine, uprobe_place
from kprobes.tracefs.target import AnyProbe, ProbePoint, Sink, TraceTarget

_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")


def _split(text: str) -> tuple[str | None, str]:
    """``/a/b:rest`` → ("/a/b", "rest"); ``lib:rest`` → ("lib", "rest"); ``rest`` → (None, …)."""
    if text.startswith("/"):
        module, sep, rest = text.rpartition(":")
        return (module, rest) if sep else (text, "")
    head, sep, tail = text.partition(":")
    return (head, tail) if sep else (None, head)


def _symbol_offset(rest: str) -> tuple[str, int]:
    name, plus, digits = rest.partition("+")
    if plus and not _NUMBER.fullmatch(digits):
        raise SpecError(f"bad offset {digits!r} in {rest!r}", column=len(name) + 1, text=rest)
    return name, int(digits, 0) if plus else 0


class Uprobes(TraceTarget):
    """Kernel uprobes on one process (``pid=``) or on one file for every process (``path=``)."""

    events_file = "uprobe_events"
    profile_file = "uprobe_profile"
    is_kernel = False

    def __init__(
        self,
        *,
        pid: int | None = None,
        path: str | None = None,
        group: str | None = None,
        buffer_kb: int = 2048,
        sink: Sink | None = None,
    ) -> None:
        if (pid is None) == (path is None):
            raise TargetError("Uprobes needs exactly one of pid= or path=", errno=_errno.EINVAL)
        self.pid = pid
        self.path = os.path.realpath(path) if path is not None else None
        self._resolver: SymbolResolver | None = None
        self._image: ElfImage | None = None
        self._pidfd = -1
        self._exited = False
        if pid is not None:
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError as exc:
                raise TargetError(f"no process {pid}: {exc.strerror}", errno=exc.errno) from exc
            try:
                self._resolver = SymbolResolver(pid)
            except BaseException:
                os.close(self._pidfd)
                raise
        else:
            assert self.path is not None
            self._image = ElfImage.open(self.path)
        try:
            super().__init__(group=group, buffer_kb=buffer_kb, sink=sink)
            if pid is not None:
                self._follow(pid)
        except BaseException:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
            if getattr(self, "_buffers", None) is not None:
                self.close()
            raise

    def _check_available(self) -> None:
        if not self.fs.exists("uprobe_events"):
            raise TargetError(
                "this kernel was built without CONFIG_UPROBE_EVENTS (no uprobe_events in "
                f"{self.fs.root}); the Process target works without it",
                errno=_errno.ENOSYS,
            )

    def _follow(self, pid: int) -> None:
        """Record only this process's tasks, and the tasks they create later.

        ``event-fork`` adds every task a recorded task creates, threads and child processes
        alike, and a task that has exited can no longer be looked up in /proc. So the
        instance also records ``task/task_newtask`` (only for those same tasks): its
        ``clone_flags`` say whether the new task is a thread of ours (CLONE_THREAD) or a new
        process, whose events are then dropped.
        """
        try:
            tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
        except OSError as exc:
            raise TargetError(f"process {pid} is gone: {exc.strerror}", errno=exc.errno) from exc
        for tid in tids:
            self.tasks.tgids[int(tid)] = pid
        if self.session.exists("events", "task", "task_newtask", "format"):
            fmt = EventFormat.parse(self.session.read("events", "task", "task_newtask", "format"))
            self._watchers[fmt.id] = self.tasks.new_task_watcher(fmt)
            self.session.write("events/task/task_newtask/enable", "1")
        if self.session.exists("options", "event-fork"):
            self.session.write("options/event-fork", "1")
        self.session.write("set_event_pid", " ".join(tids))

    # -- places ----------------------------------------------------------------------------------

    def _resolve(self, probe: Kprobe, *, is_return: bool) -> ProbePoint:
        if is_return and probe.offset:
            raise ProbeRejected(
                f"a return probe goes on a function's entry, not at +{probe.offset:#x}",
                errno=_errno.EINVAL,
            )
        if probe.symbol:
            module, rest = _split(probe.symbol)
            if module is not None and _NUMBER.fullmatch(rest):
                return self._file_offset_point(module, int(rest, 0) + probe.offset)
            return self._symbol_point(module, rest, probe.offset)
        if probe.addr is None:
            raise ProbeRejected("a uprobe needs a symbol or an address", errno=_errno.EINVAL)
        return self._address_point(probe.addr + probe.offset)

    def _module_image(self, module: str | None) -> tuple[str, ElfImage, int]:
        """(path, image, load bias) of ``module`` (None: the executable or the path)."""
        if self._resolver is not None:
            found = self._resolver.main_module() if module is None else None
            if found is None:
                assert module is not None
                found = self._resolver.find_module(module)
            return found.path, found.image, found.bias
        assert self._image is not None and self.path is not None
        if module is None or os.path.realpath(module) == self.path:
            return self.path, self._image, 0
        if module.startswith("/"):
            return os.path.realpath(module), ElfImage.open(module), 0
        raise SymbolNotFound(
            f"{module!r}: a Uprobes(path=...) target names other files by absolute path"
        )

    def _symbol_point(self, module: str | None, rest: str, extra: int) -> ProbePoint:
        name, offset = _symbol_offset(rest)
        offset += extra
        path, image, bias = self._module_image(module)
        symbol = image.lookup(name)
        if symbol is None:
            raise SymbolNotFound(f"no symbol {name!r} in {path}")
        if symbol.size and offset >= symbol.size:
            raise ProbeRejected(
                f"offset {offset:#x} is past the end of {name} (size {symbol.size:#x})",
                errno=_errno.EINVAL,
            )
        vaddr = symbol.value + offset
        file_offset = image.vaddr_to_offset(vaddr)
        if file_offset is None:
            raise ProbeRejected(f"{name}+{offset:#x} is in no PT_LOAD of {path}")
        return ProbePoint(
            addr=bias + vaddr,
            display=f"{symbol.name}+{offset:#x}",
            module_name=os.path.basename(path),
            place=uprobe_place(path, file_offset),
            symbol=symbol.name,
            offset=offset,
            func_size=symbol.size,
        )

    def _file_offset_point(self, module: str, file_offset: int) -> ProbePoint:
        path, image, bias = self._module_image(module)
        vaddr = image.offset_to_vaddr(file_offset)
        if vaddr is None:
            raise ProbeRejected(f"file offset {file_offset:#x} is in no PT_LOAD of {path}")
        found = image.function_at(vaddr)
        name, offset, size = (found[0].name, found[1], found[0].size) if found else ("", 0, 0)
        return ProbePoint(
            addr=bias + vaddr,
            display=f"{name}+{offset:#x}" if name else f"{path}:{file_offset:#x}",
            module_name=os.path.basename(path),
            place=uprobe_place(path, file_offset),
            symbol=name,
            offset=offset,
            func_size=size,
        )

    def _address_point(self, addr: int) -> ProbePoint:
        if self._resolver is not None:
            location = self._resolver.locate_address(addr)
            module = location.module
            vaddr = addr - module.bias
            file_offset = module.image.vaddr_to_offset(vaddr)
            if file_offset is None:
                raise ProbeRejected(f"{addr:#x} is in no PT_LOAD of {module.path}")
            return self._file_offset_point(module.path, file_offset)
        assert self._image is not None and self.path is not None
        file_offset = self._image.vaddr_to_offset(addr)
        if file_offset is None:
            raise ProbeRejected(f"{addr:#x} is in no PT_LOAD of {self.path}")
        return self._file_offset_point(self.path, file_offset)

    def _probe_for_line(self, line: ProbeLine) -> AnyProbe:
        place = line.bare_place
        if place.endswith(")"):
            raise SpecError(
                "reference-counter offsets (SDT semaphores) are not supported",
                column=line.columns[0] + place.index("("),
                text=line.text,
            )
        if line.is_return:
            return Kretprobe(symbol=place)
        return Kprobe(symbol=place)

    # -- events ------------------------------------------------------------------------------------

    def _describe(self, addr: int, tid: int) -> str:
        if self._resolver is None:
            return f"{addr:#x}"
        try:
            location = self._resolver.locate_address(addr)
        except (SymbolNotFound, TargetError):
            return f"{addr:#x}"
        if location.symbol is None:
            return f"{addr:#x}"
        return f"{location.symbol.name}+{location.offset:#x}/{location.func_size:#x}"

    def _accepts(self, tgid: int) -> bool:
        # Every thread of the process is known (listed at start, or announced by
        # task_newtask): an unknown task that is gone already was a child process.
        return self.pid is None or tgid == self.pid

    def _extra_fds(self) -> list[int]:
        return [self._pidfd] if self._pidfd >= 0 else []

    def _is_finished(self) -> bool:
        if self._pidfd < 0:
            return self._exited
        if not self._exited:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            if poller.poll(0):
                self._exited = True
                for probe in self.iter_probes():
                    kp = probe.kp if isinstance(probe, Kretprobe) else probe
                    kp.flags |= ProbeFlags.GONE
        return self._exited

    @property
    def is_alive(self) -> bool:
        """For a pid target, whether the process still runs (always True for a path)."""
        return not self._is_finished()

    def _after_close(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = -1
