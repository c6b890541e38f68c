"""Where things are in a process: ELF symbol tables, /proc/PID/maps, and the resolver.

This is the only package that imports pyelftools. It reads files and /proc, never the
memory of the process, so it needs no ptrace.
"""

from kprobes.symbols.elf import ElfImage, Segment, Symbol, SymbolKind
from kprobes.symbols.maps import Mapping, Module, iter_modules, read_maps
from kprobes.symbols.resolve import Location, SymbolResolver

__all__ = [
    "ElfImage",
    "Location",
    "Mapping",
    "Module",
    "Segment",
    "Symbol",
    "SymbolKind",
    "SymbolResolver",
    "iter_modules",
    "read_maps",
]
