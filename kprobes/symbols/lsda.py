"""Exception landing pads: where the C++ unwinder enters a function from outside its flow.

A jump-optimized probe must not displace an instruction that something jumps to, and the
unwinder "jumps" to a landing pad: a function's FDE points at its LSDA (language-specific
data area, in ``.gcc_except_table``), whose call-site table gives, for each range of calls
that may throw, the pad to resume at. The kernel has no such case (no exceptions in the
kernel); uprobes do not optimize at all. Layout (the Itanium C++ ABI's LSDA, as gcc writes it):

    u8 lpstart_enc   [encoded lpstart]      landing pads are relative to it (default: the
    u8 ttype_enc     [uleb128 ttype_off]    function's start)
    u8 callsite_enc  uleb128 table_length
    table: { enc start, enc length, enc landing_pad, uleb128 action }*   pad 0: none

Only what gcc and clang write for x86-64 is read (uleb128 or udata4 call sites, an omitted
or absolute lpstart); anything else gives no pads and the caller refuses nothing more, which
is why ``find_region`` also refuses any site whose function has an LSDA it could not read.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Final

from kprobes.symbols.elf import read_sections
from kprobes.symbols.leb128 import uleb128

_OMIT: Final = 0xFF
_ULEB128: Final = 0x01
_UDATA4: Final = 0x03
_UDATA8: Final = 0x04


class LsdaError(Exception):
    """The LSDA is in a form this reader does not know."""


def _value(data: bytes, pos: int, enc: int) -> tuple[int, int]:
    if enc == _ULEB128:
        return uleb128(data, pos)
    if enc == _UDATA4:
        return struct.unpack_from("<I", data, pos)[0], pos + 4
    if enc == _UDATA8 or enc == 0:
        return struct.unpack_from("<Q", data, pos)[0], pos + 8
    raise LsdaError(f"call-site encoding {enc:#x}")


def parse_landing_pads(data: bytes, func_start: int) -> tuple[int, ...]:
    """The landing pads (link-time addresses) of the LSDA at the start of ``data``."""
    try:
        lpstart_enc = data[0]
        pos = 1
        lpstart = func_start
        if lpstart_enc != _OMIT:
            lpstart, pos = _value(data, pos, lpstart_enc)
        ttype_enc = data[pos]
        pos += 1
        if ttype_enc != _OMIT:
            _, pos = uleb128(data, pos)
        callsite_enc = data[pos]
        length, pos = uleb128(data, pos + 1)
        end = pos + length
        pads = set()
        while pos < end:
            _start, pos = _value(data, pos, callsite_enc)
            _length, pos = _value(data, pos, callsite_enc)
            pad, pos = _value(data, pos, callsite_enc)
            _action, pos = uleb128(data, pos)
            if pad:
                pads.add(lpstart + pad)
        return tuple(sorted(pads))
    except (IndexError, struct.error) as exc:
        raise LsdaError(f"truncated LSDA: {exc}") from exc


_sections: dict[tuple[str, int, int], list[tuple[int, bytes]]] = {}
_lock = threading.Lock()


def _sections_of(path: str) -> list[tuple[int, bytes]]:
    """(address, bytes) of the allocated sections that can hold an LSDA, read once."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_mtime_ns)
    with _lock:
        found = _sections.get(key)
    if found is None:
        named = read_sections(path, (".gcc_except_table", ".rodata"))
        found = [(addr, data) for addr, data in named.values() if addr]
        with _lock:
            _sections[key] = found
    return found


def landing_pads(path: str, lsda: int, func_start: int) -> tuple[int, ...]:
    """The landing pads of the function at ``func_start`` whose LSDA is at ``lsda`` in the
    file ``path`` (link-time addresses); LsdaError if they cannot be read."""
    try:
        sections = _sections_of(path)
    except (OSError, ValueError, struct.error) as exc:
        raise LsdaError(f"{path}: {exc}") from exc
    for addr, data in sections:
        if addr <= lsda < addr + len(data):
            return parse_landing_pads(data[lsda - addr :], func_start)
    raise LsdaError(f"no section of {path} holds the LSDA at {lsda:#x}")
