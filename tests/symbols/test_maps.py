"""/proc/PID/maps parsing and module grouping, checked against live targets."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kprobes.errors import TargetError
from kprobes.symbols.maps import Mapping, iter_modules, read_maps

from .conftest import Programs, Running

NO_SUCH_PID = 0x7FFFFFFF  # above any pid_max


def test_read_maps_matches_the_file(pie: Running) -> None:
    maps = read_maps(pie.pid)
    with open(f"/proc/{pie.pid}/maps") as stream:
        lines = stream.read().splitlines()
    assert len(maps) == len(lines)
    for mapping, line in zip(maps, lines, strict=True):
        assert line.startswith(f"{mapping.start:x}-{mapping.end:x} {mapping.perms} ")
        assert line.endswith(mapping.path)
    assert any(m.path == "[stack]" for m in maps)
    assert any(m.path == "" for m in maps)
    assert [m.start for m in maps] == sorted(m.start for m in maps)


def test_read_maps_of_a_missing_process() -> None:
    with pytest.raises(TargetError, match=f"no process {NO_SUCH_PID}"):
        read_maps(NO_SUCH_PID)


def test_pie_modules_and_biases(pie: Running, programs: Programs) -> None:
    modules = {m.name: m for m in iter_modules(pie.pid)}
    assert {"target_pie", "libkpt.so", "libc.so.6", "ld-linux-x86-64.so.2"} <= set(modules)
    assert not any(name.startswith("[") for name in modules)
    main = modules["target_pie"]
    assert main.path == str(programs.pie)
    probe_me = main.image.lookup("kpt_probe_me")
    assert probe_me is not None
    assert main.bias + probe_me.value == pie.addrs["kpt_probe_me"]
    assert main.bias == main.start  # a PIE's first segment is at link address 0
    libc = modules["libc.so.6"]
    malloc = libc.image.lookup("malloc")
    assert malloc is not None
    assert libc.bias + malloc.value == pie.addrs["malloc"]
    assert libc.contains(pie.addrs["malloc"])
    assert not libc.contains(main.start)
    for module in modules.values():
        assert module.start == module.mappings[0].start
        assert all(m.path == module.path for m in module.mappings)


def test_nopie_bias_is_zero(nopie: Running) -> None:
    modules = {m.name: m for m in iter_modules(nopie.pid)}
    main = modules["target_nopie"]
    assert not main.image.is_dyn
    assert main.bias == 0
    lib = modules["libkpt.so"]
    lib_func = lib.image.lookup("kpt_lib_func")
    assert lib_func is not None
    assert lib.bias + lib_func.value == nopie.addrs["kpt_lib_func"]


def test_every_module_has_its_code_where_its_symbols_say(pie: Running) -> None:
    # A wrong bias would put a function's runtime address outside the module's r-x mappings.
    for module in iter_modules(pie.pid):
        functions = [s for s in module.image.iter_functions() if s.size]
        assert functions, module.path
        symbol = functions[len(functions) // 2]
        addr = module.bias + symbol.value
        holding = [m for m in module.mappings if m.contains(addr)]
        assert holding and "x" in holding[0].perms, (module.path, symbol)


def test_a_second_load_of_one_file_is_a_second_module() -> None:
    # The same file mapped again higher up (dlmopen(), or a program reading its own binary):
    # the second mapping at offset 0 starts a new module with its own bias.
    maps = read_maps(os.getpid())
    libc = [m for m in maps if m.path.endswith("/libc.so.6")]
    shifted = [
        Mapping(m.start + (1 << 40), m.end + (1 << 40), m.perms, m.offset, m.dev, m.inode, m.path)
        for m in libc
    ]
    modules = [m for m in iter_modules(os.getpid(), libc + shifted) if m.name == "libc.so.6"]
    assert len(modules) == 2
    assert modules[1].bias - modules[0].bias == 1 << 40


def test_deleted_file_is_read_through_map_files(
    programs: Programs, tmp_path: Path, start_target: Callable[[list[str]], Running]
) -> None:
    copy = tmp_path / "target_deleted"
    shutil.copy(programs.pie, copy)
    running = start_target([str(copy)])
    copy.unlink()
    modules = {m.name: m for m in iter_modules(running.pid)}
    main = modules["target_deleted"]
    assert main.path.endswith(" (deleted)")
    assert "/map_files/" in main.image.path
    probe_me = main.image.lookup("kpt_probe_me")
    assert probe_me is not None
    assert main.bias + probe_me.value == running.addrs["kpt_probe_me"]
