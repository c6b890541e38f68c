"""One FDE's range and LSDA, read from the raw bytes of ``.eh_frame``.

The jump checks want one fact of a function's FDE: its LSDA, where the landing pads a jump
must not cover are listed (lsda.py). Decoding the FDE in full through pyelftools (cfi.py)
costs about half a millisecond, most of it in the instructions, which those checks never
read: 1.5 s over libc's 2,600 functions, for ``kprobes list -l -v`` as for ``count 'libc:*'``.
The FDE's header alone, read here, takes microseconds. Only the forms toolchains write are
read (32-bit lengths; absptr or pcrel pointers; the augmentations z, L, P, R, S, B); for any
other the answer is None, and the caller decodes the FDE in full, as before.

Rejected: one decoder for both uses, ours (a second reader of the CFA instructions, which
pyelftools reads well enough for the unwinder); pyelftools' private header parser (it reads
the instructions all the same).

``iter_fdes`` walks the whole section once, each FDE with its CIE and where its instructions
are: what the compact frame tables (frametable.py) are compiled from, every FDE of a file at
once, where pyelftools' full decode is far too slow (2.4 s for libc).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

from kprobes.symbols.leb128 import sleb128, uleb128
from kprobes.values import dataclass

DW_EH_PE_OMIT: Final = 0xFF
_PCREL: Final = 0x10
# Fixed-size value formats (the low nibble of a pointer encoding): struct formats.
_FIXED: Final = {0x00: "<Q", 0x02: "<H", 0x03: "<I", 0x04: "<Q", 0x0A: "<h", 0x0B: "<i", 0x0C: "<q"}
_ULEB128: Final = 0x01
_SLEB128: Final = 0x09


@dataclass(frozen=True, slots=True)
class FdeHeader:
    """The start, end and LSDA (None: none) of one FDE, link-time addresses."""

    start: int
    end: int
    lsda: int | None


@dataclass(frozen=True, slots=True)
class Cie:
    """What a CIE says of the FDEs that point to it; its initial instructions are the bytes
    ``[initial, initial_end)`` of the section."""

    fde_encoding: int
    lsda_encoding: int  # DW_EH_PE_OMIT without "L"
    has_data: bool  # augmentation "z": each FDE has an augmentation data length
    code_align: int = 1
    data_align: int = 1
    ra_column: int = 16
    is_signal_frame: bool = False  # augmentation "S"
    initial: int = 0
    initial_end: int = 0


@dataclass(frozen=True, slots=True)
class RawFde:
    """One FDE: its range (link-time addresses), its CIE, and its instructions, the bytes
    ``[insns, insns_end)`` of the section."""

    start: int
    end: int
    cie: Cie
    insns: int
    insns_end: int


class RawEhFrame:
    """The raw bytes of an ``.eh_frame`` loaded at ``address``, read an FDE header at a time."""

    def __init__(self, data: bytes, address: int) -> None:
        self._data = data
        self._address = address
        self._cies: dict[int, Cie | None] = {}

    def header(self, offset: int) -> FdeHeader | None:
        """The header of the FDE at ``offset``; None when it is not in a form read here."""
        try:
            return self._header(offset)
        except (IndexError, struct.error):  # cut short: for the full decoder to judge
            return None

    def _header(self, offset: int) -> FdeHeader | None:
        data = self._data
        length, cie_pointer = struct.unpack_from("<II", data, offset)
        if length in (0, 0xFFFFFFFF) or cie_pointer == 0:  # end, 64-bit, or a CIE
            return None
        cie = self._cie(offset + 4 - cie_pointer)
        if cie is None:
            return None
        pos = offset + 8
        start, pos = self._pointer(pos, cie.fde_encoding)
        size, pos = self._pointer(pos, cie.fde_encoding & 0x0F)
        if start is None or size is None:
            return None
        lsda = None
        if cie.has_data and cie.lsda_encoding != DW_EH_PE_OMIT:
            _length, pos = uleb128(data, pos)
            lsda, pos = self._pointer(pos, cie.lsda_encoding)
            if lsda is None:
                return None
        return FdeHeader(start, start + size, lsda)

    def _pointer(self, pos: int, encoding: int) -> tuple[int | None, int]:
        """The pointer encoded at ``pos`` (pcrel: from the field's own address), and where
        the next field starts; None for a form not read here."""
        form = encoding & 0x0F
        if form in (_ULEB128, _SLEB128):
            value, end = (sleb128 if form == _SLEB128 else uleb128)(self._data, pos)
        elif form in _FIXED:
            value = struct.unpack_from(_FIXED[form], self._data, pos)[0]
            end = pos + struct.calcsize(_FIXED[form])
        else:
            return None, pos
        match encoding & 0xF0:
            case 0:
                return value, end
            case 0x10:  # DW_EH_PE_pcrel
                return value + self._address + pos, end
        return None, end

    def _cie(self, offset: int) -> Cie | None:
        if offset not in self._cies:
            try:
                self._cies[offset] = self._read_cie(offset)
            except (IndexError, struct.error):
                self._cies[offset] = None
        return self._cies[offset]

    def _read_cie(self, offset: int) -> Cie | None:
        data = self._data
        length, cie_id = struct.unpack_from("<II", data, offset)
        if length == 0xFFFFFFFF or cie_id != 0:
            return None
        version = data[offset + 8]
        pos = offset + 9
        end = data.index(b"\0", pos)
        augmentation = data[pos:end]
        pos = end + 1
        if version >= 4:
            pos += 2  # address_size, segment_selector_size
        code_align, pos = uleb128(data, pos)
        data_align, pos = sleb128(data, pos)
        if version == 1:
            ra_column, pos = data[pos], pos + 1
        else:
            ra_column, pos = uleb128(data, pos)
        end = offset + 4 + length
        if not augmentation.startswith(b"z"):
            if augmentation:
                return None
            return Cie(
                0,
                DW_EH_PE_OMIT,
                has_data=False,
                code_align=code_align,
                data_align=data_align,
                ra_column=ra_column,
                initial=pos,
                initial_end=end,
            )
        data_length, pos = uleb128(data, pos)
        initial = pos + data_length
        fde_encoding, lsda_encoding = 0, DW_EH_PE_OMIT
        for letter in augmentation[1:].decode("ascii", "replace"):
            if letter == "L":
                lsda_encoding, pos = data[pos], pos + 1
            elif letter == "R":
                fde_encoding, pos = data[pos], pos + 1
            elif letter == "P":
                personality, pos = data[pos], pos + 1
                value, pos = self._pointer(pos, personality & 0x7F)  # its indirect bit aside
                if value is None:
                    return None
            elif letter not in "SB":
                return None
        return Cie(
            fde_encoding,
            lsda_encoding,
            has_data=True,
            code_align=code_align,
            data_align=data_align,
            ra_column=ra_column,
            is_signal_frame=b"S" in augmentation,
            initial=initial,
            initial_end=end,
        )

    def iter_fdes(self) -> Iterator[RawFde]:
        """Every FDE of the section in the order they are written, damaged ones and those in
        a form not read here left out; the walk stops at the terminator or a cut entry."""
        data, pos = self._data, 0
        while pos + 8 <= len(data):
            length, cie_pointer = struct.unpack_from("<II", data, pos)
            if length == 0 or length == 0xFFFFFFFF:  # the terminator; a 64-bit entry
                return
            end = pos + 4 + length
            if end > len(data):
                return
            if cie_pointer != 0:
                fde = self._fde(pos, end, cie_pointer)
                if fde is not None:
                    yield fde
            pos = end

    def _fde(self, pos: int, end: int, cie_pointer: int) -> RawFde | None:
        cie = self._cie(pos + 4 - cie_pointer)
        if cie is None:
            return None
        try:
            start, at = self._pointer(pos + 8, cie.fde_encoding)
            size, at = self._pointer(at, cie.fde_encoding & 0x0F)
            if cie.has_data:
                data_length, at = uleb128(self._data, at)
                at += data_length
        except (IndexError, struct.error):
            return None
        if start is None or size is None or at > end:
            return None
        return RawFde(start, start + size, cie, at, end)

    def pointer(self, pos: int, encoding: int) -> int | None:
        """The pointer encoded at ``pos`` of the section (``DW_CFA_set_loc``'s operand); None
        for a form not read here."""
        try:
            return self._pointer(pos, encoding)[0]
        except (IndexError, struct.error):
            return None

    @property
    def data(self) -> bytes:
        return self._data
