"""Call frame information: where the unwind table of a function is, in one ELF file.

The other half of ``unwind.py`` (which walks a stack with the rows of these tables). An FDE
is found by one bisection of ``.eh_frame_hdr``'s search table; its header (range, LSDA) is
read alone where ``ehframe.py`` can, and the FDE is decoded into rows (``cfi_decode.py``,
through pyelftools, imported then) only when a stack is unwound through it. Files without
that table, and ``.debug_frame``, are indexed in full on their first query. Everything is
cached per file identity (path, inode, mtime) and shared by every process that maps the file.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
from typing import TYPE_CHECKING, Final

from kprobes.symbols.ehframe import FdeHeader, RawEhFrame
from kprobes.symbols.elf import read_sections
from kprobes.values import dataclass

if TYPE_CHECKING:
    from elftools.dwarf.callframe import CallFrameInfo

    from kprobes.symbols.cfa import Fde


class _Cfi:
    """The FDEs of one section (``.eh_frame`` or ``.debug_frame``), sorted by start."""

    def __init__(
        self,
        data: bytes,
        address: int,
        index: tuple[list[int], list[int]] | None,
        *,
        is_eh_frame: bool,
    ) -> None:
        self._data = data
        self._address = address
        self._is_eh_frame = is_eh_frame
        self._index = index  # (starts, offsets); None: not read yet (no search table)
        self._raw = RawEhFrame(data, address) if is_eh_frame else None  # headers alone
        self._info: CallFrameInfo | None = None
        self._decoded: dict[int, Fde | None] = {}  # by offset; None for an unusable entry
        self._lock = threading.Lock()  # pyelftools parses from one shared stream

    def _entries(self) -> tuple[list[int], list[int]]:
        if self._index is None:
            from kprobes.symbols import cfi_decode

            with self._lock:
                try:
                    if self._index is None:
                        self._index = cfi_decode.full_index(self._call_frame_info())
                except cfi_decode.PARSE_ERRORS:
                    self._index = ([], [])  # a damaged table: the other one, or frame pointers
        return self._index

    def _call_frame_info(self) -> CallFrameInfo:
        from kprobes.symbols import cfi_decode

        if self._info is None:
            self._info = cfi_decode.call_frame_info(
                self._data, self._address, for_eh_frame=self._is_eh_frame
            )
        return self._info

    def find(self, vaddr: int) -> Fde | None:
        """The FDE whose [start, end) holds the link-time address ``vaddr``."""
        starts, offsets = self._entries()
        index = bisect.bisect_right(starts, vaddr) - 1
        # Entries sharing a start (an empty FDE beside a real one) are all candidates.
        while index >= 0:
            fde = self._fde_at(offsets[index])
            if fde is not None and fde.start <= vaddr < fde.end:
                return fde
            if index == 0 or starts[index - 1] != starts[index]:
                return None
            index -= 1
        return None

    def find_lsda(self, vaddr: int) -> tuple[int, int | None] | None:
        """(start, LSDA or None) of the FDE holding ``vaddr``, from its header alone where it
        can be read so (ehframe.py); None when no FDE holds it."""
        starts, offsets = self._entries()
        index = bisect.bisect_right(starts, vaddr) - 1
        while index >= 0:
            offset = offsets[index]
            header = self._raw.header(offset) if self._raw is not None else None
            if header is None:  # a form not read raw: decoded in full
                fde = self._fde_at(offset)
                header = None if fde is None else FdeHeader(fde.start, fde.end, fde.lsda)
            if header is not None and header.start <= vaddr < header.end:
                return header.start, header.lsda
            if index == 0 or starts[index - 1] != starts[index]:
                return None
            index -= 1
        return None

    def _fde_at(self, offset: int) -> Fde | None:
        from kprobes.symbols import cfi_decode

        with self._lock:
            if offset not in self._decoded:
                self._decoded[offset] = cfi_decode.decode_at(self._call_frame_info(), offset)
            return self._decoded[offset]


# -- the files -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FileCfi:
    """Every unwind table of one file, in the order they are consulted."""

    sections: tuple[_Cfi, ...]

    def find(self, vaddr: int) -> Fde | None:
        for section in self.sections:
            fde = section.find(vaddr)
            if fde is not None:
                return fde
        return None

    def find_lsda(self, vaddr: int) -> tuple[int, int | None] | None:
        for section in self.sections:
            found = section.find_lsda(vaddr)
            if found is not None:
                return found
        return None


_DW_EH_PE_OMIT: Final = 0xFF
_DW_EH_PE_DATAREL_SDATA4: Final = 0x3B  # what every linker writes in the search table
_DW_EH_PE_UDATA4: Final = 0x03
_EH_PTR_SIZE: Final = {0x00: 8, 0x02: 2, 0x03: 4, 0x04: 8, 0x0A: 2, 0x0B: 4, 0x0C: 8}


def _search_table(hdr: bytes, hdr_addr: int, eh_addr: int) -> tuple[list[int], list[int]] | None:
    """(starts, FDE offsets in .eh_frame) from .eh_frame_hdr; None when it has no table.

    Layout: version 1, eh_frame_ptr_enc, fde_count_enc, table_enc, the encoded eh_frame_ptr,
    the encoded count, then (initial location, FDE address) pairs relative to the header.
    """
    if len(hdr) < 4 or hdr[0] != 1:
        return None
    ptr_enc, count_enc, table_enc = hdr[1], hdr[2], hdr[3]
    ptr_size = _EH_PTR_SIZE.get(ptr_enc & 0x0F)
    if ptr_enc == _DW_EH_PE_OMIT or ptr_size is None:
        return None
    if count_enc != _DW_EH_PE_UDATA4 or table_enc != _DW_EH_PE_DATAREL_SDATA4:
        return None
    pos = 4 + ptr_size
    if len(hdr) < pos + 4:
        return None
    (count,) = struct.unpack_from("<I", hdr, pos)
    pos += 4
    if len(hdr) < pos + 8 * count:
        return None
    pairs = sorted(struct.iter_unpack("<ii", hdr[pos : pos + 8 * count]))
    starts = [hdr_addr + start for start, _fde in pairs]
    offsets = [hdr_addr + fde - eh_addr for _start, fde in pairs]
    return starts, offsets


def _read_file(path: str) -> _FileCfi:
    names = (".eh_frame", ".eh_frame_hdr", ".debug_frame")
    try:
        found = read_sections(path, names)
    except (OSError, ValueError, struct.error):
        return _FileCfi(())
    sections: list[_Cfi] = []
    if ".eh_frame" in found:
        address, data = found[".eh_frame"]
        index = None
        if ".eh_frame_hdr" in found:
            hdr_address, hdr = found[".eh_frame_hdr"]
            index = _search_table(hdr, hdr_address, address)
        sections.append(_Cfi(data, address, index, is_eh_frame=True))
    if ".debug_frame" in found:
        address, data = found[".debug_frame"]
        sections.append(_Cfi(data, address, None, is_eh_frame=False))
    return _FileCfi(tuple(sections))


_CacheKey = tuple[str, int, int, int, int]
_cache: dict[_CacheKey, _FileCfi] = {}
_cache_lock = threading.Lock()


def _cfi_of(path: str) -> _FileCfi:
    """The unwind tables of the file at ``path``, read once per file identity."""
    try:
        st = os.stat(path)
    except OSError:
        return _FileCfi(())
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    cfi = _read_file(path)
    with _cache_lock:
        return _cache.setdefault(key, cfi)


def find_lsda(path: str, vaddr: int) -> tuple[int, int] | None:
    """(start of the FDE, its LSDA) when the FDE covering link-time ``vaddr`` of the file at
    ``path`` points to an exception table; None otherwise. ``find_fde(...).lsda``, without
    decoding the FDE's instructions where its header can be read alone (ehframe.py)."""
    found = _cfi_of(path).find_lsda(vaddr)
    if found is None or found[1] is None:
        return None
    return found[0], found[1]


def find_fde(path: str, vaddr: int) -> Fde | None:
    """The unwind table entry of the file at ``path`` covering link-time address ``vaddr``."""
    return _cfi_of(path).find(vaddr)
