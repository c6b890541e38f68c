"""The unwinder (kprobes.symbols.unwind): its tables against readelf, its walks against GDB.

Three layers. The walk itself against fake stacks (the frame-pointer chain, the return
translation that return probes need, every way a walk ends) and against libc's own
hand-written entries (the PLT's CFA expression, the signal trampoline). Every decoded row of
every FDE against ``readelf --debug-dump=frames-interp``. And whole stack traces of real
programs built at several optimization levels, stopped by a Kprobe at the instruction where
GDB's ``break`` stops, against GDB's backtrace of the same binary at the same place (with
``backtrace past-main`` on, so that libc's start frames and ``_start`` are compared too).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import kprobes
from kprobes import Kprobe
from kprobes.errors import TargetError
from kprobes.symbols.resolve import SymbolResolver
from kprobes.symbols.unwind import (
    DWARF_REGISTERS,
    Fde,
    FoundBy,
    Frame,
    Row,
    Rule,
    StopReason,
    find_fde,
    unwind,
)

SOURCE = Path(__file__).resolve().parents[1] / "programs" / "backtrace.c"

# -- fake stacks ---------------------------------------------------------------------------


class Memory:
    """Words of a fake stack; reading anything else fails as an unmapped page would."""

    def __init__(self, words: dict[int, int]) -> None:
        self.words = words
        self.reads: list[int] = []

    def __call__(self, addr: int) -> int:
        self.reads.append(addr)
        if addr not in self.words:
            raise TargetError(f"cannot read 8 bytes at {addr:#x}")
        return self.words[addr]


def nowhere(_addr: int) -> tuple[str, int] | None:
    return None


# A frame-pointer chain: rip in a frame whose rbp is 0x7010; two callers; a zero return
# address ends it (glibc's _start clears rbp, and zero is what the outermost frame holds).
FP_STACK = {
    0x7010: 0x7040,  # saved rbp
    0x7018: 0x2000,  # return address
    0x7040: 0x7080,
    0x7048: 0x3000,
    0x7080: 0,
    0x7088: 0,
}
FP_REGS = {"rip": 0x1000, "rsp": 0x7000, "rbp": 0x7010}


def test_frame_pointer_chain_when_no_module_has_unwind_tables() -> None:
    looked_up: list[int] = []

    def module_at(addr: int) -> tuple[str, int] | None:
        looked_up.append(addr)
        return None

    frames = unwind(FP_REGS, Memory(FP_STACK), module_at)
    assert frames == [
        Frame(0x1000, 0x7020, FoundBy.FIRST),
        Frame(0x2000, 0x7050, FoundBy.FP),
        Frame(0x3000, 0x7090, FoundBy.FP, StopReason.OUTERMOST),
    ]
    # rip is the instruction itself; a return address follows its call, one byte back.
    assert looked_up == [0x1000, 0x1FFF, 0x2FFF]


def test_every_return_address_goes_through_translate_with_its_slot() -> None:
    tramp = 0xDEAD0000
    memory = Memory({**FP_STACK, 0x7018: tramp})
    seen: list[tuple[int, int]] = []

    def translate(slot: int, value: int) -> int:
        seen.append((slot, value))
        return 0x2000 if (slot, value) == (0x7018, tramp) else value

    frames = unwind(FP_REGS, memory, nowhere, translate)
    assert [f.addr for f in frames] == [0x1000, 0x2000, 0x3000]
    assert seen == [(0x7018, tramp), (0x7048, 0x3000), (0x7088, 0)]


def test_max_frames_cuts_the_walk_and_says_so() -> None:
    frames = unwind(FP_REGS, Memory(FP_STACK), nowhere, max_frames=2)
    assert frames == [
        Frame(0x1000, 0x7020, FoundBy.FIRST),
        Frame(0x2000, 0x7050, FoundBy.FP, StopReason.MAX_FRAMES),
    ]
    assert unwind(FP_REGS, Memory(FP_STACK), nowhere, max_frames=0) == []


def test_unreadable_stack_ends_the_walk() -> None:
    memory = Memory({k: v for k, v in FP_STACK.items() if k != 0x7048})
    frames = unwind(FP_REGS, memory, nowhere)
    assert frames[-1] == Frame(0x2000, None, FoundBy.FP, StopReason.UNREADABLE)


@pytest.mark.parametrize(
    "rbp",
    [0x6FF0, 0x7011, 0x7000 + (1 << 25)],
    ids=["below-sp", "misaligned", "far-above-sp"],
)
def test_implausible_frame_pointer_is_not_followed(rbp: int) -> None:
    memory = Memory(FP_STACK)
    frames = unwind({**FP_REGS, "rbp": rbp}, memory, nowhere)
    assert frames == [Frame(0x1000, None, FoundBy.FIRST, StopReason.NO_MODULE)]
    assert memory.reads == []


# -- libc's hand-written entries -----------------------------------------------------------


def libc_path() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libc.so" in path or "/libc-" in path:
                return path
    pytest.skip("this Python does not map libc")


def libc_fde(predicate: Callable[[ReadelfEntry], bool]) -> ReadelfEntry:
    frames = readelf_frames(libc_path())
    for entry in frames.values():
        if entry.is_fde and predicate(entry):
            return entry
    pytest.skip("libc has no such FDE")


def test_plt_cfa_expression() -> None:
    # The PLT's CFA is rsp+8, or rsp+16 in the second half of each 16-byte entry, where the
    # lazy-binding push has happened: an expression over rsp and rip.
    path = libc_path()
    plt = libc_fde(lambda e: any(cells[0] == "exp" for _pc, cells in e.rows))
    pc = next(pc for pc, cells in plt.rows if cells[0] == "exp")
    entry = pc + 0x10 - pc % 0x10
    ret = 1 << 40  # above libc's link-time addresses, which module_at maps to libc
    for rip, cfa in ((entry, 0x7008), (entry + 6, 0x7008), (entry + 11, 0x7010)):
        memory = Memory({cfa - 8: ret})
        frames = unwind(
            {"rip": rip, "rsp": 0x7000}, memory, lambda a: (path, 0) if a < ret else None
        )
        assert frames[0] == Frame(rip, cfa, FoundBy.FIRST), hex(rip - entry)
        assert frames[1].addr == ret


def test_signal_frame_resumes_at_the_interrupted_instruction_with_its_registers() -> None:
    path = libc_path()
    sigreturn = libc_fde(lambda e: "S" in e.augmentation)
    rip, sp = sigreturn.start + 1, 0x7000  # __restore_rt, with rsp at its ucontext
    # Saved registers of the interrupted context (struct sigcontext, at rsp + 40).
    context = {"rbp": 0x9100, "rsp": 0x9000, "rip": 0x4444, "rbx": 0xB8}
    offsets = {"rbp": 120, "rsp": 160, "rip": 168, "rbx": 128}
    memory = Memory({sp + offsets[name]: value for name, value in context.items()})
    memory.words |= {0x9100: 0, 0x9108: 0}  # the interrupted frame's rbp chain ends there
    looked_up: list[int] = []

    def module_at(addr: int) -> tuple[str, int] | None:
        looked_up.append(addr)
        return (path, 0) if addr < 0x4000 or addr > 0x5000 else None

    frames = unwind({"rip": rip, "rsp": sp, "rbp": 1}, memory, module_at)
    assert frames[0] == Frame(rip, 0x9000, FoundBy.FIRST)
    # The interrupted frame: at 0x4444 itself (not a return address), and with the saved
    # rbp, through which the frame-pointer walk goes on.
    assert frames[1] == Frame(0x4444, 0x9110, FoundBy.SIGNAL, StopReason.OUTERMOST)
    assert looked_up == [rip, 0x4444]


# -- the tables against readelf ------------------------------------------------------------


@dataclass
class ReadelfEntry:
    """One CIE or FDE as ``readelf --debug-dump=frames-interp`` prints it."""

    offset: int
    is_fde: bool
    cie: int = 0
    augmentation: str = ""
    start: int = 0
    end: int = 0
    columns: list[str] = field(default_factory=list)  # "CFA", then register names, "ra"
    rows: list[tuple[int, list[str]]] = field(default_factory=list)


_ENTRY = re.compile(
    r"^([0-9a-f]{8,16}) [0-9a-f]+ [0-9a-f]+ "
    r'(?:CIE "([^"]*)"|FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+))'
)
_ROW = re.compile(r"^([0-9a-f]{16}) (.*)$")
_CELL = re.compile(r"r\d+ \([^)]*\)|\S+")


def readelf_frames(path: str, section: str = ".eh_frame") -> dict[int, ReadelfEntry]:
    out = subprocess.run(
        ["readelf", "--debug-dump=frames-interp", path],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout  # its status is 1 for libc, which has no .debug_info of its own: not an error
    assert "Contents of the" in out, f"readelf printed no frame section for {path}"
    entries: dict[int, ReadelfEntry] = {}
    current: ReadelfEntry | None = None
    in_section = False
    for line in out.splitlines():
        if line.startswith("Contents of the "):
            in_section = line.startswith(f"Contents of the {section} section")
            continue
        if not in_section:
            continue
        if m := _ENTRY.match(line):
            offset = int(m.group(1), 16)
            if m.group(2) is not None:
                current = ReadelfEntry(offset, is_fde=False, augmentation=m.group(2))
            else:
                current = ReadelfEntry(
                    offset,
                    is_fde=True,
                    cie=int(m.group(3), 16),
                    start=int(m.group(4), 16),
                    end=int(m.group(5), 16),
                )
            entries[offset] = current
        elif current is not None and line.strip().startswith("LOC"):
            current.columns = line.split()[1:]
        elif current is not None and (m := _ROW.match(line)):
            current.rows.append((int(m.group(1), 16), _CELL.findall(m.group(2))))
    for entry in entries.values():
        if entry.is_fde:
            cie = entries[entry.cie]
            entry.augmentation = cie.augmentation
            if not entry.rows and cie.rows:  # no instructions: the CIE's row holds throughout
                entry.columns = cie.columns
                entry.rows = [(entry.start, cie.rows[-1][1])]
    return entries


def register_number(name: str) -> int:
    return 16 if name == "ra" else DWARF_REGISTERS.index(name)


def readelf_cells(fde: Fde, row: Row, columns: list[str]) -> list[str]:
    """Our row as readelf prints it."""
    if row.cfa_expr is not None:
        cells = ["exp"]
    else:
        assert row.cfa_reg is not None
        cells = [f"{DWARF_REGISTERS[row.cfa_reg]}{row.cfa_offset:+d}"]
    for name in columns[1:]:
        kind, arg = row.rules.get(register_number(name), (Rule.UNDEFINED, 0))
        match kind:
            case Rule.UNDEFINED:
                cells.append("u")
            case Rule.SAME_VALUE:
                cells.append("s")
            case Rule.OFFSET:
                cells.append(f"c{arg:+d}")
            case Rule.VAL_OFFSET:
                cells.append(f"v{arg:+d}")
            case Rule.REGISTER:
                assert isinstance(arg, int)
                cells.append(f"r{arg} ({DWARF_REGISTERS[arg]})")
            case Rule.EXPRESSION:
                cells.append("exp")
            case Rule.VAL_EXPRESSION:
                cells.append("vexp")
    return cells


def compare_with_readelf(path: str, section: str) -> int:
    """Check every row of every FDE of ``section``; return how many FDEs were compared."""
    compared = 0
    for entry in readelf_frames(path, section).values():
        if not entry.is_fde or entry.start >= entry.end or not entry.rows:
            continue
        fde = find_fde(path, entry.start)
        assert fde is not None, f"{path}: no FDE for {entry.start:#x}"
        assert (fde.start, fde.end) == (entry.start, entry.end)
        assert fde.is_signal_frame == ("S" in entry.augmentation)
        numbers = {register_number(name) for name in entry.columns[1:]}
        pcs = sorted({pc for pc, _ in entry.rows} | set(fde.pcs))
        expected = dict(entry.rows)
        for pc in pcs:
            theirs = expected[max(p for p in expected if p <= pc)]
            row = fde.row_at(pc)
            assert row is not None
            assert set(row.rules) <= numbers | {fde.ra_column}
            ours = readelf_cells(fde, row, entry.columns)
            assert ours == theirs, f"{path} FDE {entry.offset:#x} at {pc:#x}"
        compared += 1
    return compared


def libstdcxx_path() -> str:
    """libstdc++, whose C++ code is full of DW_CFA_GNU_args_size."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to find libstdc++")
    found = subprocess.run(
        ["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    if not os.path.isabs(found):
        pytest.skip("g++ does not know where libstdc++ is")
    return os.path.realpath(found)


@pytest.mark.parametrize("library", [libc_path, libstdcxx_path], ids=["libc", "libstdc++"])
def test_every_library_fde_decodes_as_readelf_decodes_it(library: Callable[[], str]) -> None:
    assert compare_with_readelf(library(), ".eh_frame") > 1000


@pytest.mark.parametrize("variant", ["O0", "O2", "debug_frame"])
def test_program_fdes_decode_as_readelf_decodes_them(
    variants: dict[str, Path], variant: str
) -> None:
    path = str(variants[variant])
    assert compare_with_readelf(path, ".eh_frame") > 0
    if variant == "debug_frame":
        assert compare_with_readelf(path, ".debug_frame") >= 5  # main, a, b, c, cmp, rec


# -- whole walks against GDB ---------------------------------------------------------------

VARIANTS = {
    "O0": ("-O0", "-g"),
    "O2": ("-O2", "-g"),
    "O2-fp": ("-O2", "-g", "-fno-omit-frame-pointer"),
    "O0-nofp": ("-O0", "-g", "-fomit-frame-pointer"),
    # -g without unwind tables: the compiler writes .debug_frame instead of .eh_frame.
    "debug_frame": ("-O0", "-g", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"),
    # No CFI at all for the program's own functions: frame pointers only.
    "fp-only": ("-O0", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"),
}


@pytest.fixture(scope="session")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the test program")
    out = tmp_path_factory.mktemp("unwind")
    built = {}
    for name, flags in VARIANTS.items():
        path = out / f"backtrace-{name}"
        subprocess.run(
            ["gcc", *flags, "-Wall", "-o", str(path), str(SOURCE)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        built[name] = path
    return built


# Prints each frame that exists on the stack as: FRAME <file basename> <pc - lowest mapping
# of that file> <name>. GDB also shows frames that do not: inlined calls (sharing their
# caller's pc), and with call-site debug information the functions that tail-jumped away
# (libc's qsort, a jmp to qsort_r): a stack walk cannot see either, by design.
GDB_SCRIPT = r"""
import os
import gdb

pid = gdb.selected_inferior().pid
maps = []
lowest = {}
with open(f"/proc/{pid}/maps") as lines:
    for line in lines:
        parts = line.split(None, 5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5].strip() if len(parts) > 5 else ""
        maps.append((start, end, path))
        if path.startswith("/"):
            lowest[path] = min(lowest.get(path, start), start)
frame = gdb.newest_frame()
while frame is not None:
    if frame.type() not in (gdb.INLINE_FRAME, gdb.TAILCALL_FRAME):
        pc = frame.pc()
        path = next((p for s, e, p in maps if s <= pc < e), "")
        if path in lowest:
            print(f"FRAME {os.path.basename(path)} {pc - lowest[path]:#x} {frame.name()}")
        else:
            print(f"FRAME ? {pc:#x} {frame.name()}")
    frame = frame.older()
gdb.execute("kill")
"""


@dataclass(frozen=True)
class Where:
    """A code address as (file basename, offset from the file's lowest mapping)."""

    module: str
    offset: int

    def __str__(self) -> str:
        return f"{self.module}+{self.offset:#x}"


def gdb_backtrace(tmp_path: Path, argv: list[str], breakpoint: str) -> list[tuple[Where, str]]:
    script = tmp_path / "frames.py"
    script.write_text(GDB_SCRIPT)
    cmd = [
        "gdb",
        "-nx",
        "-batch",
        "-iex",
        "set debuginfod enabled off",
        "-ex",
        "set backtrace past-main on",
        "-ex",
        f"break {breakpoint}",
        "-ex",
        "run",
        "-x",
        str(script),
        "--args",
        *argv,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    frames = []
    for line in result.stdout.splitlines():
        if line.startswith("FRAME "):
            _, module, offset, name = line.split(" ", 3)
            frames.append((Where(module, int(offset, 16)), name))
    assert frames, f"gdb did not stop at {breakpoint}:\n{result.stdout}\n{result.stderr}"
    return frames


def where(resolver: SymbolResolver, addr: int) -> Where:
    module = resolver.get_module_at(addr)
    assert module is not None, f"{addr:#x} is in no module"
    return Where(module.name, addr - module.start)


@pytest.fixture
def gdb_available() -> None:
    if shutil.which("gdb") is None:
        pytest.skip("gdb is the reference for these walks")


CASES = [
    ("O0", "chain", "c"),
    ("O2", "chain", "c"),
    ("O2-fp", "chain", "c"),
    ("O0-nofp", "chain", "c"),
    ("debug_frame", "chain", "c"),
    ("fp-only", "chain", "c"),
    ("O0", "sort", "cmp"),
    ("O2", "sort", "cmp"),
    ("fp-only", "sort", "cmp"),
    ("O2", "rec 4", "c"),
]


@pytest.mark.ptrace
@pytest.mark.parametrize(("variant", "mode", "breakpoint"), CASES)
def test_walk_matches_gdb_backtrace(
    variants: dict[str, Path],
    gdb_available: None,
    spawn: Callable[..., Any],
    tmp_path: Path,
    variant: str,
    mode: str,
    breakpoint: str,
) -> None:
    argv = [str(variants[variant]), *mode.split()]
    expected = gdb_backtrace(tmp_path, argv, breakpoint)
    with open(os.devnull, "wb") as devnull:
        proc = spawn(argv, stdout=devnull)
    resolver = SymbolResolver(proc.pid)
    main = resolver.main_module()
    stop_at = expected[0][0]
    assert stop_at.module == main.name

    def read_word(addr: int) -> int:
        return int.from_bytes(proc.read(addr, 8), "little")

    def module_at(addr: int) -> tuple[str, int] | None:
        module = resolver.get_module_at(addr)
        return None if module is None else (f"/proc/{proc.pid}/root{module.path}", module.bias)

    walks: list[list[Frame]] = []

    def pre_handler(_kp: Kprobe, regs: Any) -> None:
        if not walks:
            resolver.refresh()  # spawned before the loader mapped the libraries
        walks.append(unwind(regs.as_dict(), read_word, module_at))

    proc.register_kprobe(Kprobe(addr=main.start + stop_at.offset, pre_handler=pre_handler))
    assert proc.run(timeout=30)
    assert proc.exit_code == 0
    assert walks, "the probe was never hit"
    walk = walks[0]  # where GDB stopped: the first hit
    got = [str(where(resolver, frame.addr)) for frame in walk]
    assert got == [str(w) for w, _ in expected], ([name for _, name in expected], walk[-1])
    # GDB's walk ends at _start, where the unwind table marks the return address undefined.
    assert walk[-1].stop is StopReason.OUTERMOST
    assert walk[0].how is FoundBy.FIRST
    if variant == "fp-only":
        assert walk[1].how is FoundBy.FP  # the program's own frames have no CFI
    else:
        assert all(f.how is FoundBy.CFI for f in walk[1:])


def test_unwind_imports_nothing_above_the_symbols_layer() -> None:
    source = Path(kprobes.__file__).parent / "symbols" / "unwind.py"
    imports = re.findall(r"^(?:from|import) (kprobes\.\S+)", source.read_text(), re.M)
    assert imports
    assert all(
        name.startswith(("kprobes.errors", "kprobes.symbols", "kprobes.values")) for name in imports
    )
