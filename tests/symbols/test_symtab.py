"""The answers for one name or one address (``NameIndex``, which decodes only the entries
that answer) against the full tables (``build_tables``), on every symbol of real files."""

from __future__ import annotations

import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

from kprobes.symbols.elf import ElfImage

from .conftest import Programs

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LOADER = "/usr/lib64/ld-linux-x86-64.so.2"


def _pair(path: str) -> tuple[ElfImage, ElfImage]:
    """Two fresh images of one file (not the cache's): the first answers from its index,
    the second has decoded its full tables."""
    lazy, full = ElfImage._read(path), ElfImage._read(path)
    full.iter_functions()
    return lazy, full


def _same_answers(path: str) -> int:
    """Asks both images about every name and around every function of ``path``; returns
    how many names were compared."""
    lazy, full = _pair(path)
    names = {s.name for s in full._symbols().by_name.values() for s in s}
    names |= {"", "no_such_function_kpt", "malloc@@GLIBC_2.2.5", "memcpy@GLIBC_2.2.5"}
    for name in sorted(names):
        assert lazy.lookup_all(name) == full.lookup_all(name), name
        assert lazy.lookup(name) == full.lookup(name), name
    addresses = {0, 1, 2**64 - 1}
    for symbol in full.iter_functions():
        end = symbol.value + symbol.size
        addresses |= {symbol.value - 1, symbol.value, symbol.value + 1, end - 1, end, end + 7}
    for vaddr in sorted(addresses):
        assert lazy.function_at(vaddr) == full.function_at(vaddr), hex(vaddr)
    assert lazy._tables is None, "the index answered without decoding the tables"
    return len(names)


@pytest.mark.parametrize("path", [LIBC, LOADER])
def test_system_libraries(path: str) -> None:
    assert _same_answers(path) > 20


def test_libpython() -> None:
    """A large .dynsym (~1,600 exported functions of CPython's, data and aliases)."""
    library = Path(sysconfig.get_config_var("LIBDIR") or "", "libpython3.11.so")
    if not library.exists():
        pytest.skip(f"{library}: this Python is built without a shared library")
    assert _same_answers(str(library)) > 1000


def test_programs_with_symtab(programs: Programs, build: Callable[[str], Path]) -> None:
    """.symtab before .dynsym, static functions, a stripped file, and three names at one
    address (aliases.c's twin, twin_too, _twin)."""
    paths = [programs.pie, programs.nopie, programs.libkpt, programs.stripped, build("aliases")]
    for path in paths:
        assert _same_answers(str(path)) > 5
    lazy, full = _pair(str(build("aliases")))
    twin = full.lookup("twin")
    assert twin is not None
    assert lazy.function_at(twin.value) == full.function_at(twin.value) == (twin, 0)


def test_decoding_the_tables_after_the_index() -> None:
    """A glob after a name: the full tables replace the index, with the same answers."""
    image = ElfImage._read(LIBC)
    malloc = image.lookup("malloc")
    assert malloc is not None and image._index is not None
    assert image.function_at(malloc.value + 1) == (malloc, 1)
    assert any(s.name == "malloc" for s in image.iter_functions())
    assert image._index is None and image._tables is not None
    assert image.lookup("malloc") == malloc
    assert image.function_at(malloc.value + 1) == (malloc, 1)


VERSIONED_C = r"""
int old_f(int x) { return x + 1; }
int new_f(int x) { return x + 2; }
__asm__(".symver old_f, f@V1");
__asm__(".symver new_f, f@@V2");
int plain(int x) { return x; }
"""


def test_versioned_names_in_symtab(tmp_path: Path) -> None:
    """A library's .symtab spells versions into names ("f@V1", "f@@V2"): both are "f",
    the default version first, as in the full tables."""
    (tmp_path / "v.c").write_text(VERSIONED_C)
    (tmp_path / "v.map").write_text("V1 { global: f; local: *; };\nV2 { global: f; } V1;\n")
    library = tmp_path / "libv.so"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            f"-Wl,--version-script={tmp_path / 'v.map'}",
            "-o",
            str(library),
            str(tmp_path / "v.c"),
        ],
        check=True,
    )
    assert _same_answers(str(library)) > 3
    lazy, _full = _pair(str(library))
    found = lazy.lookup_all("f")
    new_f = lazy.lookup("new_f")
    assert len(found) == 2 and new_f is not None and found[0].value == new_f.value
