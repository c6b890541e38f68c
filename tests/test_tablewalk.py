"""Stacks walked over the compact frame tables (kprobes/symbols/tablewalk.py) against the trap
tier's unwinder (symbols/unwind.py), on the same hits.

The compact walk is the reference of the walker the fast tier is to run in the program
(issue 23, item 5): for the code compilers write it must give the trap tier's stacks, frame
for frame, and where its rows cannot go on it must end with a marker, never with a wrong
frame. Live: at every hit of a Kprobe both walks are taken from the same registers, on
programs built at -O2 without frame pointers and with them (tests/programs/stacks.c, whose
known paths run through libstk.so; frames.c, with alloca's rbp-based frames, a recursion
and a noreturn call), through frames hooked by return probes, and in zstd (libc's malloc,
up to zstd's main). Fakes: how each kind of row ends or continues a walk.
"""

from __future__ import annotations

import os
import shutil
from array import array
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

from kprobes import Kprobe, Kretprobe
from kprobes.errors import TargetError
from kprobes.model import UserStack
from kprobes.symbols.frametable import RBP, ROW, RSP, FrameTable, Kind, table_of
from kprobes.symbols.tablewalk import walk
from kprobes.symbols.unwind import FoundBy, StopReason

Build = Callable[[str], Path]
Pair = tuple[UserStack, UserStack]  # (the trap tier's unwinder, the compact walk)


def probed(spawn: Callable[..., Any], argv: list[Any], probes: list[Any]) -> list[Pair]:
    """Run ``argv`` with these Kprobes, each taking both stacks at every hit."""
    with open(os.devnull, "wb") as devnull:
        proc = spawn(argv, stdout=devnull)
    pairs: list[Pair] = []

    def both(_kp: Kprobe, regs: Any) -> None:
        pairs.append((proc.stacks.user_stack(regs), proc.stacks.user_stack(regs, compact=True)))

    for p in probes:
        if isinstance(p, Kprobe):
            p.pre_handler = both
            proc.register_kprobe(p)
        else:
            proc.register_kretprobe(p)
    assert proc.run(timeout=120) and proc.exit_code == 0
    return pairs


def names(stack: UserStack) -> list[str]:
    return [f.func or hex(f.addr) for f in stack.frames]


@pytest.mark.ptrace
@pytest.mark.parametrize("name", ["stacks", "stacks-fp"])
def test_known_paths_through_a_library(spawn: Any, build: Build, name: str) -> None:
    pairs = probed(spawn, [build(name)], [Kprobe(symbol="leaf")])
    assert len(pairs) == 10
    for trap, compact in pairs:
        assert compact == trap
        assert compact.stop == "", names(compact)  # complete: up to _start
    paths = Counter(tuple(names(c)[:3]) for _, c in pairs)
    assert paths == {
        ("leaf", "a", "main"): 3,
        ("leaf", "b", "main"): 5,
        ("leaf", "stk_through", "main"): 2,
    }
    through = next(c for _, c in pairs if names(c)[1] == "stk_through")
    assert through.frames[1].module == "libstk.so"


def rbp_based_offsets(path: Path, function: str) -> list[int]:
    """Offsets in ``function`` where a row starts whose CFA is on rbp (instruction
    boundaries: a row starts after an instruction)."""
    sym = support.symbol(path, function)
    table = table_of(str(path))
    out = []
    for i in range(len(table)):
        row = table.row(i)
        if sym.value <= row.start < sym.value + sym.size and row.base == RBP:
            out.append(row.start - sym.value)
    return out


@pytest.mark.ptrace
@pytest.mark.parametrize("name", ["frames", "frames-fp"])
def test_rbp_frames_recursion_and_noreturn(spawn: Any, build: Build, name: str) -> None:
    program = build(name)
    inside = rbp_based_offsets(program, "grow")
    assert inside, "alloca keeps grow's CFA on rbp"
    probes = [
        Kprobe(symbol="deep"),
        Kprobe(symbol="bail"),
        Kprobe(symbol="grow", offset=inside[0]),
    ]
    pairs = probed(spawn, [program], probes)
    assert len(pairs) == 3 * (5 + 1 + 1)  # deep recurses 4 times below each call
    for trap, compact in pairs:
        assert compact == trap
        assert compact.stop == "", names(compact)
    depths = Counter(names(c).count("deep") for _, c in pairs if names(c)[0] == "deep")
    assert depths == {1: 3, 2: 3, 3: 3, 4: 3, 5: 3}
    assert all(names(c)[:2] == ["grow", "main"] for _, c in pairs if names(c)[0] == "grow")


@pytest.mark.ptrace
def test_frames_hooked_by_return_probes(spawn: Any, build: Build) -> None:
    """The trampoline's address in a hooked frame's slot becomes the real return address."""
    program = build("frames")
    probes: list[Any] = [Kretprobe(symbol="deep", maxactive=16), Kprobe(symbol="deep")]
    pairs = probed(spawn, [program], probes)
    assert len(pairs) == 15
    for trap, compact in pairs:
        assert compact == trap
        assert compact.stop == "", names(compact)
    deepest = max((c for _, c in pairs), key=lambda c: len(c.frames))
    assert names(deepest)[:6] == ["deep"] * 5 + ["main"]


@pytest.mark.ptrace
def test_a_real_program_reaches_its_main(spawn: Any, tmp_path: Path) -> None:
    zstd = shutil.which("zstd")
    assert zstd is not None, "scripts/ensure-system-deps installs zstd"
    data = tmp_path / "data"
    data.write_bytes(b"".join(b"%d kprobes stacks\n" % i for i in range(20000)))
    argv = [zstd, "-q", "-f", "-o", tmp_path / "data.zst", data]
    pairs = probed(spawn, argv, [Kprobe(symbol="libc:malloc")])
    assert len(pairs) >= 10
    for trap, compact in pairs:
        assert compact == trap
        assert compact.stop == "", names(compact)
    main_thread = [c for _, c in pairs if "__libc_start_main" in names(c)]
    assert len(main_thread) >= len(pairs) // 2


# -- fakes -----------------------------------------------------------------------------------


def fake_table(rows: list[tuple[int, Kind, int, int, int]]) -> FrameTable:
    """(start, kind, base, cfa_offset, rbp_offset) rows."""
    starts = array("I", [r[0] for r in rows])
    packed = b"".join(ROW.pack(off, rbp, base, kind) for _, kind, base, off, rbp in rows)
    return FrameTable(starts, packed)


# One file at 0x10000 (bias 0x10000, link-time 0): f [0x100, 0x140) with a push rbp at
# 0x101 and an rbp frame from 0x104; g [0x200, 0x220) in an rsp frame of 32 bytes; the
# PLT-like [0x300, 0x310) a marker; _start [0x400, 0x410) outermost.
TABLE = fake_table(
    [
        (0x100, Kind.CFA, RSP, 8, 0),
        (0x101, Kind.CFA, RSP, 16, -16),
        (0x104, Kind.CFA, RBP, 16, -16),
        (0x140, Kind.UNCOVERED, 0, 0, 0),
        (0x200, Kind.CFA, RSP, 32, 0),
        (0x220, Kind.UNCOVERED, 0, 0, 0),
        (0x300, Kind.UNSUPPORTED, 0, 0, 0),
        (0x310, Kind.UNCOVERED, 0, 0, 0),
        (0x400, Kind.OUTERMOST, 0, 0, 0),
        (0x410, Kind.UNCOVERED, 0, 0, 0),
    ]
)
BIAS = 0x10000


def module_at(addr: int) -> tuple[str, int] | None:
    return ("file", BIAS) if BIAS <= addr < BIAS + 0x1000 else None


def memory(words: dict[int, int]) -> Callable[[int], int]:
    def read(addr: int) -> int:
        if addr not in words:
            raise TargetError(f"{addr:#x}")
        return words[addr]

    return read


def fake_walk(regs: dict[str, int], words: dict[int, int], **kw: Any) -> list[Any]:
    return walk(regs, memory(words), module_at, tables=lambda _path: TABLE, **kw)


def test_a_walk_through_rsp_and_rbp_rows_to_the_outermost_frame() -> None:
    # g (rsp frame, CFA 0x7020) called from f+0x10 (rbp frame: rbp 0x7030, CFA 0x7040,
    # saved rbp at 0x7030), called from _start+0x5.
    words = {0x7018: BIAS + 0x110, 0x7038: BIAS + 0x405, 0x7030: 0x1234}
    frames = fake_walk({"rip": BIAS + 0x208, "rsp": 0x7000, "rbp": 0x7030}, words)
    assert [(f.addr, f.cfa, f.how, f.stop) for f in frames] == [
        (BIAS + 0x208, 0x7020, FoundBy.FIRST, None),
        (BIAS + 0x110, 0x7040, FoundBy.CFI, None),
        (BIAS + 0x405, None, FoundBy.CFI, StopReason.OUTERMOST),
    ]


def test_a_marker_row_ends_the_walk() -> None:
    frames = fake_walk({"rip": BIAS + 0x208, "rsp": 0x7000, "rbp": 0}, {0x7018: BIAS + 0x305})
    assert frames[-1].addr == BIAS + 0x305 and frames[-1].stop is StopReason.UNSUPPORTED


def test_an_uncovered_address_takes_the_frame_pointer() -> None:
    # 0x180 is in no FDE: rbp 0x7010 frames it (CFA 0x7020); g's rsp row then finds its
    # CFA at 0x7040 and a zero return address there: the outermost frame.
    words = {0x7010: 0, 0x7018: BIAS + 0x205, 0x7038: 0}
    frames = fake_walk({"rip": BIAS + 0x180, "rsp": 0x7000, "rbp": 0x7010}, words)
    assert [(f.addr, f.how) for f in frames][:2] == [(BIAS + 0x180, FoundBy.FIRST),
                                                     (BIAS + 0x205, FoundBy.FP)]  # fmt: skip
    assert frames[1].cfa == 0x7040 and frames[1].stop is StopReason.OUTERMOST
    no_fp = fake_walk({"rip": BIAS + 0x180, "rsp": 0x7000, "rbp": 3}, words)
    assert no_fp[-1].stop is StopReason.NO_UNWIND_INFO
    nowhere = fake_walk({"rip": 0x99, "rsp": 0x7000, "rbp": 3}, words)
    assert nowhere[-1].stop is StopReason.NO_MODULE


def test_a_lost_rbp_stops_a_walk_that_needs_it() -> None:
    # f's rbp frame at 0x110, called from g (its rsp row) whose rbp slot is unreadable: f's
    # caller needs no rbp; a second f above would.
    words = {0x7018: BIAS + 0x110}
    frames = fake_walk({"rip": BIAS + 0x208, "rsp": 0x7000, "rbp": None}, words)
    assert frames[-1].addr == BIAS + 0x110
    assert frames[-1].stop is StopReason.UNKNOWN_REGISTER


def test_unreadable_stack_depth_limit_and_a_corrupt_frame() -> None:
    regs = {"rip": BIAS + 0x208, "rsp": 0x7000, "rbp": 0}
    assert fake_walk(regs, {})[-1].stop is StopReason.UNREADABLE
    loop = {0x7018: BIAS + 0x208}  # g returning into g: the next CFA is 0x7040, and so on
    loop.update({0x7018 + 0x20 * i: BIAS + 0x208 for i in range(10)})
    frames = fake_walk(regs, loop, max_frames=4)
    assert len(frames) == 4 and frames[-1].stop is StopReason.MAX_FRAMES
    assert fake_walk(regs, loop, max_frames=0) == []
    down = fake_walk({"rip": BIAS + 0x110, "rsp": 0x7000, "rbp": 0x6000}, {})
    assert down[0].stop is StopReason.NOT_OUTWARD
