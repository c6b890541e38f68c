"""The running kernel's symbols, from /proc/kallsyms: names to addresses and back.

The Kernel target needs three answers before it writes a probe line: does this function
exist (so that a typo is refused with ENOENT and a sentence, not an EINVAL from the kernel),
is the name unique (the kernel refuses ambiguous names), and where is it (to check the
blacklist ranges of debugfs ``kprobes/blacklist``). Decoding events needs the fourth:
``sym+off/size`` of a return address, as the kernel prints ``%pS``.

The file has a quarter of a million lines with modules loaded. A name lookup is a single
``bytes.find`` over the raw text (tens of microseconds); the sorted address table is built
only on the first address lookup. A symbol's size is the distance to the next symbol of the
same module, as the kernel's own ``kallsyms_lookup_size_offset`` computes it. Addresses read
as zero when ``kptr_restrict`` hides them from this user, and the table then refuses to
answer rather than guess.
"""

from __future__ import annotations

import bisect
import errno as _errno
import fnmatch
from typing import Final

from kprobes.errors import SymbolNotFound, TargetError
from kprobes.values import dataclass

KALLSYMS: Final = "/proc/kallsyms"
_TEXT_TYPES: Final = (b"t", b"T", b"w", b"W")


@dataclass(frozen=True, slots=True)
class KernelSymbol:
    name: str
    addr: int
    size: int  # distance to the next symbol; 0 for the last one
    module: str  # "" for vmlinux

    def describe(self, addr: int) -> str:
        """``name+0xoff/0xsize`` (with ``[module]``), the kernel's ``%pS`` of ``addr``."""
        text = f"{self.name}+{addr - self.addr:#x}/{self.size:#x}"
        return f"{text} [{self.module}]" if self.module else text


class Kallsyms:
    """A snapshot of /proc/kallsyms (take a new one after loading a module)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._starts: list[int] | None = None
        self._rows: list[tuple[int, str, str]] = []  # (addr, name, module), sorted

    @classmethod
    def read(cls, path: str = KALLSYMS) -> Kallsyms:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise TargetError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc
        table = cls(data)
        # Per-CPU symbols legitimately sit at 0; the kernel's text never does.
        text = table.lookup_all("_stext") or table.lookup_all("_text")
        if text and all(symbol.addr == 0 for symbol in text):
            raise TargetError(
                f"{path} shows every address as zero (kptr_restrict): run as root",
                errno=_errno.EPERM,
            )
        return table

    def lookup_all(self, name: str) -> list[KernelSymbol]:
        """Every text symbol called ``name`` (``mod:name`` limits it to one module)."""
        module, _, bare = name.rpartition(":")
        data, needle = self._data, b" " + bare.encode()
        found = []
        pos = data.find(needle)
        while pos >= 0:
            end = pos + len(needle)
            line_start = data.rfind(b"\n", 0, pos) + 1
            kind = data[pos - 1 : pos]
            if (
                (end == len(data) or data[end] in b"\n\t")
                and kind in _TEXT_TYPES
                and pos - line_start > 2
            ):
                line_end = data.find(b"\n", end)
                line_end = len(data) if line_end < 0 else line_end
                mod = data[end:line_end].strip().strip(b"[]").decode()
                if not module or mod == module:
                    addr = int(data[line_start : pos - 2], 16)
                    size = self._size_after(line_end, addr)
                    found.append(KernelSymbol(bare, addr, size, mod))
            pos = data.find(needle, end)
        return found

    def iter_function_addrs(self, pattern: str, module: str | None = None) -> list[tuple[str, int]]:
        """``(name, address)`` of the text symbols whose names match the glob ``pattern``,
        sorted (``module`` limits them to one module; "" is vmlinux itself). An address is
        0 where kptr_restrict hides it: symbols/aliases.py then groups nothing."""
        found = []
        for line in self._data.split(b"\n"):
            parts = line.split()
            if len(parts) < 3 or parts[1] not in _TEXT_TYPES:
                continue
            mod = parts[3].strip(b"[]").decode() if len(parts) > 3 else ""
            if module is not None and mod != module:
                continue
            name = parts[2].decode()
            if fnmatch.fnmatchcase(name, pattern):
                found.append((name, int(parts[0], 16)))
        return sorted(found)

    def _size_after(self, pos: int, addr: int) -> int:
        """Distance to the first following line with a higher address (lines are sorted)."""
        data = self._data
        while pos < len(data):
            nxt = data.find(b" ", pos + 1)
            if nxt < 0:
                break
            following = int(data[pos + 1 : nxt], 16)
            if following > addr:
                return following - addr
            pos = data.find(b"\n", nxt)
            if pos < 0:
                break
        return 0

    def lookup(self, name: str) -> KernelSymbol:
        """The one text symbol called ``name``; SymbolNotFound if none, ProbeRejected-like
        SymbolNotFound with EADDRNOTAVAIL if several (the kernel refuses those too)."""
        found = self.lookup_all(name)
        if not found:
            raise SymbolNotFound(f"no kernel function {name!r} in {KALLSYMS}")
        if len(found) > 1:
            where = ", ".join(f"{s.addr:#x}" for s in found[:6])
            raise SymbolNotFound(
                f"{len(found)} kernel functions are called {name!r} ({where}): the kernel "
                "refuses an ambiguous name; probe one of them by address",
                errno=_errno.EADDRNOTAVAIL,
            )
        return found[0]

    def _table(self) -> tuple[list[int], list[tuple[int, str, str]]]:
        if self._starts is None:
            rows = []
            for line in self._data.split(b"\n"):
                parts = line.split()
                if len(parts) < 3:
                    continue
                module = parts[3].strip(b"[]").decode() if len(parts) > 3 else ""
                rows.append((int(parts[0], 16), parts[2].decode(), module))
            rows.sort()
            self._rows = rows
            self._starts = [r[0] for r in rows]
        return self._starts, self._rows

    def _size_at(self, addr: int) -> int:
        starts, _rows = self._table()
        i = bisect.bisect_right(starts, addr)
        while i < len(starts) and starts[i] == addr:
            i += 1
        return starts[i] - addr if i < len(starts) else 0

    def get_symbol_at(self, addr: int) -> KernelSymbol | None:
        """The symbol holding ``addr`` (the last one starting at or below it), or None."""
        starts, rows = self._table()
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0:
            return None
        start, name, module = rows[i]
        return KernelSymbol(name, start, self._size_at(start), module)

    def describe(self, addr: int) -> str:
        """``%pS`` of ``addr``: ``func+0xoff/0xsize``, or the bare hex address."""
        symbol = self.get_symbol_at(addr)
        return symbol.describe(addr) if symbol is not None else f"{addr:#x}"
