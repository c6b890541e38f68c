"""Cost per call of the count and record detours, by hand (not a test):

    cd tests/arch && ../../.venv/bin/python bench_detour.py [CALLS]

Runs tests/programs/detour_harness.c pinned (``taskset -c 0``) in its bench mode: CALLS calls
of a probed function, best of 5 rounds without and with the patch; prints ns per call and the
difference. The ring is large enough for a round (the harness empties it between rounds),
except in the "ring full" line, which measures the drop path.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from elf_bytes import functions
from test_detour_live import SOURCE, create_area

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.detour import (
    Action,
    CountAction,
    FlagsSave,
    RecordAction,
    ThreadId,
    build_detour,
)
from kprobes.arch.x86_64.jumpopt import Region, find_region

MakeAction = Callable[[int, sa.AreaLayout], Action]
BIG, FULL = 1 << 21, 16  # ring capacities: room for a round of calls, or always full


def count(locked: bool) -> MakeAction:
    return lambda base, layout: CountAction(base + layout.counter_offset(0), locked=locked)


def record(thread_id: ThreadId) -> MakeAction:
    return lambda base, layout: RecordAction(1, layout.ring_at(base), thread_id)


Case = tuple[str, MakeAction, int, FlagsSave]
LAHF, PUSHF = FlagsSave.LAHF, FlagsSave.PUSHF
CASES: list[Case] = [
    ("count, locked", count(True), BIG, LAHF),
    ("count, unlocked", count(False), BIG, LAHF),
    ("count, locked, pushfq/popfq", count(True), BIG, PUSHF),
    ("record, rdfsbase", record(ThreadId.FSBASE), BIG, LAHF),
    ("record, fs:0", record(ThreadId.FS0), BIG, LAHF),
    ("record, pushfq/popfq", record(ThreadId.FSBASE), BIG, PUSHF),
    ("record, ring full (drop)", record(ThreadId.FSBASE), FULL, LAHF),
]


def measure(exe: Path, area: Path, func: str, calls: int, case: Case) -> str:
    name, make, capacity, flags = case
    layout = sa.AreaLayout(ncounters=1, capacity=capacity)
    create_area(area, layout)
    cmd = ["taskset", "-c", "0", str(exe), func, str(area), "1", str(calls), "bench"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    words = proc.stdout.readline().split()
    fn, page, base = (int(w, 16) for w in words[1::2])
    f = functions(exe)[func]
    region = find_region(f.code, fn, fn, f.size)
    assert isinstance(region, Region), region
    detour = build_detour(page, region, make(base, layout), flags=flags)
    proc.stdin.write(f"{detour.code.hex()}\n0 {detour.patch.hex()}\n")
    proc.stdin.close()
    out = proc.stdout.read().split()
    assert proc.wait() == 0
    plain, patched = float(out[1]), float(out[3])
    return f"{func:8} {name:30} {plain:6.2f} {patched:6.2f} {patched - plain:+6.2f} ns"


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_000
    with tempfile.TemporaryDirectory() as tmp:
        exe, area = Path(tmp) / "detour_harness", Path(tmp) / "area"
        flags = ["-O1", "-g", "-Wall", "-pthread", "-fcf-protection=branch"]
        subprocess.run(["gcc", *flags, "-o", str(exe), str(SOURCE)], check=True)
        print(f"{'':8} {'detour':30} {'plain':>6} {'probed':>6} {'cost':>6}")
        for func in ("work", "work_fp"):
            for case in CASES:
                print(measure(exe, area, func, calls, case), flush=True)


if __name__ == "__main__":
    main()
