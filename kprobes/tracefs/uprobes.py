"""The Uprobes target: the kernel's uprobes on user programs, through ``uprobe_events``.

    with kprobes.Uprobes(pid=1234) as u:
        u.register_kprobe(Kprobe(symbol="libc:malloc", pre_handler=h), ["size=%di:u64"])
        u.run()          # until process 1234 exits

The kernel places a uprobe on a *file* and an offset *in the file*, not on a process and an
address: every process that maps the file hits it. So a symbol is resolved to its link-time
address (ELF symbol table) and then to the file offset through the PT_LOAD program header that
contains it (``ElfImage.vaddr_to_offset``); section headers and load biases play no part.

``Uprobes(path=...)`` probes a file for every process that runs it; the profile's count of
hits (``uprobe_profile``) is then every process's, as the kernel's.

``Uprobes(pid=...)`` resolves names in that process's mappings (``libc:malloc`` finds the libc
it loaded) and keeps only its events: the instance's ``set_event_pid`` holds its threads and
``options/event-fork`` adds the tasks they create, so other processes' hits are not even
recorded. Its children are told from its threads by the ``task_newtask`` records of the same
instance, and dropped, unless ``follow_forks=True``: then every process it starts from now
on, through fork, vfork, clone and exec, is kept too. ``run()`` returns True when the process
exits (its children are not waited for, as under perf). ``pids=`` keeps the events of several
processes, and ``run()`` returns when all have exited; names are resolved in the first's
mappings: a uprobe hangs on a file, and the others hit it where they map the same file.

``Uprobes(command=argv)`` runs a command and follows it and every process it starts, from
the first instruction of its exec (the dynamic loader's): the command is forked and held
before its exec (``held.py``) while its pid goes in the filter and the probes are placed,
so names are resolved in the files it will map (``programfiles.py``), and it is let go by
``start()`` or the first ``run()``. What its child records before its ``sched_process_exec``
(the Python between fork and exec) is dropped. ``pid`` is the command's; it is our child,
and the caller reaps it (``os.waitpid``) once ``run()`` has said it exited.

A probe's ``nhit`` is the kernel's count (``uprobe_profile``): every process that hit the
file's probe, followed or not. ``recorded_hits(probe)`` counts those of the processes followed
(``pid=``, ``command=``), as delivered; hits the buffer could not keep are ``lost_events()``
(the per-CPU ``overrun`` and ``dropped events``), in no probe's count. Once the process exits,
``run()`` reads the buffer to the end before it returns.

Places in definition lines (``add``) are the kernel's ``PATH:0xOFFSET`` (a file offset), or
``[MODULE:]SYMBOL[+OFFS]`` resolved as above.

With ``stack_depth=N`` each event carries its thread's user stack (``Event.stack``) as the
kernel's ``userstacktrace`` option records it: by frame pointers, 8 frames at most
(userstacks.py).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fnmatch
import os
import re
import struct
from collections import Counter
from collections.abc import Mapping, Sequence

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeError, ProbeRejected, SpecError, SymbolNotFound, TargetError
from kprobes.model import Event, UserStack
from kprobes.spec import (
    AddressLocation,
    Dereference,
    FetchArg,
    FileOffset,
    FileOffsetLocation,
    Location,
    MemorySymbol,
    ProbeArg,
    SymbolLocation,
    render_arg,
)
from kprobes.symbols.aliases import function_key, group_aliases
from kprobes.symbols.elf import ElfImage, SymbolKind, did_you_mean
from kprobes.symbols.resolve import SymbolResolver
from kprobes.tracefs import userstacks
from kprobes.tracefs.control import require_root
from kprobes.tracefs.eventformat import EventFormat
from kprobes.tracefs.held import HeldCommand
from kprobes.tracefs.lines import uprobe_location
from kprobes.tracefs.points import AnyProbe, ProbePoint
from kprobes.tracefs.programfiles import ProgramFiles, find_command
from kprobes.tracefs.target import Sink, TraceTarget
from kprobes.values import replace

_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")


def _split(text: str) -> tuple[str | None, str]:
    """``/a/b:rest`` → ("/a/b", "rest"); ``lib:rest`` → ("lib", "rest"); ``rest`` → (None, …)."""
    if text.startswith("/"):
        module, sep, rest = text.rpartition(":")
        return (module, rest) if sep else (text, "")
    head, sep, tail = text.partition(":")
    return (head, tail) if sep else (None, head)


def _names_symbol(fetch: FetchArg) -> bool:
    if isinstance(fetch, Dereference):
        return _names_symbol(fetch.base)
    return isinstance(fetch, MemorySymbol)


def _symbol_offset(rest: str) -> tuple[str, int]:
    name, plus, digits = rest.partition("+")
    if plus and not _NUMBER.fullmatch(digits):
        raise SpecError(f"bad offset {digits!r} in {rest!r}", column=len(name) + 1, text=rest)
    return name, int(digits, 0) if plus else 0


class Uprobes(TraceTarget):
    """Kernel uprobes on one process (``pid=``), on a command and what it starts
    (``command=``), or on one file for every process (``path=``)."""

    events_file = "uprobe_events"
    profile_file = "uprobe_profile"
    is_kernel = False

    def __init__(
        self,
        *,
        pid: int | None = None,
        pids: Sequence[int] = (),
        path: str | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        follow_forks: bool | None = None,
        group: str | None = None,
        buffer_kb: int = 2048,
        sink: Sink | None = None,
        stack_depth: int | None = None,
    ) -> None:
        if pids and pid is None:
            pid = pids[0]
        if sum(x is not None for x in (pid, path, command)) != 1:
            raise TargetError(
                "Uprobes needs exactly one of pid= (or pids=), path= or command=",
                errno=_errno.EINVAL,
            )
        require_root("tracing through tracefs")  # before a process's files are read
        self.path = os.path.realpath(path) if path is not None else None
        self._resolver: SymbolResolver | None = None
        self._image: ElfImage | None = None
        self._files: ProgramFiles | None = None
        self._held: HeldCommand | None = None
        # A command's first exec: its child's events before it are dropped (-1: not yet seen).
        self._exec_ns = -1
        self._is_cut_pending = command is not None
        self._hits: Counter[str] = Counter()  # event → hits recorded (pid=, command=)
        self._pages_read = 0
        self._resolvers: dict[int, SymbolResolver] = {}  # tgid → its symbols (_resolver_of)
        self._stale: set[int] = set()  # processes that exec'ed since their symbols were read
        self.follow_forks = command is not None if follow_forks is None else follow_forks
        if command is not None:
            if not command:
                raise TargetError("nothing to run: empty command", errno=_errno.EINVAL)
            environ = dict(os.environ if env is None else env)
            exe = find_command(command[0], environ)
            self._files = ProgramFiles.of_command(exe, environ)
            self._held = HeldCommand(exe, command, environ)
            pid = self._held.pid
        elif pid is not None:
            try:
                self._resolver = SymbolResolver(pid)
            except OSError as exc:
                raise TargetError(f"no process {pid}: {exc.strerror}", errno=exc.errno) from exc
        else:
            assert self.path is not None
            self._image = ElfImage.open(self.path)
        try:
            super().__init__(group=group, buffer_kb=buffer_kb, sink=sink, pid=pid, pids=pids)
            if self._held is not None:
                self._watch_execs()
            if stack_depth is not None:  # each event's user stack, by frame pointers
                userstacks.enable(self.fs, self.session, self._builders)
                self.attach_stacks = userstacks.Pairing(self._name_stack, stack_depth)
        except BaseException:
            if self._held is not None:
                self._held.abandon()
            if getattr(self, "session", None) is not None:
                self.close()
            raise

    @property
    def main_file(self) -> str | None:
        """The file a bare symbol names: the command's first image, the process's
        executable, or the one file probed (``path=``)."""
        if self._files is not None:
            return self._files.main.path
        if self.path is not None:
            return self.path
        try:
            return os.readlink(f"/proc/{self.pid}/exe")
        except OSError:
            return None

    def _check_available(self) -> None:
        if not self.fs.exists("uprobe_events"):
            raise TargetError(
                "this kernel was built without CONFIG_UPROBE_EVENTS (no uprobe_events in "
                f"{self.fs.root}); the Process target works without it",
                errno=_errno.ENOSYS,
            )

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

    def function_names(self, pattern: str) -> list[tuple[str, ...]]:
        module, sep, glob = pattern.rpartition(":")
        if self._resolver is not None:
            return self._resolver.function_names(pattern)
        path, image, _bias = self._module_image(module if sep else None)
        symbols = (s for s in image.iter_functions() if fnmatch.fnmatchcase(s.name, glob))
        matches = [
            (s.name, function_key(s.value, is_ifunc=s.kind is SymbolKind.IFUNC))
            for s in sorted(symbols, key=lambda s: s.name)
        ]
        prefix = (f"{module}:" if sep else "") if self._files is not None else f"{path}:"
        return [tuple(prefix + n for n in each) for each in group_aliases(matches)]

    def _module_image(self, module: str | None) -> tuple[str, ElfImage, int]:
        """(path, image, load bias) of ``module`` (None: the executable or the path)."""
        if self._resolver is not None:
            try:
                found = self._resolver.main_module() if module is None else None
                if found is None:
                    assert module is not None
                    found = self._resolver.find_module(module)
            except SymbolNotFound:
                if module is None or not module.startswith("/") or not os.path.isfile(module):
                    raise
                # A file the process has not mapped: some process of it may map it later.
                return os.path.realpath(module), ElfImage.open(module), 0
            return found.path, found.image, found.bias
        if self._files is not None:
            file = self._files.main if module is None else self._files.find(module)
            return file.path, file.image, 0
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
            raise SymbolNotFound(f"no symbol {name!r} in {path}{did_you_mean(image, name)}")
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
            place=uprobe_location(path, file_offset),
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
            place=uprobe_location(path, file_offset),
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
        if self._files is not None:
            raise ProbeRejected(
                f"{addr:#x}: an address means nothing before the command runs; name a symbol "
                "or a PATH:OFFSET",
                errno=_errno.EINVAL,
            )
        assert self._image is not None and self.path is not None
        file_offset = self._image.vaddr_to_offset(addr)
        if file_offset is None:
            raise ProbeRejected(f"{addr:#x} is in no PT_LOAD of {self.path}")
        return self._file_offset_point(self.path, file_offset)

    def _probe_for_location(self, location: Location, is_return: bool) -> AnyProbe:
        make = Kretprobe if is_return else Kprobe
        match location:
            case FileOffsetLocation(ref_ctr_offset=int()) | SymbolLocation(ref_ctr_offset=int()):
                raise ProbeRejected(
                    "reference-counter offsets (SDT semaphores) are not supported",
                    errno=_errno.EOPNOTSUPP,
                )
            case FileOffsetLocation(path=path, offset=offset):
                return make(symbol=f"{path}:{offset:#x}")
            case SymbolLocation(symbol=symbol, offset=offset, module=module):
                return make(symbol=f"{module}:{symbol}" if module else symbol, offset=offset)
            case AddressLocation(address=address):
                return make(addr=address)
        raise TypeError(f"not a location: {location!r}")

    def _render_args(self, probe: Kprobe, args: Sequence[ProbeArg]) -> tuple[str, ...]:
        """``@SYM`` becomes ``@+OFFSET``: the kernel refuses symbols in uprobes.

        The kernel reads ``@+OFFSET`` at (the probe's runtime address - its file offset) +
        OFFSET, so for a data symbol OFFSET is its link-time address minus (the probe's
        link-time address - its file offset): a data segment's addresses and file offsets
        differ by another amount, and its .bss has no file offset at all.
        """
        if not any(_names_symbol(arg.fetch) for arg in args) or not probe.symbol:
            return super()._render_args(probe, args)
        module, _rest = _split(probe.symbol)
        path, image, _bias = self._module_image(module)
        point = self._resolve(probe, is_return=False)
        assert isinstance(point.place, FileOffsetLocation)
        probe_vaddr = image.offset_to_vaddr(point.place.offset)
        assert probe_vaddr is not None
        base = probe_vaddr - point.place.offset

        def translate(fetch: FetchArg) -> FetchArg:
            match fetch:
                case MemorySymbol(symbol=name, offset=offset):
                    found = image.lookup(name)
                    if found is None:
                        raise SymbolNotFound(
                            f"no symbol {name!r} in {path}"
                            f"{did_you_mean(image, name, functions_only=False)}"
                        )
                    return FileOffset(found.value + offset - base)
                case Dereference(base=inner):
                    return replace(fetch, base=translate(inner))
            return fetch

        return tuple(render_arg(replace(arg, fetch=translate(arg.fetch))) for arg in args)

    # -- the processes followed -------------------------------------------------------------------

    def _accepts(self, tgid: int) -> bool:
        """With ``follow_forks`` every task the kernel records is of the tree followed (the
        filter holds nothing else); otherwise only the process's own threads."""
        return self.follow_forks or super()._accepts(tgid)

    def _watch_execs(self) -> None:
        """Record the execs of the followed tasks (``sched/sched_process_exec``), for the cut
        of the command's own first exec and for the names the tasks take at each exec."""
        if not self.session.exists("events", "sched", "sched_process_exec", "format"):
            raise TargetError(
                "this kernel has no sched/sched_process_exec event: a command cannot be "
                "followed from its exec (give -p PID of a running process)",
                errno=_errno.ENOSYS,
            )
        fmt = EventFormat.parse(
            self.session.read("events", "sched", "sched_process_exec", "format")
        )
        tid_at = fmt.field("common_pid").offset
        name_at = fmt.field("filename").offset
        unpack_tid = struct.Struct("<i").unpack_from
        unpack_loc = struct.Struct("<I").unpack_from
        root, tasks = self.pid, self.tasks

        def on_exec(page: bytes, start: int, ts: int, cpu: int) -> None:
            tid = unpack_tid(page, start + tid_at)[0]
            if tid == root and self._exec_ns < 0:
                self._exec_ns = ts
            # The kernel names the task after the file it runs (kbasename of the filename).
            loc = unpack_loc(page, start + name_at)[0]
            begin, size = start + (loc & 0xFFFF), loc >> 16
            name = page[begin : begin + max(size - 1, 0)].split(b"\0")[0]
            tasks.comms[tid] = os.path.basename(name).decode(errors="replace")[:15]
            tasks.known.pop(tid, None)
            self._stale.add(tid)

        self._builders[fmt.id] = on_exec  # a record that makes no Event
        self.session.write("events/sched/sched_process_exec/enable", "1")

    def start(self) -> None:
        """Let a ``command=`` run (placed probes are live from its first instruction); once
        only, and a no-op for other targets. Raises ``TargetError`` if it cannot exec."""
        if self._held is not None and self._held.is_held:
            self._held.release()
            assert self.pid is not None
            with contextlib.suppress(OSError, ProbeError):
                self._resolvers[self.pid] = SymbolResolver(self.pid)  # its exe, the loader

    def decode_pages(
        self, pages: Sequence[tuple[int, bytes]], *, final: bool = True
    ) -> list[Event]:
        events = super().decode_pages(pages, final=final)
        if self._is_cut_pending and events:
            # The command's child before its exec: every event of it until the exec record
            # is seen, then those older than the exec (the batch is in time order).
            root, cut = self.pid, self._exec_ns / 1e9
            if self._exec_ns < 0:
                events = [ev for ev in events if ev.tid != root]
            else:
                events = [ev for ev in events if ev.tid != root or ev.timestamp > cut]
                self._is_cut_pending = False
        if self.pid is not None:
            self._hits.update(ev.event for ev in events)
        return events

    def read_pages(self) -> list[tuple[int, bytes]]:
        pages = super().read_pages()
        self._pages_read = len(pages)
        return pages

    def run(self, timeout: float | None = None) -> bool:
        """Deliver events until ``stop()``, the exit of the process, or ``timeout``; starts a
        ``command=`` first. Once the process has exited, the buffer is read to its end."""
        self.start()
        finished = super().run(timeout)
        if finished and self._exited and self.session.is_open:
            try:
                while self._pages_read:  # the rest, batch after batch
                    self.poll()
            finally:
                with contextlib.suppress(ProbeError):
                    self.update_counts()
        return finished

    def recorded_hits(self, event: str) -> int:
        """The hits of the event ``event`` (``get_event_name(probe)``) recorded for the
        processes followed (``pid=``/``command=``), during and after the session: what
        ``nhit``, the kernel's profile count of every process on the machine, is not."""
        return self._hits[event]

    def lost_events(self) -> int:
        """Events the kernel recorded and could not keep (a full buffer), every CPU."""
        return max(self.session.lost_events(), self.lost, 0)

    def _after_close(self) -> None:
        if self._held is not None:
            self._held.abandon()  # never released: it exits without running the command

    # -- events ------------------------------------------------------------------------------------

    def _resolver_of(self, tid: int) -> SymbolResolver | None:
        """The symbols of thread ``tid``'s process, for the return addresses of its events.

        ``pid=``: the process's, read at the start. A process of the tree has its own layout
        (ASLR at each exec), so it gets its own, read from /proc while it lives and again
        after it execs; a ``command=``'s is first read at its exec (its executable and the
        loader: enough for its own functions once it has exited).
        """
        tgid = self.tasks.tgid(tid) or tid
        if self._files is None and (tgid == self.pid or self.pid is None):
            return self._resolver
        resolver = self._resolvers.get(tgid)
        if resolver is None or tgid in self._stale:
            self._stale.discard(tgid)
            with contextlib.suppress(OSError, ProbeError):
                fresh = SymbolResolver(tgid)
                if fresh.modules():  # an exited process shows no mappings: keep the old
                    resolver = self._resolvers[tgid] = fresh
        return resolver

    def _name_stack(self, addrs: Sequence[int], tid: int) -> UserStack:
        """A user stack the kernel recorded, named in thread ``tid``'s process (read again
        once if an address is in none of its files: a library loaded since)."""
        resolver = self._resolver_of(tid)
        if resolver is not None and any(resolver.get_module_at(a) is None for a in addrs):
            with contextlib.suppress(OSError, ProbeError):
                resolver.refresh()
        try:
            main = None if resolver is None else resolver.main_module().path
        except ProbeError:
            main = self.main_file
        return userstacks.name_frames(addrs, resolver, main)

    def _describe(self, addr: int, tid: int) -> str:
        resolver = self._resolver_of(tid)
        if resolver is None:
            return f"{addr:#x}"
        try:
            location = resolver.locate_address(addr)
        except (SymbolNotFound, TargetError):
            return f"{addr:#x}"
        if location.symbol is None:
            return f"{addr:#x}"
        return f"{location.symbol.name}+{location.offset:#x}/{location.func_size:#x}"

    def _describe_return(self, addr: int, tid: int, func_ip: int, event: str) -> str:
        """A return address; when the process's mappings were never read (a command that
        ran and exited before we could, ``-c 'prog 4'``), the probed function's own file
        places it: the event gives the function's address, so that file's load bias, and a
        return into the same file (the usual caller) is found in its symbols."""
        where = self._describe(addr, tid)
        if not where.startswith("0x") or not func_ip:
            return where
        reg = next((r for r in self._by_id.values() if r.event == event), None)
        place = reg.point.place if reg is not None else None
        if not isinstance(place, FileOffsetLocation):
            return where
        try:
            image = ElfImage.open(place.path)
        except (OSError, ValueError, ProbeError):
            return where
        func_vaddr = image.offset_to_vaddr(place.offset)
        if func_vaddr is None:
            return where
        found = image.function_at(addr - (func_ip - func_vaddr))
        if found is None:
            return where
        symbol, offset = found
        return f"{symbol.name}+{offset:#x}/{symbol.size:#x}"
