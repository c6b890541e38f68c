"""The other parts of a function, and where the C++ unwinder enters it, from its file.

gcc splits a function into its body ``foo`` and a cold part ``foo.cold`` (older gcc:
``foo.cold.0``, ``foo.cold.1``, ...) that jumps back into the body; the unwinder enters a
function of C++ at its landing pads, which the LSDA of each part's FDE lists. Code that is
entered from there must not be displaced by a jump (arch/x86_64/jumpopt.py), so the optimizer
on a live probe (process/fast/optimizer.py) and ``kprobes list -l`` on a file ask the same
question; this is its one answer, in link-time addresses, read from the file alone.
"""

from __future__ import annotations

from typing import Final

from kprobes.symbols.cfi import find_lsda
from kprobes.symbols.elf import ElfImage, Symbol
from kprobes.symbols.lsda import LsdaError, landing_pads
from kprobes.values import dataclass

_COLD_PARTS: Final = 8  # foo.cold.0 .. foo.cold.7: older gcc's names of a function's parts


@dataclass(frozen=True, slots=True)
class FunctionParts:
    """A function's parts other than the one asked about, and the landing pads of all."""

    others: tuple[Symbol, ...]  # sized functions; ``value`` is link-time
    pads: tuple[int, ...]  # link-time addresses


def function_parts(image: ElfImage, path: str, name: str, start: int) -> FunctionParts | str:
    """The parts of the function whose part ``name`` starts at ``start`` (in ``image``, whose
    file is ``path``): for ``foo`` its cold parts, for ``foo.cold`` ``foo`` and the rest. A
    str says why they cannot be known (an exception table this reader does not understand)."""
    base = name.partition(".cold")[0]
    names = [base, f"{base}.cold", *(f"{base}.cold.{n}" for n in range(_COLD_PARTS))]
    others: list[Symbol] = []
    pads: list[int] = []
    for part in names:
        for sym in image.lookup_all(part):
            if not sym.kind.is_function or sym.size <= 0:
                continue
            if sym.value != start:
                others.append(sym)
            found = find_lsda(path, sym.value)
            if found is None:
                continue
            fde_start, lsda = found
            try:
                pads += landing_pads(path, lsda, fde_start)
            except LsdaError as exc:
                return f"its exception table cannot be read ({exc})"
    return FunctionParts(tuple(others), tuple(pads))
