"""Where a symbol of the target lives: as an offset from its lowest mapping, and in its file.

Two peers need two different numbers for the same instruction. The ptrace peers (the C floor,
python-ptrace) add an offset to the start of the program's lowest mapping, which they read from
``/proc/PID/maps`` at the exec stop; the kernel's uprobes want the offset in the file. Both come
from the ELF's ``PT_LOAD`` headers, so the harness computes them once here with pyelftools.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

PAGE = 4096


@dataclass(frozen=True, slots=True)
class Site:
    """One probed instruction of a binary."""

    vaddr: int  # the link-time address (st_value + offset)
    map_offset: int  # from the start of the lowest mapping of the binary
    file_offset: int  # in the file, for uprobe_events


def find_site(path: Path, symbol: str, offset: int = 0) -> Site:
    """Locate ``symbol+offset`` in the ELF file at ``path``; KeyError if there is no such symbol."""
    with path.open("rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        if not isinstance(symtab, SymbolTableSection):
            raise KeyError(f"{path} has no .symtab")
        matches = symtab.get_symbol_by_name(symbol)
        if not matches:
            raise KeyError(f"{symbol} not in {path}")
        vaddr = matches[0]["st_value"] + offset
        loads = [seg.header for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"]
    lowest = min(h["p_vaddr"] for h in loads) & ~(PAGE - 1)
    for h in loads:
        if h["p_vaddr"] <= vaddr < h["p_vaddr"] + h["p_filesz"]:
            file_offset = vaddr - h["p_vaddr"] + h["p_offset"]
            return Site(vaddr=vaddr, map_offset=vaddr - lowest, file_offset=file_offset)
    raise KeyError(f"{symbol}+{offset} ({vaddr:#x}) is in no PT_LOAD segment of {path}")
