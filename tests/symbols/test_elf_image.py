"""ElfImage against real files, and differentially against binutils' nm and readelf."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest

from kprobes.errors import TargetError
from kprobes.symbols.elf import ElfImage, SymbolKind

from .conftest import Programs

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"

# nm letters for symbols that may be functions: text (T/t), weak (W/w), GNU ifunc (i).
_NM_FUNCTION_TYPES = frozenset("TtWwi")


def _nm(*args: str) -> set[tuple[str, int]]:
    out = subprocess.run(["nm", *args], check=True, capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in _NM_FUNCTION_TYPES:
            found.add((fields[2].partition("@")[0], int(fields[0], 16)))
    return found


def _readelf_functions(*args: str) -> set[tuple[str, int]]:
    """(name, value) of every defined FUNC/IFUNC symbol, as readelf -sW prints them."""
    out = subprocess.run(
        ["readelf", "-sW", *args], check=True, capture_output=True, text=True
    ).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(fields) >= 8 and fields[3] in ("FUNC", "IFUNC") and fields[6] != "UND":
            value = int(fields[1], 16)
            if value:
                found.add((fields[7].partition("@")[0], value))
    return found


def _functions(image: ElfImage) -> set[tuple[str, int]]:
    return {(s.name, s.value) for s in image.iter_functions()}


def test_libc_functions_match_nm_dynamic() -> None:
    image = ElfImage.open(LIBC)
    ours = _functions(image)
    assert ours == _nm("-D", "--defined-only", LIBC)
    assert ours == _readelf_functions("--dyn-syms", LIBC)


def test_program_functions_match_nm(programs: Programs) -> None:
    for path in (programs.pie, programs.nopie, programs.libkpt):
        image = ElfImage.open(str(path))
        ours = _functions(image)
        assert ours == _readelf_functions(str(path))
        # nm letters come from the section, not the symbol type: crt1's weak NOTYPE label
        # data_start (in .data) prints as "W" although it is no function.
        theirs = _nm("--defined-only", str(path))
        assert ours == {item for item in theirs if item[0] != "data_start"}
    assert any(
        name == "kpt_static_helper" for name, _ in _functions(ElfImage.open(str(programs.pie)))
    )


def test_libc_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened again, a file already read is not read again (how fast that is, is for a
    benchmark: a wall-clock bound here fails on a loaded machine)."""
    ElfImage.open(LIBC).lookup("malloc")  # warm the cache; it may already be
    reads: list[str] = []
    read = ElfImage._read
    monkeypatch.setattr(ElfImage, "_read", lambda path: reads.append(path) or read(path))
    first = ElfImage.open(LIBC)
    second = ElfImage.open(LIBC)
    assert first is second
    assert reads == []


def test_cache_sees_a_rewritten_file(tmp_path: Path, programs: Programs) -> None:
    copy = tmp_path / "prog"
    shutil.copy(programs.pie, copy)
    first = ElfImage.open(str(copy))
    shutil.copy(programs.nopie, copy)
    second = ElfImage.open(str(copy))
    assert first is not second
    assert first.is_dyn and not second.is_dyn


def test_ifunc_and_versioned_names() -> None:
    image = ElfImage.open(LIBC)
    memcpy = image.lookup("memcpy")
    assert memcpy is not None and memcpy.kind is SymbolKind.IFUNC
    # The default version (memcpy@@GLIBC_2.14) wins over the old FUNC memcpy@GLIBC_2.2.5.
    dynsyms = subprocess.run(
        ["nm", "-D", "--defined-only", LIBC], check=True, capture_output=True, text=True
    ).stdout
    default = next(line for line in dynsyms.splitlines() if line.endswith(" memcpy@@GLIBC_2.14"))
    assert memcpy.value == int(default.split()[0], 16)
    assert image.lookup("memcpy@@GLIBC_2.14") == memcpy
    assert len(image.lookup_all("memcpy")) >= 2
    malloc = image.lookup("malloc")
    assert malloc is not None and malloc.kind is SymbolKind.FUNC and malloc.table == ".dynsym"
    assert image.lookup("no_such_function_kpt") is None
    assert image.tables == (".dynsym",)


def test_symtab_preferred_and_static_functions(programs: Programs) -> None:
    image = ElfImage.open(str(programs.pie))
    assert image.tables == (".symtab", ".dynsym")
    helper = image.lookup("kpt_static_helper")
    assert helper is not None and helper.table == ".symtab" and helper.kind is SymbolKind.FUNC
    counter = image.lookup("kpt_global_counter")
    assert counter is not None and counter.kind is SymbolKind.OBJECT
    stripped = ElfImage.open(str(programs.stripped))
    assert stripped.tables == (".dynsym",)
    assert stripped.lookup("kpt_static_helper") is None
    exported = stripped.lookup("kpt_probe_me")
    assert exported is not None and exported.table == ".dynsym"


def test_function_at_covers_every_function() -> None:
    image = ElfImage.open(LIBC)
    for symbol in image.iter_functions():
        found = image.function_at(symbol.value)
        assert found is not None, symbol
        at, offset = found
        assert (at.value, offset) == (symbol.value, 0)
        if symbol.size > 1:
            last = image.function_at(symbol.value + symbol.size - 1)
            assert last is not None and last[0].value == symbol.value
    assert image.function_at(0) is None
    malloc = image.lookup("malloc")
    assert malloc is not None
    assert image.function_at(malloc.value + 0x10) == (malloc, 0x10)


def test_segments_and_offset_translation() -> None:
    image = ElfImage.open(LIBC)
    out = subprocess.run(["readelf", "-lW", LIBC], check=True, capture_output=True, text=True)
    loads = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["LOAD"]]
    assert [(s.offset, s.vaddr, s.filesz, s.memsz) for s in image.segments] == [
        (int(f[1], 16), int(f[2], 16), int(f[4], 16), int(f[5], 16)) for f in loads
    ]
    malloc = image.lookup("malloc")
    assert malloc is not None
    off = image.vaddr_to_offset(malloc.value)
    assert off is not None and image.offset_to_vaddr(off) == malloc.value
    data = image.segments[-1]
    assert image.vaddr_to_offset(data.vaddr + data.memsz - 1) is None  # .bss has no bytes
    assert image.offset_to_vaddr(1 << 40) is None


def test_not_elf_is_refused_with_its_path(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(TargetError, match=r"notes\.txt is not an ELF file") as info:
        ElfImage.open(str(text))
    assert info.value.errno == errno.ENOEXEC
    with pytest.raises(TargetError, match="not an ELF file"):  # the refusal is cached
        ElfImage.open(str(text))


def test_other_machines_and_broken_files_are_refused(tmp_path: Path) -> None:
    data = bytearray(Path(LIBC).read_bytes()[:65536])
    data[18:20] = (3).to_bytes(2, "little")  # EM_386
    i386 = tmp_path / "i386.so"
    i386.write_bytes(bytes(data))
    with pytest.raises(TargetError, match=r"i386\.so is not an x86-64 ELF file"):
        ElfImage.open(str(i386))
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(Path(LIBC).read_bytes()[:40])
    with pytest.raises(TargetError, match=r"truncated\.so is not a valid ELF file"):
        ElfImage.open(str(truncated))
    with pytest.raises(TargetError, match=r"missing\.so"):
        ElfImage.open(str(tmp_path / "missing.so"))
    with pytest.raises(TargetError, match="not a regular file"):
        ElfImage.open(str(tmp_path))
