"""Symbol names to runtime addresses in one process, and addresses back to names.

The resolver answers the first step of registration ("where is ``lib:func+0x10`` in this
process?") and the last step of reporting ("what is at 0x7f...?"). It holds a snapshot of the
process's modules, taken from /proc/PID/maps, which the caller refreshes after dlopen() or
exec; it never stops or reads the process itself.

A bare function name is looked up in the main executable only, as uprobes and the kernel's
``kprobe_events`` bind a name to one object: searching every library would make
``read`` silently mean libc's when the program has none of its own. Other objects are named
explicitly: ``libc:malloc``, ``libc.so.6:malloc`` or ``/usr/lib/.../libc.so.6:malloc``.
"""

from __future__ import annotations

import bisect
import errno
import fnmatch
import os
from collections.abc import Iterator

from kprobes.errors import NotMapped, ProbeRejected, SpecError, SymbolNotFound, TargetError
from kprobes.symbols.aliases import function_key, group_aliases
from kprobes.symbols.elf import ElfImage, Symbol, SymbolKind, did_you_mean
from kprobes.symbols.maps import Mapping, Module, iter_modules, read_maps
from kprobes.values import dataclass


@dataclass(frozen=True, slots=True)
class Location:
    """A resolved probe point: where it is, and which function it belongs to."""

    addr: int  # runtime address
    module: Module
    symbol: Symbol | None  # None for an address outside every known function
    offset: int  # addr - (module.bias + symbol.value); 0 without a symbol
    func_start: int  # runtime start of the containing function, or addr if unknown
    func_size: int  # 0 if unknown

    @property
    def display(self) -> str:
        """``symbol+0xoff`` as kprobes/list shows it, or the bare hex address."""
        if self.symbol is None:
            return f"{self.addr:#x}"
        return f"{self.symbol.name}+{self.offset:#x}"


@dataclass(frozen=True, slots=True)
class _SymbolText:
    """``[module:]function[+offset]``, split but not yet resolved."""

    module: str | None
    function: str
    offset: int


def _parse_offset(text: str, digits: str, column: int) -> int:
    try:
        return int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 10)
    except ValueError:
        raise SpecError(f"bad offset {digits!r} in {text!r}", column=column, text=text) from None


def _split_symbol(text: str) -> _SymbolText:
    """Split ``lib:func+0x10``; a path module ("/a/b:func") is split at its last colon."""
    module: str | None
    if text.startswith("/"):
        module, sep, rest = text.rpartition(":")
        if not sep:
            raise SpecError(
                f"{text!r} names a file but no symbol in it", column=len(text), text=text
            )
    else:
        head, sep, tail = text.partition(":")
        module, rest = (head, tail) if sep else (None, head)
    rest_column = len(text) - len(rest)
    function, plus, digits = rest.partition("+")
    if not function:
        raise SpecError(f"no symbol name in {text!r}", column=rest_column, text=text)
    if module == "":
        raise SpecError(f"empty module name in {text!r}", column=0, text=text)
    offset = _parse_offset(text, digits, rest_column + len(function) + 1) if plus else 0
    return _SymbolText(module, function, offset)


def _stems(basename: str) -> tuple[str, str]:
    """("libc-2.36", "libc") for libc-2.36.so; ("libc", "libc") for libc.so.6."""
    so = basename.find(".so")
    stem = basename[:so] if so > 0 else basename
    dash = stem.find("-")
    return stem, stem[:dash] if dash > 0 else stem


def _is_same_file(mapping: Mapping, st: os.stat_result) -> bool:
    major, _, minor = mapping.dev.partition(":")
    try:
        dev = os.makedev(int(major, 16), int(minor, 16))
    except ValueError:
        return False
    return mapping.inode == st.st_ino and dev == st.st_dev


class SymbolResolver:
    """Resolves symbols of one process against a snapshot of its mapped modules."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._modules: list[Module] = []
        self._mappings: list[tuple[Mapping, Module]] = []
        self._starts: list[int] = []  # of self._mappings
        self._main: Module | None = None
        self._maps: list[Mapping] | None = None
        self.generation = 0  # changes whenever the modules do (what names addresses may cache)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the process's mappings (after dlopen(), dlclose() or exec); the modules
        are rebuilt only if the mappings changed."""
        maps = read_maps(self.pid)
        if maps == self._maps:
            return
        self._maps = maps
        self._modules = sorted(iter_modules(self.pid, maps), key=lambda m: m.start)
        self._mappings = sorted(
            ((mapping, module) for module in self._modules for mapping in module.mappings),
            key=lambda pair: pair[0].start,
        )
        self._starts = [mapping.start for mapping, _module in self._mappings]
        self._main = None
        self.generation += 1

    def modules(self) -> list[Module]:
        return list(self._modules)

    def main_module(self) -> Module:
        """The module of the executable, as /proc/PID/exe names it."""
        if self._main is None:
            self._main = self._find_main()
        return self._main

    def _find_main(self) -> Module:
        exe_link = f"/proc/{self.pid}/exe"
        try:
            exe = os.readlink(exe_link)
            st = os.stat(exe_link)
        except OSError as exc:
            raise TargetError(
                f"cannot read the executable of process {self.pid}: {exc.strerror}",
                errno=exc.errno,
            ) from exc
        for module in self._modules:
            if module.path == exe:
                return module
        for module in self._modules:  # the path differs when seen across mount namespaces
            if any(_is_same_file(m, st) for m in module.mappings):
                return module
        raise TargetError(f"the executable of process {self.pid} ({exe}) is not a mapped ELF file")

    def find_module(self, name: str) -> Module:
        """The module called ``name``: a path, a basename, or a short name like "libc".

        Short names match the basename up to ".so" ("libc-2.36" for libc-2.36.so) or up to
        the first "-" ("libc", "ld"). The most exact kind of match wins; two different files
        matching equally well are refused rather than guessed between.
        """
        tiers: tuple[list[Module], ...] = ([], [], [], [])
        same_file = self._stat_for_path(name) if "/" in name else None
        for module in self._modules:
            if "/" in name:
                if module.path in (name, name + " (deleted)") or (
                    same_file is not None
                    and any(_is_same_file(m, same_file) for m in module.mappings)
                ):
                    tiers[0].append(module)
                continue
            basename = module.name
            stem, short = _stems(basename)
            if basename == name:
                tiers[1].append(module)
            elif stem == name:
                tiers[2].append(module)
            elif short == name or basename.startswith(name + "."):
                tiers[3].append(module)
        for tier in tiers:
            paths = sorted({module.path for module in tier})
            if len(paths) == 1:
                return tier[0]
            if len(paths) > 1:
                raise SymbolNotFound(f"module name {name!r} is ambiguous: {', '.join(paths)}")
        mapped = ", ".join(sorted({module.name for module in self._modules}))
        if "/" in name and same_file is None:
            raise SymbolNotFound(f"no file {name} (in the view of process {self.pid})")
        raise NotMapped(f"no module {name!r} is mapped in process {self.pid} (mapped: {mapped})")

    def _check_file_has(self, path: str, function: str) -> None:
        """A file named by path and not mapped yet: it must be ELF and hold ``function``
        (else no load can ever make the probe match: an error now, not a pending probe)."""
        inside = f"/proc/{self.pid}/root{path}"
        image = ElfImage.open(inside if os.path.exists(inside) else path)
        if image.lookup(function) is None:
            searched = ", ".join(image.tables) or "no symbol table: the file is stripped"
            raise SymbolNotFound(
                f"no symbol {function!r} in {path} (searched {searched})"
                f"{did_you_mean(image, function)}"
            )

    def _stat_for_path(self, path: str) -> os.stat_result | None:
        for candidate in (f"/proc/{self.pid}/root{path}", path):
            try:
                return os.stat(candidate)
            except OSError:
                continue
        return None

    def resolve(self, symbol: str, offset: int = 0) -> Location:
        """The probe point ``[module:]function[+off]`` plus ``offset``.

        An IFUNC symbol is returned as it is (its value is the resolver, not the
        implementation); the caller decides whether to run it and call locate_address().
        """
        text = _split_symbol(symbol)
        try:
            module = self.main_module() if text.module is None else self.find_module(text.module)
        except NotMapped:
            if text.module is not None and "/" in text.module:
                self._check_file_has(text.module, text.function)
            raise
        image = module.image
        found = image.lookup(text.function)
        if found is None:
            searched = ", ".join(image.tables) or "no symbol table: the file is stripped"
            raise SymbolNotFound(
                f"no symbol {text.function!r} in {module.path} (searched {searched})"
                f"{did_you_mean(image, text.function)}"
            )
        total = text.offset + offset
        if total < 0:
            raise ProbeRejected(
                f"offset {total:#x} is before the start of {found.name}", errno=errno.EINVAL
            )
        if found.size and total >= found.size:
            raise ProbeRejected(
                f"offset {total:#x} is past the end of {found.name} (size {found.size:#x})",
                errno=errno.EINVAL,
            )
        start = module.bias + found.value
        return Location(
            addr=start + total,
            module=module,
            symbol=found,
            offset=total,
            func_start=start,
            func_size=found.size,
        )

    def get_module_at(self, addr: int) -> Module | None:
        """The module with a mapping holding ``addr``, or None."""
        # Mappings never overlap, so the last one starting at or below addr is the only
        # candidate, whichever module it belongs to.
        index = bisect.bisect_right(self._starts, addr) - 1
        if index < 0:
            return None
        mapping, module = self._mappings[index]
        return module if addr < mapping.end else None

    def locate_address(self, addr: int) -> Location:
        """The module and function holding the runtime address ``addr``."""
        module = self.get_module_at(addr)
        if module is None:
            raise SymbolNotFound(f"{addr:#x} is not in any mapped ELF file")
        found = module.image.function_at(addr - module.bias)
        if found is None:
            return Location(addr, module, None, 0, addr, 0)
        symbol, offset = found
        return Location(addr, module, symbol, offset, addr - offset, symbol.size)

    def describe(self, addr: int) -> str:
        """``func+0x12`` for an address inside a known function, else ``0x...``."""
        module = self.get_module_at(addr)
        found = None if module is None else module.image.function_at(addr - module.bias)
        if found is None:
            return f"{addr:#x}"
        symbol, offset = found
        return f"{symbol.name}+{offset:#x}"

    def iter_functions(self, pattern: str = "*", module: str | None = None) -> Iterator[Location]:
        """Entry points of the functions whose names match the glob ``pattern``.

        The main executable is searched unless ``module`` names another one.
        """
        target = self.main_module() if module is None else self.find_module(module)
        for symbol in target.image.iter_functions():
            if fnmatch.fnmatchcase(symbol.name, pattern):
                start = target.bias + symbol.value
                yield Location(start, target, symbol, 0, start, symbol.size)

    def function_aliases(
        self, pattern: str = "*", module: str | None = None
    ) -> list[tuple[str, ...]]:
        """The functions ``iter_functions`` finds, each as the names of its address, the
        row's name first (aliases.py)."""
        return group_aliases(
            (loc.symbol.name, function_key(loc.addr, is_ifunc=loc.symbol.kind is SymbolKind.IFUNC))
            for loc in self.iter_functions(pattern, module)
            if loc.symbol is not None
        )

    def function_names(self, pattern: str) -> list[tuple[str, ...]]:
        """The functions matching ``[MODULE:]GLOB``, each as its names (``function_aliases``),
        ``MODULE:`` kept in each when it is given: what a glob of the command line places."""
        module, sep, glob = pattern.rpartition(":")
        found = self.function_aliases(glob, module if sep else None)
        return [tuple(f"{module}:{n}" if sep else n for n in each) for each in found]
