"""SymbolResolver on live targets: names to the addresses the programs print, and back."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kprobes.errors import ProbeRejected, SpecError, SymbolNotFound, TargetError
from kprobes.symbols.elf import SymbolKind
from kprobes.symbols.maps import read_maps
from kprobes.symbols.resolve import SymbolResolver

from .conftest import Programs, Running

NO_SUCH_PID = 0x7FFFFFFF


@pytest.fixture(params=["pie", "nopie"])
def target(request: pytest.FixtureRequest) -> Running:
    running: Running = request.getfixturevalue(request.param)
    return running


def test_main_function(target: Running) -> None:
    resolver = SymbolResolver(target.pid)
    location = resolver.resolve("kpt_probe_me")
    assert location.addr == target.addrs["kpt_probe_me"]
    assert location.module is resolver.main_module()
    assert location.symbol is not None and location.symbol.kind is SymbolKind.FUNC
    assert (location.offset, location.func_start) == (0, location.addr)
    assert location.func_size == location.symbol.size > 4
    assert location.display == "kpt_probe_me+0x0"


def test_static_function_from_symtab(target: Running) -> None:
    location = SymbolResolver(target.pid).resolve("kpt_static_helper")
    assert location.addr == target.addrs["kpt_static_helper"]
    assert location.symbol is not None and location.symbol.table == ".symtab"


def test_offsets_in_text_and_argument(target: Running) -> None:
    resolver = SymbolResolver(target.pid)
    base = target.addrs["kpt_probe_me"]
    for text, offset in (("kpt_probe_me+0x4", 0), ("kpt_probe_me+4", 0), ("kpt_probe_me", 4)):
        location = resolver.resolve(text, offset)
        assert (location.addr, location.offset, location.func_start) == (base + 4, 4, base)
        assert location.display == "kpt_probe_me+0x4"
    assert resolver.resolve("kpt_probe_me+0x2", offset=2).addr == base + 4


def test_library_functions(target: Running, programs: Programs) -> None:
    resolver = SymbolResolver(target.pid)
    malloc = target.addrs["malloc"]
    for text in ("libc:malloc", "libc.so.6:malloc", "/usr/lib/x86_64-linux-gnu/libc.so.6:malloc"):
        assert resolver.resolve(text).addr == malloc, text
    # Through the /lib -> usr/lib symlink of a merged-/usr system: the same file.
    assert resolver.resolve("/lib/x86_64-linux-gnu/libc.so.6:malloc").addr == malloc
    lib_func = target.addrs["kpt_lib_func"]
    assert resolver.resolve("libkpt:kpt_lib_func+0x4").addr == lib_func + 4
    assert resolver.resolve(f"{programs.libkpt}:kpt_lib_func").addr == lib_func


def test_path_to_the_main_program(target: Running) -> None:
    resolver = SymbolResolver(target.pid)
    main = resolver.main_module()
    assert resolver.resolve(f"{main.path}:kpt_probe_me").addr == target.addrs["kpt_probe_me"]
    assert (
        resolver.resolve(f"{main.name}:kpt_static_helper").addr
        == (target.addrs["kpt_static_helper"])
    )


def test_bare_name_searches_only_the_executable(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    with pytest.raises(SymbolNotFound) as info:
        resolver.resolve("malloc")
    main = resolver.main_module().path
    assert str(info.value) == f"no symbol 'malloc' in {main} (searched .symtab, .dynsym)"
    assert info.value.errno == errno.ENOENT


def test_unknown_symbol(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    with pytest.raises(SymbolNotFound, match=r"no symbol 'kpt_nope' in .*libc\.so\.6 "):
        resolver.resolve("libc:kpt_nope")
    with pytest.raises(SymbolNotFound, match=r"\(searched \.dynsym\)"):
        resolver.resolve("libc:kpt_nope")


def test_offset_past_the_end(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    size = resolver.resolve("kpt_probe_me").func_size
    assert resolver.resolve("kpt_probe_me", size - 1).offset == size - 1
    with pytest.raises(ProbeRejected) as info:
        resolver.resolve(f"kpt_probe_me+{size:#x}")
    assert str(info.value) == f"offset {size:#x} is past the end of kpt_probe_me (size {size:#x})"
    assert info.value.errno == errno.EINVAL
    assert not isinstance(info.value, SymbolNotFound)


def test_malformed_symbol_text(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    with pytest.raises(SpecError) as info:
        resolver.resolve("kpt_probe_me+0xzz")
    assert info.value.column == len("kpt_probe_me+")
    for text in ("libc:", ":malloc", "/usr/lib/x86_64-linux-gnu/libc.so.6"):
        with pytest.raises(SpecError):
            resolver.resolve(text)


def test_ifunc_is_returned_as_is(pie: Running) -> None:
    location = SymbolResolver(pie.pid).resolve("libc:strlen")
    assert location.symbol is not None and location.symbol.kind is SymbolKind.IFUNC


def test_find_module_names(pie: Running, programs: Programs) -> None:
    resolver = SymbolResolver(pie.pid)
    libc = resolver.find_module("libc")
    assert libc.name == "libc.so.6"
    assert resolver.find_module("libc.so.6") is libc
    assert resolver.find_module("libc.so") is libc
    assert resolver.find_module(libc.path) is libc
    assert resolver.find_module("libkpt").path == str(programs.libkpt)
    assert resolver.find_module("ld-linux-x86-64").name == "ld-linux-x86-64.so.2"
    assert resolver.find_module("ld").name == "ld-linux-x86-64.so.2"
    assert resolver.find_module("target_pie") is resolver.main_module()
    with pytest.raises(SymbolNotFound) as info:
        resolver.find_module("libnothere")
    assert "libc.so.6" in str(info.value) and "libkpt.so" in str(info.value)
    assert info.value.errno == errno.ENOENT


def test_describe_and_locate_round_trip(target: Running) -> None:
    resolver = SymbolResolver(target.pid)
    for text in (
        "kpt_probe_me+0x4",
        "kpt_static_helper+0x0",
        "libc:malloc+0x10",
        "libkpt:kpt_lib_func",
    ):
        location = resolver.resolve(text)
        described = resolver.describe(location.addr)
        assert described == location.display
        assert resolver.resolve(f"{location.module.name}:{described}").addr == location.addr
        located = resolver.locate_address(location.addr)
        assert located == location
    assert resolver.describe(target.addrs["malloc"]) == "malloc+0x0"


def test_address_outside_every_module(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    addr = next(m.start for m in read_maps(pie.pid) if m.path == "[stack]")
    assert resolver.describe(addr) == f"{addr:#x}"
    with pytest.raises(SymbolNotFound, match=f"{addr:#x} is not in any mapped ELF file"):
        resolver.locate_address(addr)


def test_address_inside_a_module_but_no_function(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    main = resolver.main_module()
    location = resolver.locate_address(main.start)  # the ELF header
    assert location.symbol is None and location.module is main
    assert (location.func_start, location.func_size, location.display) == (
        main.start,
        0,
        f"{main.start:#x}",
    )


def test_stripped_binary(stripped: Running) -> None:
    resolver = SymbolResolver(stripped.pid)
    assert resolver.resolve("kpt_probe_me").addr == stripped.addrs["kpt_probe_me"]
    with pytest.raises(SymbolNotFound) as info:
        resolver.resolve("kpt_static_helper")
    assert "(searched .dynsym)" in str(info.value)


def test_refresh_sees_dlopen(pie: Running, programs: Programs) -> None:
    resolver = SymbolResolver(pie.pid)
    with pytest.raises(SymbolNotFound):
        resolver.find_module("libkpt_dl")
    name, addr = pie.command(f"dlopen {programs.libkpt_dl}")
    assert name == "kpt_dl_func" and addr != 0
    resolver.refresh()
    assert resolver.resolve("libkpt_dl:kpt_dl_func").addr == addr
    assert resolver.describe(addr + 1) == "kpt_dl_func+0x1"


def test_iter_functions_glob(pie: Running) -> None:
    resolver = SymbolResolver(pie.pid)
    names = {loc.display for loc in resolver.iter_functions("kpt_*")}
    assert names == {"kpt_probe_me+0x0", "kpt_static_helper+0x0"}
    allocs = {loc.symbol.name for loc in resolver.iter_functions("*alloc", "libc") if loc.symbol}
    assert {"malloc", "calloc", "realloc"} <= allocs


def test_missing_process() -> None:
    with pytest.raises(TargetError, match=f"no process {NO_SUCH_PID}"):
        SymbolResolver(NO_SUCH_PID)


def test_module_name_tiers_and_ambiguity(
    programs: Programs, tmp_path: Path, start_target: Callable[[list[str]], Running]
) -> None:
    running = start_target([str(programs.pie)])
    for name in ("a/libdup.so", "a/libdup-1.so", "b/libdup.so"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(programs.libkpt_dl, tmp_path / name)
    running.command(f"dlopen {tmp_path}/a/libdup-1.so")
    running.command(f"dlopen {tmp_path}/a/libdup.so")
    resolver = SymbolResolver(running.pid)
    # "libdup" is the whole stem of libdup.so but only the short stem of libdup-1.so.
    assert resolver.find_module("libdup").path == f"{tmp_path}/a/libdup.so"
    assert resolver.find_module("libdup-1").path == f"{tmp_path}/a/libdup-1.so"
    with pytest.raises(SymbolNotFound, match="no module 'lib'"):
        resolver.find_module("lib")
    running.command(f"dlopen {tmp_path}/b/libdup.so")
    resolver.refresh()
    with pytest.raises(SymbolNotFound) as info:
        resolver.resolve("libdup:kpt_dl_func")
    assert str(info.value) == (
        f"module name 'libdup' is ambiguous: {tmp_path}/a/libdup.so, {tmp_path}/b/libdup.so"
    )
    assert resolver.find_module(f"{tmp_path}/b/libdup.so").path == f"{tmp_path}/b/libdup.so"


def test_other_mount_namespace(
    programs: Programs, tmp_path: Path, start_target: Callable[[list[str]], Running]
) -> None:
    """A target whose executable exists only in its own mount namespace.

    In ours, the same path holds a different program (the non-PIE build): resolving through
    the plain path would give that file's addresses.
    """
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) from util-linux is needed to make a mount namespace")
    hidden = tmp_path / "ns"
    hidden.mkdir()
    shutil.copy(programs.nopie, hidden / "prog")  # what we see at that path
    script = f"mount -t tmpfs kpt {hidden} && cp {programs.pie} {hidden}/prog && exec {hidden}/prog"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace: {probe.stderr.decode().strip()}")
    running = start_target(["unshare", "--mount", "--propagation", "private", "sh", "-c", script])
    assert os.readlink(f"/proc/{running.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    resolver = SymbolResolver(running.pid)
    assert resolver.main_module().path == f"{hidden}/prog"
    assert resolver.resolve("kpt_probe_me").addr == running.addrs["kpt_probe_me"]
    assert resolver.resolve("kpt_static_helper").addr == running.addrs["kpt_static_helper"]
