"""Function parameters from DWARF, against programs compiled here and against gdb.

tests/programs/jargs_types.c (+ jargs_other.c, a second compilation unit) is built with
gcc -g at -O0 and -O2, as DWARF 5 (gcc 12's default) and DWARF 4, with compressed sections,
without .debug_aranges, stripped with a separate debug file, and without -g; every build must
give the same signatures, written out below. gdb reads the same DWARF independently: its
``whatis`` and ``info scope`` must agree with our spellings, names and sizes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kprobes.errors import TargetError
from kprobes.symbols import dwarf
from kprobes.symbols.dwarf import (
    Field,
    Param,
    ParamKind,
    Signature,
    function_params,
    get_signature,
)
from kprobes.symbols.elf import ElfImage

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
SOURCES = (PROGRAMS / "jargs_types.c", PROGRAMS / "jargs_other.c")

K = ParamKind
S, U, B = K.SIGNED, K.UNSIGNED, K.BOOL
PTR, STR, STRUCT = K.POINTER, K.CHAR_POINTER, K.STRUCT


def P(name: str, type_name: str, kind: ParamKind, size: int, **kw: object) -> Param:
    return Param(name, type_name, kind, size, **kw)  # type: ignore[arg-type]


def F(offset: int, size: int, kind: ParamKind) -> Field:
    return Field(offset, size, kind)


# name → (parameters, is_variadic, return type or None for void)
EXPECTED: dict[str, tuple[tuple[Param, ...], bool, str | None]] = {
    "j_ints": (
        (
            P("a", "int", S, 4),
            P("b", "unsigned char", U, 1),
            P("c", "long", S, 8),
            P("d", "short", S, 2),
            P("e", "unsigned long long", U, 8),
            P("f", "signed char", S, 1),
        ),
        False,
        "int",
    ),
    "j_floats": (
        (
            P("a", "double", K.DOUBLE, 8),
            P("b", "float", K.FLOAT, 4),
            P("c", "long double", K.LONG_DOUBLE, 16, stack_align=16),
        ),
        False,
        "double",
    ),
    "j_strings": (
        (
            P("s", "const char *", STR, 8),
            P("t", "char *", STR, 8),
            P("u", "unsigned char *", STR, 8),
            P("v", "const signed char *", STR, 8),
            P("bytes", "uint8_t *", PTR, 8),  # a byte buffer, not text
            P("w", "cstr", STR, 8),  # typedef const char *cstr
        ),
        False,
        "size_t",
    ),
    "j_structs": (
        (
            P("p", "struct point", STRUCT, 8, fields=(F(0, 4, S), F(4, 4, S))),
            P("b", "struct big", STRUCT, 24),  # more than 16 bytes: no leaves, MEMORY
            P("pp", "struct point *", PTR, 8),
            P("n", "union num", STRUCT, 8, fields=(F(0, 8, S), F(0, 8, K.DOUBLE))),
            P(
                "v",
                "struct vec3",
                STRUCT,
                12,
                fields=(F(0, 4, K.FLOAT), F(4, 4, K.FLOAT), F(8, 4, K.FLOAT)),
            ),
            P("m", "struct mixed", STRUCT, 16, fields=(F(0, 8, K.DOUBLE), F(8, 8, S))),
            P("ps", "struct packed_s", STRUCT, 5, fields=(F(0, 1, S), F(1, 4, S))),
        ),
        False,
        "long",
    ),
    "j_misc": (
        (
            P("c", "enum color", U, 4),
            P("flag", "_Bool", B, 1),
            P("opaque", "void *", PTR, 8),
            P("n", "my_size", U, 8),
            P("cv", "const volatile int *", PTR, 8),
            P("cp", "char * const", STR, 8),
            P("fn", "int (*)(int)", PTR, 8),
            P("argv", "char **", PTR, 8),
            P("s", "enum sign", S, 4),
        ),
        False,
        "int",
    ),
    "j_variadic": ((P("fmt", "const char *", STR, 8), P("count", "int", S, 4)), True, "int"),
    "j_none": ((), False, None),
    "j_wide": (
        (
            P("w", "__int128", S, 16, stack_align=16),
            P("uw", "unsigned __int128", U, 16, stack_align=16),
        ),
        False,
        "__int128",
    ),
    "j_layouts": (
        (
            # unsigned a:3, b:5 share byte 0; int c
            P("f", "struct flags", STRUCT, 8, fields=(F(0, 1, U), F(4, 4, S))),
            P("z", "complex double", STRUCT, 16, fields=(F(0, 8, K.DOUBLE), F(8, 8, K.DOUBLE))),
            P(
                "t",
                "struct tagged",
                STRUCT,
                6,
                fields=(F(0, 1, S), F(1, 1, S), F(2, 1, S), F(4, 2, S)),
            ),
            P("fz", "complex float", STRUCT, 8, fields=(F(0, 4, K.FLOAT), F(4, 4, K.FLOAT))),
            P("matrix", "int (*)[3]", PTR, 8),
        ),
        False,
        "long",
    ),
    "j_static": ((P("unused_at_o2", "int", S, 4), P("k", "long", S, 8)), False, "int"),
    "j_ret_big": ((P("a", "int", S, 4),), False, "struct big"),
    "j_inlined": ((P("a", "long", S, 8), P("s", "const char *", STR, 8)), False, "int"),
    "j_other": ((P("h", "unsigned short", U, 2), P("d", "double", K.DOUBLE, 8)), False, "double"),
    "main": ((P("argc", "int", S, 4), P("argv", "char **", PTR, 8)), False, "int"),
    "twice": ((P("x", "int", S, 4),), False, "int"),
}


def _gcc(out: Path, *flags: str, sources: tuple[Path, ...] = SOURCES) -> Path:
    cmd = ["gcc", *flags, "-Wall", "-o", str(out), *map(str, sources), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    return out


def _tool(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every way of building jargs_types that must give the same answers."""
    d = tmp_path_factory.mktemp("jargs")
    found = {
        "O0": _gcc(d / "O0", "-g", "-O0"),
        "O2": _gcc(d / "O2", "-g", "-O2"),
        "O2-dwarf4": _gcc(d / "O2-dwarf4", "-gdwarf-4", "-O2"),
        "O2-compressed": _gcc(d / "O2-compressed", "-g", "-gz", "-O2"),
    }
    _tool("objcopy", "--remove-section=.debug_aranges", str(found["O2"]), str(d / "O2-noaranges"))
    found["O2-noaranges"] = d / "O2-noaranges"
    # Stripped, with its DWARF in a separate file found through .gnu_debuglink.
    stripped = d / "O2-stripped"
    shutil.copy(found["O2"], stripped)
    _tool("objcopy", "--only-keep-debug", str(stripped), str(d / "O2-stripped.debug"))
    _tool("strip", "--strip-all", str(stripped))
    _tool("objcopy", f"--add-gnu-debuglink={d / 'O2-stripped.debug'}", str(stripped))
    found["O2-stripped"] = stripped
    return found


@pytest.fixture(scope="module")
def nodebug(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _gcc(tmp_path_factory.mktemp("jargs") / "nodebug", "-O2")


BUILD_NAMES = ("O0", "O2", "O2-dwarf4", "O2-compressed", "O2-noaranges", "O2-stripped")


@pytest.mark.parametrize("build", BUILD_NAMES)
@pytest.mark.parametrize("func", sorted(EXPECTED))
def test_signature(builds: dict[str, Path], build: str, func: str) -> None:
    params, is_variadic, returns = EXPECTED[func]
    signature = get_signature(str(builds[build]), func)
    assert signature is not None
    assert signature.name == func
    assert signature.params == params
    assert signature.is_variadic is is_variadic
    assert (signature.returns and signature.returns.type_name) == returns
    assert function_params(str(builds[build]), func) == params


@pytest.mark.parametrize("build", ("O0", "O2", "O2-dwarf4", "O2-noaranges"))
def test_by_address_is_by_name(builds: dict[str, Path], build: str) -> None:
    path = str(builds[build])
    image = ElfImage.open(path)
    for func in EXPECTED:
        symbol = image.lookup(func)
        assert symbol is not None
        by_addr = get_signature(path, addr=symbol.value)
        assert by_addr == get_signature(path, func)
        assert by_addr is not None and by_addr.entry == symbol.value
        # Not an entry point: no function starts there.
        assert function_params(path, addr=symbol.value + 1) is None


def test_absent(builds: dict[str, Path], nodebug: Path) -> None:
    assert function_params(str(nodebug), "j_ints") is None  # no -g
    assert function_params(str(nodebug), addr=0x1000) is None
    assert function_params(str(builds["O2"]), "no_such_function") is None
    assert function_params(str(builds["O2"]), addr=0) is None
    # A function of libc, declared in our DWARF but not defined in this file.
    assert function_params(str(builds["O2"]), "creal") is None


def test_static_function_without_symbol(builds: dict[str, Path], tmp_path: Path) -> None:
    """With .symtab gone (and no debug file to bring it back), a static function is found by
    scanning the units for its DWARF name."""
    path = tmp_path / "nosymtab"
    _tool("objcopy", "--strip-unneeded", "--keep-section=.debug_*", str(builds["O2"]), str(path))
    assert ElfImage.open(str(path)).lookup("j_static") is None
    assert function_params(str(path), "j_static") == EXPECTED["j_static"][0]
    assert function_params(str(path), "twice") == EXPECTED["twice"][0]


def test_build_id_debug_file(
    builds: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stripped file without a debuglink finds its DWARF under <root>/.build-id/xx/yy.debug."""
    path = tmp_path / "stripped"
    _tool(
        "strip",
        "--strip-all",
        "--remove-section=.gnu_debuglink",
        "-o",
        str(path),
        str(builds["O2"]),
    )
    assert function_params(str(path), "j_ints") is None
    out = subprocess.run(
        ["readelf", "-n", str(path)], check=True, capture_output=True, text=True
    ).stdout
    build_id = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert build_id is not None, "gcc on this machine links with --build-id"
    hexid = build_id.group(1)
    debug = tmp_path / "debug" / ".build-id" / hexid[:2] / f"{hexid[2:]}.debug"
    debug.parent.mkdir(parents=True)
    _tool("objcopy", "--only-keep-debug", str(builds["O2"]), str(debug))
    monkeypatch.setattr(dwarf, "DEBUG_ROOTS", (str(tmp_path / "debug"),))
    os.utime(path, ns=(1, 1))  # a new file identity: the None above is cached for the old one
    assert function_params(str(path), "j_ints") == EXPECTED["j_ints"][0]


def test_clones_are_refused(tmp_path: Path) -> None:
    """work.constprop.0.isra.0 carries work()'s DWARF but not its calling convention."""
    path = _gcc(tmp_path / "clones", "-g", "-O2", sources=(PROGRAMS / "jargs_clones.c",))
    image = ElfImage.open(str(path))
    clones = [s for s in image.iter_functions() if s.name.startswith(("work.", "unused."))]
    if not clones:
        pytest.skip("this gcc did not clone work() and unused()")
    for clone in clones:
        assert function_params(str(path), addr=clone.value) is None
    assert function_params(str(path), "work") is None
    assert function_params(str(path), "main") == EXPECTED["main"][0]


def test_errors_are_target_errors(builds: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(TargetError):
        function_params(str(tmp_path / "missing"), "f")
    text = tmp_path / "text"
    text.write_text("not an ELF file\n")
    with pytest.raises(TargetError):
        function_params(str(text), "f")
    # Garbage in .debug_info: pyelftools fails inside, and we say so with a TargetError.
    corrupt = tmp_path / "corrupt"
    shutil.copy(builds["O2"], corrupt)
    offset = _section_offset(corrupt, ".debug_info")
    with open(corrupt, "r+b") as stream:
        stream.seek(offset + 11)  # past the unit header: the DIEs themselves
        stream.write(b"\xff" * 64)
    with pytest.raises(TargetError):
        function_params(str(corrupt), "j_ints")
    with pytest.raises(TypeError):
        function_params(str(builds["O2"]))


def _section_offset(path: Path, name: str) -> int:
    out = subprocess.run(
        ["readelf", "-SW", str(path)], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        fields = line.replace("[ ", "[").split()
        if len(fields) > 4 and fields[1] == name:
            return int(fields[4], 16)
    raise AssertionError(f"no section {name} in {path}")


def test_cached_per_file_identity(builds: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "prog"
    shutil.copy(builds["O0"], path)
    first = get_signature(str(path), "j_ints")
    assert get_signature(str(path), "j_ints") is first
    # Rewritten in place (a rebuild): read again.
    shutil.copy(builds["O2"], path)
    second = get_signature(str(path), "j_ints")
    assert second is not first and second is not None
    assert second.entry == ElfImage.open(str(builds["O2"])).lookup("j_ints").value  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# Differential: gdb reads the same DWARF with its own reader

# gdb spells unsigned __int128 "__int128 unsigned" (DWARF's name); we write it the C way.
GDB_FUNCS = ("j_ints", "j_floats", "j_strings", "j_structs", "j_misc", "j_variadic", "j_layouts")


def _gdb(path: Path, *commands: str) -> str:
    argv = ["gdb", "-batch", "-nx"]
    for command in commands:
        argv += ["-ex", command]
    return subprocess.run(
        [*argv, str(path)], check=True, capture_output=True, text=True, timeout=60
    ).stdout


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
@pytest.mark.parametrize("build", ("O0", "O2"))
def test_against_gdb(builds: dict[str, Path], build: str) -> None:
    path = builds[build]
    out = _gdb(path, *(f"whatis {func}" for func in GDB_FUNCS))
    spelled = re.findall(r"^type = (.*)$", out, re.MULTILINE)
    assert len(spelled) == len(GDB_FUNCS)
    for func, gdb_type in zip(GDB_FUNCS, spelled, strict=True):
        signature = get_signature(str(path), func)
        assert signature is not None
        assert _as_gdb_type(signature) == gdb_type
    # Names and sizes: "Symbol NAME is <location>, length N." for each parameter, in order.
    # (gdb 13 gives up on some -O2 location lists of struct pieces: "Corrupted DWARF2
    # expression", so at -O2 only functions of scalars are asked.)
    scoped: tuple[str, ...] = ("j_ints", "j_strings", "j_misc")
    if build == "O0":
        scoped += ("j_structs", "j_layouts")
    for func in scoped:
        scope = _gdb(path, f"info scope {func}")
        found = re.findall(
            r"^Symbol (\w+) is .*?, length (\d+)\.$", scope, re.MULTILINE | re.DOTALL
        )
        params = function_params(str(path), func)
        assert params is not None
        assert [(p.name, p.size) for p in params] == [
            (name, int(length)) for name, length in found
        ], func


def _as_gdb_type(signature: Signature) -> str:
    """gdb's ``whatis`` of a function: ``ret (t1, t2, ...)``, ``void (void)`` when empty."""
    types = [p.type_name for p in signature.params]
    if signature.is_variadic:
        types.append("...")
    returns = signature.returns.type_name if signature.returns else "void"
    return f"{returns} ({', '.join(types) or 'void'})"


@pytest.mark.parametrize("build", ("O0", "O2"))
def test_against_readelf(builds: dict[str, Path], build: str) -> None:
    """Every out-of-line function that readelf shows with a DW_AT_low_pc and a name is found
    at that address, with as many parameters as readelf lists formal_parameter children."""
    path = builds[build]
    dump = subprocess.run(
        ["readelf", "--debug-dump=info", str(path)], check=True, capture_output=True, text=True
    ).stdout
    functions = _readelf_functions(dump)
    assert {"j_ints", "j_structs", "j_other"} <= set(functions)
    for name, (low_pc, count) in functions.items():
        signature = get_signature(str(path), addr=low_pc)
        assert signature is not None, name
        assert signature.name == name
        assert len(signature.params) == count, name


def _readelf_functions(dump: str) -> dict[str, tuple[int, int]]:
    """name → (low_pc, formal parameters) for subprograms with their own name and low_pc."""
    found: dict[str, tuple[int, int]] = {}
    entries = re.split(r"\n(?= <\d+><[0-9a-f]+>: Abbrev)", dump)
    current: tuple[str, int] | None = None
    params = 0
    for entry in entries:
        head = re.match(r" <(\d+)><[0-9a-f]+>: Abbrev Number: \d+ \((\w+)\)", entry)
        if head is None:
            continue
        depth, tag = int(head.group(1)), head.group(2)
        if depth == 1:
            if current is not None:
                found[current[0]] = (current[1], params)
            current, params = None, 0
            name = re.search(r"DW_AT_name\s*: (?:\(.*?\): )?(\w+)", entry)
            low_pc = re.search(r"DW_AT_low_pc\s*: (0x[0-9a-f]+)", entry)
            if tag == "DW_TAG_subprogram" and name and low_pc:
                current = (name.group(1), int(low_pc.group(1), 16))
        elif depth == 2 and tag == "DW_TAG_formal_parameter" and current is not None:
            params += 1
    if current is not None:
        found[current[0]] = (current[1], params)
    return found


def test_function_params_is_signature_params(builds: dict[str, Path]) -> None:
    signature = get_signature(str(builds["O2"]), "j_variadic")
    assert signature is not None and signature.is_variadic
    assert function_params(str(builds["O2"]), "j_variadic") == signature.params


LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


@pytest.mark.skipif(not os.path.exists(LIBC), reason="no Debian multiarch libc")
def test_libc_when_its_debug_file_is_installed() -> None:
    """libc6-dbg puts libc's DWARF under /usr/lib/debug/.build-id; without it, None."""
    printf = get_signature(LIBC, "printf")
    if printf is None:
        pytest.skip("libc6-dbg is not installed: libc has no DWARF here")
    assert printf.is_variadic
    assert printf.params == (P("format", "const char *", STR, 8),)
    assert function_params(LIBC, "strtol") == (
        P("nptr", "const char *", STR, 8),
        P("endptr", "char **", PTR, 8),
        P("base", "int", S, 4),
    )
    assert function_params(LIBC, "memcpy") is None  # an IFUNC, implemented in assembly


def test_cxx(tmp_path: Path) -> None:
    """C++: ``this``, references, and classes passed by invisible reference (a pointer)."""
    path = tmp_path / "cxx"
    cmd = ["g++", "-g", "-O2", "-o", str(path), str(PROGRAMS / "jargs_cxx.cpp")]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    scale = get_signature(str(path), "_ZN3geo5Shape5scaleEiRKNS_2ptEd")
    assert scale is not None and scale.name == "scale"
    assert scale.params == (
        P("this", "class Shape * const", PTR, 8),
        P("k", "int", S, 4),
        P("p", "const struct pt &", PTR, 8),
        P("f", "double", K.DOUBLE, 8),
    )
    take = function_params(str(path), "_Z4take5Owner5Plaini4Copy6Holder9DefaultedON3geo2ptE")
    assert take == (
        P("o", "struct Owner", PTR, 8),  # user-provided destructor
        P("q", "struct Plain", STRUCT, 8, fields=(F(0, 8, S),)),
        P("k", "int", S, 4),
        P("c", "struct Copy", PTR, 8),  # user-provided copy constructor
        P("h", "struct Holder", PTR, 8),  # a member with a destructor
        P("d", "struct Defaulted", STRUCT, 8, fields=(F(0, 8, S),)),  # "= default": trivial
        P("r", "struct pt &&", PTR, 8),
    )


def test_ifunc_and_assembly(tmp_path: Path) -> None:
    """An IFUNC symbol's value is its resolver; an assembler function's DWARF lists no
    parameters because GNU as knows none. Neither describes the arguments: None."""
    ifunc = _gcc(tmp_path / "ifunc", "-g", "-O2", sources=(PROGRAMS / "jargs_ifunc.c",))
    assert ElfImage.open(str(ifunc)).lookup("add3").kind.name == "IFUNC"  # type: ignore[union-attr]
    assert function_params(str(ifunc), "add3") is None
    assert function_params(str(ifunc), "add3_generic") == (
        P("a", "long", S, 8),
        P("b", "long", S, 8),
        P("c", "long", S, 8),
    )
    main_c = tmp_path / "asm_main.c"
    main_c.write_text("long j_asm_add(long, long);\nint main(void) { return j_asm_add(1, -1); }\n")
    asm = _gcc(tmp_path / "asm", "-g", "-O2", sources=(main_c, PROGRAMS / "jargs_asm.S"))
    assert function_params(str(asm), "j_asm_add") is None
    assert function_params(str(asm), "main") == ()
