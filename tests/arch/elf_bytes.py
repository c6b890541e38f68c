"""Functions of a freshly built ELF file as (address, size, original bytes), read with pyelftools:
the input of the jump-optimization tests, taken from what gcc really emits."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    addr: int  # link-time address (a PIE's runtime address is this plus the load bias)
    size: int
    code: bytes

    def at(self, offset: int) -> int:
        return self.addr + offset


def functions(path: Path) -> dict[str, Function]:
    """Every sized function symbol of ``path`` with its bytes."""
    out: dict[str, Function] = {}
    with path.open("rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        sections = [s for s in elf.iter_sections() if s["sh_flags"] & 0x4]  # SHF_EXECINSTR
        for sym in symtab.iter_symbols():
            if sym["st_info"]["type"] != "STT_FUNC" or sym["st_size"] == 0:
                continue
            addr, size = sym["st_value"], sym["st_size"]
            for sec in sections:
                if sec["sh_addr"] <= addr < sec["sh_addr"] + sec["sh_size"]:
                    start = addr - sec["sh_addr"]
                    out[sym.name] = Function(sym.name, addr, size, sec.data()[start : start + size])
    return out


def symbols(path: Path) -> dict[str, int]:
    """Every named symbol of ``path`` (labels too) with its link-time address."""
    with path.open("rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        return {sym.name: sym["st_value"] for sym in symtab.iter_symbols() if sym.name}


def build(out: Path, sources: dict[str, str], *flags: str) -> dict[str, Function]:
    """Write ``sources`` (file name -> text) next to ``out``, link them with gcc, read back."""
    paths = []
    for name, text in sources.items():
        path = out.parent / name
        path.write_text(text)
        paths.append(str(path))
    subprocess.run(["gcc", *flags, "-o", str(out), *paths], check=True, timeout=60)
    return functions(out)
