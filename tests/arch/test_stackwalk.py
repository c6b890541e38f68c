"""The fast tier's stack walker (kprobes/arch/x86_64/stackwalk.py): the directory and output
as values, and the code run for real in tests/programs/walk_harness.c, without ptrace.

The harness (built at -O2 without frame pointers) takes stacks at ``leaf`` by known paths,
through an alloca frame (CFA on rbp), a shared library, libc's qsort, a thread, and a deep
recursion under a depth limit; the tool side compiles the compact tables of every file the
harness maps (symbols/frametable.py), packs them as the walker reads them, and sends the
walk's code. Each walk must give exactly the return addresses that glibc's backtrace()
(libgcc's own DWARF unwinder) finds from the same place, end at the outermost frame, and
agree with symbols/tablewalk.py (the Python reference of this code) run over the same rows
and the same stack memory, which the harness dumps. Stacks that cannot be walked (a stack
pointer on a PROT_NONE page, a pc in no mapping) must end cleanly with their reason, the
fault absorbed by the fetch fixup convention. Last, the walk inside a record action, in
tests/programs/detour_harness.c's detour.
"""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from iced_x86 import Decoder, InstructionInfoFactory, Mnemonic, OpAccess, Register, RegisterExt
from support import symbol
from test_detour_live import (
    BEST_CPU_ID,
    THREAD_IDS,
    build_harness,
    create_area,
    drain,
    finish,
    install,
    launch,
)

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64 import stackwalk as sw
from kprobes.arch.x86_64.abi import FETCH_FAULT_MAGIC
from kprobes.arch.x86_64.record import RecordAction
from kprobes.arch.x86_64.stackwalk import (
    MappedTable,
    StackWalk,
    WalkResult,
    WalkStop,
    build_walk_function,
    pack_directory,
    read_walk,
    read_walk_at,
)
from kprobes.errors import InternalError, TargetError
from kprobes.symbols import tablewalk
from kprobes.symbols.frametable import ROW, Kind, table_of
from kprobes.symbols.maps import iter_modules
from kprobes.symbols.unwind import Frame

SHORT = 8  # the short walk's depth limit

# ---- values ----------------------------------------------------------------------------------


def test_the_row_layout_is_the_compiler_s() -> None:
    assert ROW.size == sw.ROW_SIZE
    row = ROW.pack(0x12345678, -16, 6, Kind.OUTERMOST)
    assert struct.unpack_from("<i", row, 0)[0] == 0x12345678
    assert struct.unpack_from("<h", row, sw.ROW_RBP)[0] == -16
    assert row[sw.ROW_BASE] == 6 and row[sw.ROW_KIND] == Kind.OUTERMOST
    assert (Kind.CFA, Kind.OUTERMOST, Kind.UNSUPPORTED) == (
        sw.KIND_CFA,
        sw.KIND_OUTERMOST,
        sw.KIND_UNSUPPORTED,
    )


def table_bytes(rows: int) -> bytes:
    return struct.pack(f"<{rows}I", *range(rows)) + bytes(sw.ROW_SIZE * rows)


def test_the_directory_is_sorted_and_its_tables_aligned() -> None:
    one = MappedTable(0x7000, 0x8000, 0x6000, table_bytes(3), 3)
    two = MappedTable(0x1000, 0x2000, 0, table_bytes(1), 1)
    blob = pack_directory([one, two])
    assert struct.unpack_from("<Q", blob, 0) == (2,)
    first = sw.ENTRY.unpack_from(blob, sw.DIR_HEADER)
    second = sw.ENTRY.unpack_from(blob, sw.DIR_HEADER + sw.ENTRY.size)
    assert first[:3] == (0x1000, 0x2000, 0) and first[4] == 1
    assert second[:3] == (0x7000, 0x8000, 0x6000) and second[4] == 3
    # Offsets are the entry's own (an indirect walk reads the directory's address once).
    at_first, at_second = sw.DIR_HEADER, sw.DIR_HEADER + sw.ENTRY.size
    table_one, table_two = at_first + first[3], at_second + second[3]
    assert table_one % 8 == 0 and table_two % 8 == 0 and table_one >= 8 + 2 * sw.ENTRY.size
    assert blob[table_one : table_one + 12] == table_bytes(1)
    assert blob[table_two : table_two + 36] == table_bytes(3)
    with pytest.raises(InternalError):
        MappedTable(0, 1, 0, b"\0" * 11, 1)


def test_the_block_index_names_the_row_at_each_block_s_start() -> None:
    starts = [0x100, 0x180, 0x300, 0x301, 0x5FF]
    table = struct.pack("<5I", *starts) + bytes(sw.ROW_SIZE * 5)
    index, first = sw.block_index(table, 5)
    assert first == 0x100
    # Blocks at 0x100, 0x200, 0x300, 0x400, 0x500, and the end past the last row's.
    assert struct.unpack(f"<{len(index) // 4}I", index) == (0, 1, 2, 3, 3, 4)
    assert sw.block_index(b"", 0) == (b"", 0)
    blob = pack_directory([MappedTable(0x1000, 0x2000, 0, table, 5)])
    entry = sw.ENTRY.unpack_from(blob, sw.DIR_HEADER)
    assert entry[5:8] == (entry[3] + len(table), 5, 0x100)
    index_at = sw.DIR_HEADER + entry[5]
    assert blob[index_at : index_at + len(index)] == index


def test_the_output_read_back() -> None:
    out = struct.pack("<4Q", 3 | WalkStop.MAX_FRAMES << 32, 0x10, 0x20, 0x30)
    assert read_walk(out) == WalkResult((0x10, 0x20, 0x30), WalkStop.MAX_FRAMES)
    assert read_walk(struct.pack("<Q", WalkStop.UNREADABLE << 32)) == WalkResult(
        (), WalkStop.UNREADABLE
    )


def test_a_record_s_walk_is_decoded_once() -> None:
    """The reader's decoding (``read_walk_at``): the walk after a record's captures, the
    same value for the same walk whatever the unused slots after it hold (an older
    record's), and another for another walk."""
    walk = struct.pack("<3Q", 2 | WalkStop.OUTERMOST << 32, 0x401234, 0x401567)
    first = b"\x11" * 16 + walk + struct.pack("<2Q", 0xDEAD, 0xBEEF)
    second = b"\x22" * 16 + walk + bytes(16)
    got = read_walk_at(first, 16)
    assert got == read_walk(walk) == WalkResult((0x401234, 0x401567), WalkStop.OUTERMOST)
    assert read_walk_at(second, 16) is got
    other = b"\x11" * 16 + struct.pack("<2Q", 1 | WalkStop.MAX_FRAMES << 32, 0x401234)
    assert read_walk_at(other, 16) == WalkResult((0x401234,), WalkStop.MAX_FRAMES)


def test_the_code_uses_the_fault_convention_and_no_call() -> None:
    code = build_walk_function(0x10000, 0x7F00_0000_0000, 16)
    insns = list(Decoder(64, code, ip=0x10000))
    assert not any(i.mnemonic in (Mnemonic.CALL, Mnemonic.SYSCALL, Mnemonic.INT3) for i in insns)
    magic = [i for i in insns if i.mnemonic == Mnemonic.MOV and i.immediate64 == FETCH_FAULT_MAGIC]
    assert len(magic) == 1
    assert insns[-1].mnemonic == Mnemonic.RET
    with pytest.raises(InternalError):
        build_walk_function(0x10000, 0, 0)


@pytest.mark.parametrize("indirect", [False, True], ids=["direct", "indirect"])
def test_the_walk_writes_only_its_clobbers(indirect: bool) -> None:
    """The record action keeps its record in rbx and its ticket in rsi across the walk."""
    block = sw.Block()
    sw.emit_stack_walk(block, 0x7F00_0000_0000, 127, indirect=indirect)
    code = block.encode(0x10000)
    allowed = {getattr(Register, r.upper()) for r in sw.CLOBBERS}
    written = set()
    info = InstructionInfoFactory()
    for insn in Decoder(64, code, ip=0x10000):
        for used in info.info(insn).used_registers():
            if used.access in (OpAccess.WRITE, OpAccess.READ_WRITE, OpAccess.COND_WRITE):
                written.add(RegisterExt.full_register(used.register))
    assert written <= allowed, written - allowed
    assert {Register.RBX, Register.RSI, Register.RSP}.isdisjoint(written)


# ---- the code, run -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Directory:
    """The packed tables of every file a process maps executable, and where its modules are."""

    blob: bytes
    bases: dict[str, int]  # by file name: the load bias
    ranges: dict[str, tuple[int, int]]  # by file name: lowest and highest address
    code: list[tuple[int, int, str, int]]  # executable mappings: start, end, file, bias

    def module_at(self, addr: int) -> tuple[str, int] | None:
        """tablewalk's ``module_at`` over these mappings."""
        for start, end, path, bias in self.code:
            if start <= addr < end:
                return path, bias
        return None


def directory_of(pid: int) -> Directory:
    mapped, bases, ranges, code = [], {}, {}, []
    for module in iter_modules(pid):
        path = f"/proc/{pid}/root{module.path}"
        table = table_of(path)
        bases[module.name] = module.bias
        ranges[module.name] = (module.start, module.end)
        for m in module.mappings:
            if "x" in m.perms:
                mapped.append(
                    MappedTable(m.start, m.end, module.bias, table.to_bytes(), len(table))
                )
                # The file's own path: /proc/PID/root goes with the process, and the Python
                # walk runs after the harness has ended.
                code.append((m.start, m.end, module.path, module.bias))
    return Directory(pack_directory(mapped), bases, ranges, code)


@dataclass(frozen=True, slots=True)
class Memory:
    """Registers a walk started from, and the thread's stack from its sp up."""

    regs: dict[str, int]
    stack: bytes

    def read_word(self, addr: int) -> int:
        offset = addr - self.regs["rsp"]
        if not 0 <= offset <= len(self.stack) - 8:
            raise TargetError(f"{addr:#x} is not in the stack dumped")
        return int.from_bytes(self.stack[offset : offset + 8], "little")


@dataclass(frozen=True, slots=True)
class Taken:
    walk: WalkResult
    backtrace: tuple[int, ...]
    python: list[Frame] = field(default_factory=list)  # tablewalk's, from the same memory


def run_harness(
    exe: Path, *extra: str, lines: list[str] | None = None
) -> tuple[dict[str, list[Taken]], int, dict[str, int]]:
    """Each stack the harness took, by name; the faults it absorbed; where its modules are.
    ``lines``, if given, receives the harness's output lines instead (its bench mode)."""
    proc = subprocess.Popen(
        ["taskset", "-c", "0", str(exe), f"{FETCH_FAULT_MAGIC:x}", *extra]
        if extra
        else [str(exe), f"{FETCH_FAULT_MAGIC:x}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        words = proc.stdout.readline().split()
        assert words[0::2] == ["code", "dir"], words
        code_at, dir_at = (int(w, 16) for w in words[1::2])
        # Step 1: the tables of every file mapped executable, and the directory.
        found = directory_of(proc.pid)
        # Step 2: the code (the full walk, then the short one), then the directory.
        full = build_walk_function(code_at, dir_at, 127)
        short_at = (len(full) + 15) & ~15
        short = build_walk_function(code_at + short_at, dir_at, SHORT)
        code = full + b"\xcc" * (short_at - len(full)) + short
        proc.stdin.write(f"{code.hex()} {short_at:x}\n{found.blob.hex()}\n")
        proc.stdin.close()
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    taken: dict[str, list[Taken]] = {}
    faults = -1
    if lines is not None:
        lines += out.splitlines()
        return taken, faults, found.bases
    memory: dict[str, list[Memory]] = {}
    for line in out.splitlines():
        name, *rest = line.split()
        if name == "mem":
            pc, sp, bp = (int(w, 16) for w in rest[1:4])
            regs = {"rip": pc, "rsp": sp, "rbp": bp}
            memory.setdefault(rest[0], []).append(Memory(regs, bytes.fromhex(rest[4])))
            continue
        if name == "faults":
            faults = int(rest[0])
            continue
        assert rest[0] == "walk"
        split = rest.index("bt")
        status = int(rest[1], 16)
        returns = tuple(int(w, 16) for w in rest[2:split])
        walk = read_walk(struct.pack(f"<{1 + len(returns)}Q", status, *returns))
        bt = tuple(int(w, 16) for w in rest[split + 1 :])
        taken.setdefault(name, []).append(Taken(walk, bt))
    # The Python walk over the same rows and the same memory, for each stack of leaf.
    for name, dumps in memory.items():
        limit = SHORT if name == "deep" else 127
        for t, m in zip(taken[name], dumps, strict=True):
            frames = tablewalk.walk(m.regs, m.read_word, found.module_at, max_frames=limit + 1)
            t.python.extend(frames)
    return taken, faults, found.bases


@pytest.fixture(scope="module")
def harness(
    build: Callable[[str], Path],
) -> tuple[Path, dict[str, list[Taken]], int, dict[str, int]]:
    exe = build("walk_harness")
    return (exe, *run_harness(exe))


def inside(path: Path, function: str, addr: int, bias: int) -> bool:
    sym = symbol(path, function)
    return sym.value < addr - bias <= sym.value + sym.size


@pytest.mark.parametrize("name", ["a", "b", "lib", "qsort", "thread"])
def test_walks_give_the_return_addresses_libgcc_finds(harness, name: str) -> None:
    exe, taken, _faults, bases = harness
    assert len(taken[name]) == 1
    t = taken[name][0]
    assert t.walk.stop is WalkStop.OUTERMOST, t
    assert t.walk.returns == t.backtrace[1:], t
    assert_same_as_python(t)
    bias = bases[exe.name]
    first = t.walk.returns[0]
    if name == "b":  # alloca keeps b's CFA on rbp where it calls leaf
        row = table_of(str(exe)).row_at(first - 1 - bias)
        assert row.kind is Kind.CFA and row.base == 6, row
    if name in ("a", "b"):
        assert inside(exe, name, first, bias)
        assert inside(exe, "main", t.walk.returns[1], bias)
    elif name == "lib":
        lib = exe.parent / "libstk.so"
        assert inside(lib, "stk_through", first, bases["libstk.so"])
    elif name == "qsort":
        assert inside(exe, "cmp", first, bias)
        assert bases["libc.so.6"] < t.walk.returns[1]
    else:
        assert inside(exe, "a", first, bias) and inside(exe, "thread_main", t.walk.returns[1], bias)
    if name != "thread":
        assert inside(exe, "_start", t.walk.returns[-1], bias)


def test_the_depth_limit(harness) -> None:
    _exe, taken, _faults, _bases = harness
    t = taken["deep"][0]
    assert t.walk.stop is WalkStop.MAX_FRAMES
    assert t.walk.returns == t.backtrace[1 : 1 + SHORT]
    assert_same_as_python(t)


def assert_same_as_python(t: Taken) -> None:
    """The machine code's walk is symbols/tablewalk.py's over the same rows and memory."""
    assert t.python, "no dump of this stack"
    assert tuple(f.addr for f in t.python[1:]) == t.walk.returns
    last = t.python[-1].stop
    assert last is not None and last.name == t.walk.stop.name, (last, t.walk.stop)


def test_stacks_that_cannot_be_walked_end_cleanly(harness) -> None:
    _exe, taken, faults, _bases = harness
    assert taken["unreadable"][0].walk == WalkResult((), WalkStop.UNREADABLE)
    assert taken["nowhere"][0].walk == WalkResult((), WalkStop.NO_UNWIND_INFO)
    assert taken["pastend"][0].walk == WalkResult((), WalkStop.NO_UNWIND_INFO)
    assert taken["fpchain"][0].walk == WalkResult((0x2000,), WalkStop.OUTERMOST)
    assert faults == 1  # the unreadable one's, absorbed


# ---- in a record, in a detour ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("with_regs", "indirect"),
    [(False, False), (True, False), (False, True)],
    ids=["lean", "with-regs", "indirect"],
)
def test_a_record_carries_the_stack_of_each_hit(
    with_regs: bool, indirect: bool, tmp_path: Path
) -> None:
    """tests/programs/detour_harness.c's threads call ``work`` from ``run``: each record of
    the probe at its entry holds the same return addresses, from ``run`` through libc's
    ``start_thread`` to ``clone3``, the outermost frame. The directory lives in the area's
    counters (the harness maps the area whole), written before the detour goes in; the
    registers of the record are still the call's."""
    h = build_harness(tmp_path)
    threads, calls, depth = 3, 2000, 32
    layout = sa.AreaLayout(ncounters=16384, capacity=1 << 16)  # 1 MiB of counters
    area = create_area(layout)
    try:
        run = launch(h, "work", area, threads, calls)
        directory = run.area + layout.counter_offset(0)
        found = directory_of(run.proc.pid)
        blob = found.blob
        assert len(blob) <= 16384 * sa.COUNTER_STRIDE - sa.PAGE
        if indirect:  # the directory one page further, its address in the first word
            area.mm[2 * sa.PAGE : 2 * sa.PAGE + len(blob)] = blob
            area.mm[sa.PAGE : sa.PAGE + 8] = struct.pack("<Q", directory + sa.PAGE)
        else:
            area.mm[sa.PAGE : sa.PAGE + len(blob)] = blob
        action = RecordAction(
            7,
            layout.ring_at(run.area),
            THREAD_IDS[-1],
            with_regs=with_regs,
            cpu_id=BEST_CPU_ID,
            stack=StackWalk(directory, depth, indirect),
        )
        install(run, action)
        records, dropped = drain(run, area)
        done = finish(run)
    finally:
        os.close(area.fd)
    assert dropped == 0 and len(records) == threads * calls
    assert done.fixups == 0
    walks = {read_walk(r.data[action.stack_offset - action.data_offset :]) for r in records}
    assert len(walks) == 1, walks  # every call from the same place
    (walk,) = walks
    assert walk.stop is WalkStop.OUTERMOST, walk
    assert inside(h.exe, "run", walk.returns[0], found.bases[h.exe.name])
    assert 2 <= len(walk.returns) <= 4, walk  # start_thread, clone3 (and maybe one between)
    low, high = found.ranges["libc.so.6"]
    assert all(low <= ra < high for ra in walk.returns[1:]), walk
    if with_regs:
        assert all(r.reg("rip") == run.probe and r.reg("rsp") % 16 == 8 for r in records)
        assert {r.reg("rdx") for r in records} == {3 * i for i in range(calls)}
