"""The SysV AMD64 argument locations: tables of signatures → locations, then a live check.

The tables are worked out by hand from the psABI (3.2.3). The live check compiles
tests/programs/jargs_abi.c, reads each function's parameters from its DWARF, places them with
assign_locations(), stops gdb at the function's first instruction, and decodes every argument
from the registers and the stack copy gdb prints: each must equal the value main() passed.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kprobes.arch.x86_64.abi import (
    INT_REGS,
    ArgClass,
    ArgLocation,
    ArgSpec,
    FieldSpec,
    assign_locations,
    classify_aggregate,
    gather,
    returns_in_memory,
)

INT = ArgClass.INTEGER
SSE = ArgClass.SSE
MEM = ArgClass.MEMORY

LONG = ArgSpec.integer(8)
INT32 = ArgSpec.integer(4)
DOUBLE = ArgSpec.sse(8)
FLOAT = ArgSpec.sse(4)
LDOUBLE = ArgSpec.x87()
INT128 = ArgSpec.integer(16)


def fields(*leaves: tuple[int, int, ArgClass]) -> tuple[FieldSpec, ...]:
    return tuple(FieldSpec(offset, size, cls) for offset, size, cls in leaves)


def agg(size: int, *leaves: tuple[int, int, ArgClass]) -> ArgSpec:
    return ArgSpec.aggregate(size, fields(*leaves))


# Aggregates by the C declaration they stand for.
POINT = agg(8, (0, 4, INT), (4, 4, INT))  # struct { int x, y; }
INT3 = agg(12, (0, 4, INT), (4, 4, INT), (8, 4, INT))  # struct { int a, b, c; }
TWO_LONGS = agg(16, (0, 8, INT), (8, 8, INT))  # struct { long a, b; }
BIG = agg(24, (0, 8, INT), (8, 8, INT), (16, 8, INT))  # struct { long a, b, c; }
PAIR_F = agg(8, (0, 4, SSE), (4, 4, SSE))  # struct { float x, y; }
VEC3 = agg(12, (0, 4, SSE), (4, 4, SSE), (8, 4, SSE))  # struct { float x, y, z; }
QUAD_F = agg(16, (0, 4, SSE), (4, 4, SSE), (8, 4, SSE), (12, 4, SSE))  # float[4]
MIXED = agg(16, (0, 8, SSE), (8, 8, INT))  # struct { double d; long n; }
INT_FLOAT = agg(8, (0, 4, INT), (4, 4, SSE))  # struct { int i; float f; }: one INTEGER


def R(*names: str, size: int = 8) -> ArgLocation:
    return ArgLocation(size, names)


def STACK(offset: int, size: int = 8) -> ArgLocation:
    return ArgLocation(size, (offset,))


LOCATION_TABLE: list[tuple[str, list[ArgSpec], list[ArgLocation]]] = [
    ("no arguments", [], []),
    (
        "eight longs: six registers, then rsp+8, rsp+16",
        [LONG] * 8,
        [*[R(r) for r in INT_REGS], STACK(8), STACK(16)],
    ),
    (
        "ten doubles: xmm0-7, then the stack",
        [DOUBLE] * 10,
        [R(f"xmm{i}") for i in range(8)] + [STACK(8), STACK(16)],
    ),
    (
        "integers and floats count separately",
        [INT32, DOUBLE, LONG, FLOAT, INT32],
        [R("rdi", size=4), R("xmm0"), R("rsi"), R("xmm1", size=4), R("rdx", size=4)],
    ),
    (
        "seven ints then nine floats, interleaved",
        [INT32, FLOAT] * 7 + [FLOAT, FLOAT],
        [
            R("rdi", size=4),
            R("xmm0", size=4),
            R("rsi", size=4),
            R("xmm1", size=4),
            R("rdx", size=4),
            R("xmm2", size=4),
            R("rcx", size=4),
            R("xmm3", size=4),
            R("r8", size=4),
            R("xmm4", size=4),
            R("r9", size=4),
            R("xmm5", size=4),
            STACK(8, 4),
            R("xmm6", size=4),
            R("xmm7", size=4),
            STACK(16, 4),
        ],
    ),
    (
        "structs of 8, 12, 16 and 24 bytes",
        [POINT, INT3, TWO_LONGS, BIG],
        [R("rdi"), R("rsi", "rdx", size=12), R("rcx", "r8", size=16), STACK(8, 24)],
    ),
    (
        "all-float structs go to xmm, one per eightbyte",
        [PAIR_F, VEC3, QUAD_F],
        [R("xmm0"), R("xmm1", "xmm2", size=12), R("xmm3", "xmm4", size=16)],
    ),
    (
        "a double and a long: one eightbyte each class",
        [MIXED, MIXED],
        [R("xmm0", "rdi", size=16), R("xmm1", "rsi", size=16)],
    ),
    ("an int and a float in one eightbyte: INTEGER wins", [INT_FLOAT], [R("rdi")]),
    (
        "long double: on the stack, 16-aligned, whatever registers are free",
        [LONG, LDOUBLE, LONG, LDOUBLE],
        [R("rdi"), STACK(8, 16), R("rsi"), STACK(24, 16)],
    ),
    (
        "alignment padding before a 16-aligned stack argument",
        [LONG] * 7 + [LDOUBLE, LONG],
        [*[R(r) for r in INT_REGS], STACK(8), STACK(24, 16), STACK(40)],
    ),
    (
        "__int128 takes two registers, any pair",
        [INT32, INT128, INT128],
        [R("rdi", size=4), R("rsi", "rdx", size=16), R("rcx", "r8", size=16)],
    ),
    (
        "__int128 that does not fit: all to the stack, 16-aligned; r9 stays free",
        [LONG] * 5 + [INT128, LONG],
        [R("rdi"), R("rsi"), R("rdx"), R("rcx"), R("r8"), STACK(8, 16), R("r9")],
    ),
    (
        "all or nothing: a two-register struct with one register left",
        [LONG] * 5 + [TWO_LONGS, LONG, LONG],
        [R("rdi"), R("rsi"), R("rdx"), R("rcx"), R("r8"), STACK(8, 16), R("r9"), STACK(24)],
    ),
    (
        "all or nothing, SSE side: a two-xmm struct with one xmm left",
        [DOUBLE] * 7 + [QUAD_F, FLOAT],
        [R(f"xmm{i}") for i in range(7)] + [STACK(8, 16), R("xmm7", size=4)],
    ),
    (
        "a mixed struct needs one of each: no xmm left sends it whole to the stack",
        [DOUBLE] * 8 + [MIXED, LONG],
        [R(f"xmm{i}") for i in range(8)] + [STACK(8, 16), R("rdi")],
    ),
    (
        "stack slots are rounded up to eightbytes",
        [LONG] * 6 + [INT3, INT32, agg(5, (0, 1, INT), (1, 4, INT))],
        [*[R(r) for r in INT_REGS], STACK(8, 12), STACK(24, 4), STACK(32, 5)],
    ),
]


@pytest.mark.parametrize(
    ("specs", "expected"),
    [(specs, expected) for _, specs, expected in LOCATION_TABLE],
    ids=[title for title, _, _ in LOCATION_TABLE],
)
def test_locations(specs: list[ArgSpec], expected: list[ArgLocation]) -> None:
    assert assign_locations(specs) == tuple(expected)


def test_memory_return_takes_rdi() -> None:
    locations = assign_locations([LONG] * 6, returns=BIG)
    assert [loc.parts for loc in locations] == [
        ("rsi",), ("rdx",), ("rcx",), ("r8",), ("r9",), (8,)
    ]  # fmt: skip
    # Returned in registers: nothing changes.
    for returns in (LONG, MIXED, TWO_LONGS, LDOUBLE, None):
        assert assign_locations([LONG], returns=returns)[0].parts == ("rdi",)
    assert returns_in_memory(BIG) and returns_in_memory(agg(5, (0, 1, INT), (1, 4, INT)))
    assert not returns_in_memory(LDOUBLE)  # st0
    assert not returns_in_memory(None)


CLASSIFY_TABLE: list[tuple[str, int, tuple[FieldSpec, ...], tuple[ArgClass, ...]]] = [
    ("struct { int x, y; }", 8, fields((0, 4, INT), (4, 4, INT)), (INT,)),
    ("struct { float x, y, z; }", 12, fields((0, 4, SSE), (4, 4, SSE), (8, 4, SSE)), (SSE, SSE)),
    ("struct { double d; long n; }", 16, fields((0, 8, SSE), (8, 8, INT)), (SSE, INT)),
    ("struct { float f; int i; }", 8, fields((0, 4, SSE), (4, 4, INT)), (INT,)),
    ("union { long l; double d; }", 8, fields((0, 8, INT), (0, 8, SSE)), (INT,)),
    ("union { float f; double d; }", 8, fields((0, 4, SSE), (0, 8, SSE)), (SSE,)),
    ("struct { char c[3]; short s; }", 6, fields((0, 1, INT), (1, 1, INT), (2, 1, INT), (4, 2, INT)), (INT,)),  # noqa: E501
    ("struct { long a, b, c; }", 24, fields((0, 8, INT), (8, 8, INT), (16, 8, INT)), (MEM,)),
    ("packed struct { char c; int n; }", 5, fields((0, 1, INT), (1, 4, INT)), (MEM,)),
    ("struct { long double v; }", 16, fields((0, 16, ArgClass.X87)), (MEM,)),
    ("struct { __int128 w; }", 16, fields((0, 16, INT)), (INT, INT)),
    ("struct { _Alignas(16) char c; }: padding eightbyte dropped", 16, fields((0, 1, INT)), (INT,)),
    ("struct {} (GNU C)", 0, (), ()),
    ("double _Complex", 16, fields((0, 8, SSE), (8, 8, SSE)), (SSE, SSE)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("size", "leaves", "expected"),
    [row[1:] for row in CLASSIFY_TABLE],
    ids=[row[0] for row in CLASSIFY_TABLE],
)
def test_classify_aggregate(
    size: int, leaves: tuple[FieldSpec, ...], expected: tuple[ArgClass, ...]
) -> None:
    assert classify_aggregate(size, leaves) == expected


def test_merge_rules() -> None:
    nothing = ArgClass.NO_CLASS
    assert nothing.merge(SSE) is SSE and SSE.merge(nothing) is SSE
    assert INT.merge(SSE) is INT and SSE.merge(INT) is INT
    assert MEM.merge(SSE) is MEM and ArgClass.X87.merge(SSE) is MEM
    assert SSE.merge(SSE) is SSE


def test_argspec_checks() -> None:
    with pytest.raises(ValueError):
        ArgSpec(8, (ArgClass.NO_CLASS,))
    with pytest.raises(ValueError):
        ArgSpec(8, (INT,), align=12)
    assert LDOUBLE.is_in_memory and BIG.is_in_memory and not MIXED.is_in_memory
    assert agg(0).classes == () and assign_locations([agg(0)]) == (ArgLocation(0, ()),)


def test_gather() -> None:
    regs = {
        "rdi": (-2 & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"),
        "rsi": (0x1122334455667788).to_bytes(8, "little"),
        "xmm0": struct.pack("<dd", 1.5, 99.0),
    }
    stack = bytes(range(64))
    assert gather(R("rdi", size=4), regs.__getitem__, stack) == b"\xfe\xff\xff\xff"
    assert gather(R("xmm0", "rsi", size=16), regs.__getitem__, stack) == struct.pack(
        "<dQ", 1.5, 0x1122334455667788
    )
    assert gather(STACK(8, 12), regs.__getitem__, stack) == bytes(range(8, 20))
    # A padding-only eightbyte past the registers reads as zeros.
    assert gather(R("rdi", size=16), regs.__getitem__, stack)[8:] == bytes(8)
    with pytest.raises(ValueError):
        gather(STACK(60, 8), regs.__getitem__, stack)
    location = STACK(40, 16)
    assert location.is_on_stack and location.stack_offset == 40 and location.registers == ()
    location = R("xmm0", "rdi", size=16)
    assert not location.is_on_stack and location.stack_offset is None
    assert location.registers == ("xmm0", "rdi")


# ---------------------------------------------------------------------------------------------
# Live: DWARF → ArgSpec → locations, read back from a real call stopped in gdb

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "jargs_abi.c"

INT128_VALUE = (0x1234 << 64) | 0x5678
# What main() passes, per function: a scalar, or a tuple of the struct's leaves in order.
PASSED: dict[str, list[object]] = {
    "j_abi_many": [
        -1, 0.5, (1.25, -2.5), 2, (3.75, -4), b"big", 1.5, "str", 2.75, 200, (8, -9), -3,
        INT128_VALUE, 20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0, -27, (10.5, 11.5, -12.5),
        True, (ord("P"), 13), (-14.25,),
    ],
    "j_abi_sret": [31, 32, 33, 34, 35, 36],
    "j_abi_allornothing": [41, 42, 43, 44, 45, (8, -9), 46],
}  # fmt: skip
BIG_BYTES = struct.pack("<3q", 5, -6, 7)  # struct big { 5, -6, 7 }: no leaves, > 16 bytes
# Expected places in j_abi_many, worked out by hand as in the tables above.
MANY_PARTS = [
    ("rdi",), ("xmm0",), ("xmm1",), ("rsi",), ("xmm2", "rdx"), (8,), ("xmm3",), ("rcx",),
    (40,), ("r8",), (56,), ("r9",), (72,), ("xmm4",), ("xmm5",), ("xmm6",), ("xmm7",), (88,),
    (96,), (104,), (112,), (120,), (136,), (144,), (152,),
]  # fmt: skip
GPRS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
STACK_WORDS = 48


def _spec(param: object) -> ArgSpec:
    """The conversion a jprobe makes from a DWARF Param to an ArgSpec."""
    from kprobes.symbols.dwarf import Param, ParamKind

    assert isinstance(param, Param)
    kind = param.kind
    if kind in (ParamKind.FLOAT, ParamKind.DOUBLE):
        return ArgSpec.sse(param.size)
    if kind is ParamKind.LONG_DOUBLE:
        return ArgSpec.x87()
    if kind is ParamKind.STRUCT:
        leaves = [FieldSpec(f.offset, f.size, _leaf_class(f.kind)) for f in param.fields]
        return ArgSpec.aggregate(param.size, leaves, param.stack_align)
    return ArgSpec.integer(param.size)


def _leaf_class(kind: object) -> ArgClass:
    from kprobes.symbols.dwarf import ParamKind

    if kind in (ParamKind.FLOAT, ParamKind.DOUBLE):
        return SSE
    if kind is ParamKind.LONG_DOUBLE:
        return ArgClass.X87
    return INT


def _long_double(raw: bytes) -> float:
    """An x87 80-bit extended value (the low 10 of 16 bytes) as a Python float."""
    mantissa = int.from_bytes(raw[:8], "little")
    top = int.from_bytes(raw[8:10], "little")
    sign = -1.0 if top & 0x8000 else 1.0
    exponent = top & 0x7FFF
    return sign * mantissa * 2.0 ** (exponent - 16383 - 63)


def _decode(kind: object, raw: bytes) -> object:
    from kprobes.symbols.dwarf import ParamKind

    if kind is ParamKind.FLOAT:
        return struct.unpack("<f", raw[:4])[0]
    if kind is ParamKind.DOUBLE:
        return struct.unpack("<d", raw[:8])[0]
    if kind is ParamKind.LONG_DOUBLE:
        return _long_double(raw)
    if kind is ParamKind.BOOL:
        return bool(raw[0])
    return int.from_bytes(raw, "little", signed=kind is ParamKind.SIGNED)


def _gdb_stop(
    program: Path, func: str, strings: list[str]
) -> tuple[dict[str, bytes], bytes, list[str]]:
    """Registers, the stack from rsp and the C strings at ``strings`` (gdb expressions), at
    the first instruction of ``func``."""
    commands = [f"break *{func}", "run"]
    commands += [f'printf "R {r} %lx\\n", ${r}' for r in GPRS]
    commands += [f'printf "R xmm{i} %lx\\n", $xmm{i}.v2_int64[0]' for i in range(8)]
    commands += [f'printf "S %s\\n", (char *)({expr})' for expr in strings]
    commands += [f"x/{STACK_WORDS}gx $rsp", "kill"]
    argv = ["gdb", "-batch", "-nx"] + [arg for c in commands for arg in ("-ex", c)]
    out = subprocess.run(
        [*argv, str(program)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    regs = {
        m[1]: (int(m[2], 16) & (2**64 - 1)).to_bytes(8, "little")
        for m in re.finditer(r"^R (\w+) ([0-9a-f]+)$", out, re.MULTILINE)
    }
    words = [
        int(w, 16)
        for line in re.findall(r"^0x[0-9a-f]+(?: <[^>]*>)?:\s+(.*)$", out, re.MULTILINE)
        for w in line.split()
    ]
    assert len(regs) == len(GPRS) + 8 and len(words) == STACK_WORDS, out
    stack = b"".join(w.to_bytes(8, "little") for w in words)
    return regs, stack, re.findall(r"^S (.*)$", out, re.MULTILINE)


@pytest.fixture(scope="module", params=["-O0", "-O2"])
def abi_program(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("jargs_abi") / f"jargs_abi{request.param}"
    cmd = ["gcc", "-g", request.param, "-Wall", "-o", str(out), str(PROGRAM)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    return out


@pytest.mark.ptrace
@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
@pytest.mark.parametrize("func", sorted(PASSED))
def test_live_call(abi_program: Path, func: str) -> None:
    from kprobes.symbols.dwarf import ParamKind, get_signature

    signature = get_signature(str(abi_program), func)
    assert signature is not None
    returns = None if signature.returns is None else _spec(signature.returns)
    locations = assign_locations([_spec(p) for p in signature.params], returns=returns)
    if func == "j_abi_many":
        assert [loc.parts for loc in locations] == MANY_PARTS
    # Step 1: stop at the first instruction; ask gdb for the strings where we say they are.
    strings = []
    for param, location in zip(signature.params, locations, strict=True):
        if param.kind is ParamKind.CHAR_POINTER:
            offset = location.stack_offset
            strings.append(
                f"${location.parts[0]}" if offset is None else f"*(char **)($rsp+{offset})"
            )
    regs, stack, texts = _gdb_stop(abi_program, func, strings)
    # Step 2: every argument, decoded from where assign_locations put it.
    got: list[object] = []
    for param, location in zip(signature.params, locations, strict=True):
        raw = gather(location, regs.__getitem__, stack)
        if param.kind is ParamKind.CHAR_POINTER:
            got.append(texts.pop(0))
        elif param.kind is ParamKind.STRUCT and param.fields:
            got.append(
                tuple(_decode(f.kind, raw[f.offset : f.offset + f.size]) for f in param.fields)
            )
        elif param.kind is ParamKind.STRUCT:
            got.append(b"big" if raw == BIG_BYTES else raw)
        else:
            got.append(_decode(param.kind, raw))
    assert got == PASSED[func]
