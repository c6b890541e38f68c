"""Which functions of an ELF file can be probed, and how, judged from the file alone.

``kprobes list -l`` says what ``count 'lib:*'`` would do with each function without stopping
or tracing anyone: the checks that registration (engine/arming.py) and the optimizer
(fast/optimizer.py) make on a live entry probe, run on the file's bytes, which are the
original code by construction (STYLE §6). The answers, as ``How``:

JUMP        the entry can take a jump to a detour: no trap per hit;
BREAKPOINT  an int3 only, because the optimizer would refuse the jump (``why``: too few bytes
            to the function's end, a size the symbol does not give, a jump into the region);
IFUNC       a GNU ifunc: the probe goes on the implementation the program's resolver
            returns, which only the running program can say, so it is judged when placed;
REFUSED     registration would refuse it (``why``: its first instruction cannot run out of
            line, or it is not in executable code);
PROBEABLE   not refused, and how it would be probed was not asked (the jump's checks decode
            the whole function: the one costly part, which a plain list of names skips).

What only a live process can tell is not judged: a detour out of reach, another tool's
breakpoint, the blacklist (the Process target's holds kprobes' own anonymous pages and what
an API user adds to one session: never a function of a file).

Rejected: attaching to the process and asking the Process target, probe by probe (the
listing would stop the program, and a process nobody may trace could not be listed);
decoding only the first instruction (fast, but "jump" or "breakpoint" would then be a guess:
the optimizer decodes the whole function, so the listing does).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Final

from kprobes.arch.x86_64.jumpopt import Refusal, find_region
from kprobes.arch.x86_64.plan import plan_instruction
from kprobes.errors import ProbeRejected, TargetError
from kprobes.symbols.elf import ElfImage, Symbol, SymbolKind
from kprobes.symbols.parts import function_parts
from kprobes.values import dataclass

_PF_X: Final = 1
_HEAD: Final = 16  # the bytes registration decodes at a probe point (arming.prepare)
_IFUNC: Final = "placed on the implementation its resolver returns, judged then"
_IFUNC_STRIPPED: Final = (
    "placed on the implementation its resolver returns, which has no size in a file "
    "without .symtab: a breakpoint"
)


class How(Enum):
    """How ``count`` would probe a function's entry."""

    JUMP = "jump"
    BREAKPOINT = "breakpoint"
    IFUNC = "ifunc"
    REFUSED = "refused"
    PROBEABLE = "probeable"

    @property
    def is_probeable(self) -> bool:
        return self is not How.REFUSED


@dataclass(frozen=True, slots=True)
class Verdict:
    """One function of the file: its name, how it would be probed, and why not better."""

    name: str
    how: How
    why: str = ""


class FileJudge:
    """Judges the functions of one ELF file (named ``path`` in what it says); ``bias`` turns
    its addresses into the ones a process shows (0: the file's own), so that the reasons name
    what ``count`` would. ``no_jump``: why every probe keeps its int3 ("": none)."""

    def __init__(
        self,
        image: ElfImage,
        path: str,
        *,
        bias: int = 0,
        no_jump: str = "",
        read_from: str | None = None,
    ) -> None:
        self.image = image
        self.path = path
        # Where the bytes are read now. Not always ``image.path``: images are cached by the
        # file's identity, and the path one was first read by may be gone since (the
        # /proc/PID/root/... of a process that has exited).
        self.read_from = read_from or image.path
        self.bias = bias
        self.no_jump = no_jump
        self._data: bytes | mmap.mmap = b""

    def __enter__(self) -> FileJudge:
        try:
            with open(self.read_from, "rb") as stream:
                self._data = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            raise TargetError(f"cannot read {self.read_from}: {exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        if isinstance(self._data, mmap.mmap):
            self._data.close()
        self._data = b""

    def iter_verdicts(self, names: Iterable[str], *, how: bool = True) -> Iterator[Verdict]:
        """A verdict for each function name, in the order given."""
        for name in names:
            yield self.judge(name, how=how)

    def judge(self, name: str, *, how: bool = True) -> Verdict:
        """What registering an entry probe on ``name`` (then optimizing it) would do; without
        ``how``, only whether registration would refuse it (``How.PROBEABLE`` if not)."""
        symbol = self.image.lookup(name)  # the symbol ``count`` resolves the name to
        if symbol is None or not symbol.kind.is_function:
            return Verdict(name, How.REFUSED, f"no function {name!r} in {self.path}")
        if symbol.kind is SymbolKind.IFUNC:
            return Verdict(
                name, How.IFUNC, _IFUNC if ".symtab" in self.image.tables else _IFUNC_STRIPPED
            )
        addr = self.bias + symbol.value
        code = self._code(symbol)
        if code is None:
            return Verdict(
                name, How.REFUSED, f"{addr:#x} ({symbol.name}+0x0) is not in executable code"
            )
        # Step 1: the first instruction must run out of line (arming.prepare's plan).
        try:
            plan_instruction(code[:_HEAD], addr, has_post_handler=False)
        except ProbeRejected as exc:
            return Verdict(name, How.REFUSED, exc.message)
        if not how:
            return Verdict(name, How.PROBEABLE)
        if self.no_jump:
            return Verdict(name, How.BREAKPOINT, self.no_jump)
        # Step 2: the region the jump would displace (the optimizer's _optimize, Step 1).
        why = self._why_no_jump(symbol, addr, code)
        if why is not None:
            return Verdict(name, How.BREAKPOINT, why)
        return Verdict(name, How.JUMP)

    def _code(self, symbol: Symbol) -> bytes | None:
        """The function's original bytes (at least ``_HEAD``), or None when they are not in
        an executable segment of the file."""
        vaddr = symbol.value
        for seg in self.image.segments:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                if not seg.flags & _PF_X:
                    return None
                start = seg.offset + (vaddr - seg.vaddr)
                return bytes(self._data[start : start + max(symbol.size, _HEAD)])
        return None

    def _why_no_jump(self, symbol: Symbol, addr: int, code: bytes) -> str | None:
        size = symbol.size
        fragments: list[tuple[int, bytes]] = []
        pads: list[int] = []
        at = self.image.function_at(symbol.value) if size > 0 else None
        if at is not None:  # the parts that may jump into the region (the optimizer's too)
            parts = function_parts(self.image, self.image.path, at[0].name, symbol.value)
            if isinstance(parts, str):
                return parts
            for other in parts.others:
                other_code = self._code(other)
                if other_code is not None:
                    fragments.append((self.bias + other.value, other_code[: other.size]))
            pads = [self.bias + pad for pad in parts.pads]
        region = find_region(code, addr, addr, size, fragments=fragments, entries=pads)
        return region.reason if isinstance(region, Refusal) else None
