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

import errno as _errno
import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import replace

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeRejected, SpecError, SymbolNotFound, TargetError
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
from kprobes.symbols.elf import ElfImage
from kprobes.symbols.resolve import SymbolResolver
from kprobes.tracefs.lines import uprobe_location
from kprobes.tracefs.points import AnyProbe, ProbePoint
from kprobes.tracefs.target import Sink, TraceTarget

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
        self.path = os.path.realpath(path) if path is not None else None
        self._resolver: SymbolResolver | None = None
        self._image: ElfImage | None = None
        if pid is not None:
            try:
                self._resolver = SymbolResolver(pid)
            except OSError as exc:
                raise TargetError(f"no process {pid}: {exc.strerror}", errno=exc.errno) from exc
        else:
            assert self.path is not None
            self._image = ElfImage.open(self.path)
        super().__init__(group=group, buffer_kb=buffer_kb, sink=sink, pid=pid)

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

    def function_names(self, pattern: str) -> list[str]:
        module, sep, glob = pattern.rpartition(":")
        if self._resolver is not None:
            found = self._resolver.iter_functions(glob, module if sep else None)
            names = list(dict.fromkeys(f.symbol.name for f in found if f.symbol is not None))
            return [f"{module}:{name}" if sep else name for name in names]
        path, image, _bias = self._module_image(module if sep else None)
        matches = {s.name for s in image.iter_functions() if fnmatch.fnmatchcase(s.name, glob)}
        return [f"{path}:{name}" for name in sorted(matches)]

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
                        raise SymbolNotFound(f"no symbol {name!r} in {path}")
                    return FileOffset(found.value + offset - base)
                case Dereference(base=inner):
                    return replace(fetch, base=translate(inner))
            return fetch

        return tuple(render_arg(replace(arg, fetch=translate(arg.fetch))) for arg in args)

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
