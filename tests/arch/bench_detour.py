"""Cost per call of the count and record detours, by hand (not a test):

    cd tests/arch && PYTHONPATH=.. ../../.venv/bin/python bench_detour.py [CALLS]

Runs tests/programs/detour_harness.c pinned (``taskset -c 0``) in its bench mode: CALLS calls
of a probed function, best of 5 rounds without and with the patch; prints ns per call and the
difference. The ring is large enough for a round (the harness empties it between rounds;
records with the registers take 3 slots), except in the "ring full" line, which measures the
drop path; a line that dropped where it should not says so. The "stack" lines walk the user
stack in the record (stackwalk.py: from ``work`` through ``run`` and libc's ``start_thread``
to ``clone3``, 3 return addresses), the tables of the harness's files in the area's
counters; the "stack count" line counts the hit by its stack id in the area's table
(stackids.py: the walk hashed, the id's entry found, its count incremented; no record).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from elf_bytes import functions
from test_detour_live import SOURCE, create_area
from test_stackwalk import directory_of

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.capture import Bytes, CapturePlan, Const, Reg, Value
from kprobes.arch.x86_64.detour import Action, CountAction, FlagsSave, build_detour
from kprobes.arch.x86_64.jumpopt import Region, find_region
from kprobes.arch.x86_64.record import RecordAction, ThreadId
from kprobes.arch.x86_64.stackids import StackCountAction, StackTable, stride_for
from kprobes.arch.x86_64.stackwalk import StackWalk

# (the area's address, its layout, the harness's other addresses) -> the action
MakeAction = Callable[[int, sa.AreaLayout, dict[str, int]], Action]
BIG, FULL = 1 << 21, 128  # ring capacities in slots: room for a round of calls, or full


def count(locked: bool) -> MakeAction:
    return lambda base, layout, _: CountAction(base + layout.counter_offset(0), locked=locked)


def record(thread_id: ThreadId, *, with_regs: bool = True) -> MakeAction:
    return lambda base, layout, _: RecordAction(
        1, layout.ring_at(base), thread_id, with_regs=with_regs
    )


def record_fetching(base: int, layout: sa.AreaLayout, addrs: dict[str, int]) -> Action:
    """A lean record that fetches `%di` and `@bias:u64` (a register and a global's word)."""
    plan = CapturePlan([Value(Reg("rdi")), Bytes(Const(addrs["bias"]), 0, 8, 8)])
    return RecordAction(1, layout.ring_at(base), with_regs=False, plan=plan)


def record_stack(base: int, layout: sa.AreaLayout, addrs: dict[str, int]) -> Action:
    """A lean record with the user stack (its directory at ``addrs["directory"]``)."""
    walk = StackWalk(addrs["directory"], 16)
    return RecordAction(1, layout.ring_at(base), with_regs=False, stack=walk)


def record_stack_indirect(base: int, layout: sa.AreaLayout, addrs: dict[str, int]) -> Action:
    """The same, the directory found through a word (``addrs["cell"]``), as the tool's
    detours find it (process/fast/frametables.py)."""
    walk = StackWalk(addrs["cell"], 16, indirect=True)
    return RecordAction(1, layout.ring_at(base), with_regs=False, stack=walk)


def stack_count(base: int, layout: sa.AreaLayout, addrs: dict[str, int]) -> Action:
    """The hit counted by its stack id, the walk's directory found as the tool's detours
    find it (``addrs["cell"]``), the hits in counter 1."""
    table = StackTable(
        base + layout.stacks_offset,
        layout.stack_entries,
        layout.stack_stride,
        base + sa.OFF_STACKS_LOST,
    )
    walk = StackWalk(addrs["cell"], 16, indirect=True)
    return StackCountAction(1, table, walk, base + layout.counter_offset(1))


Case = tuple[str, MakeAction, int, FlagsSave]
LAHF, PUSHF = FlagsSave.LAHF, FlagsSave.PUSHF
CASES: list[Case] = [
    ("count, locked", count(True), BIG, LAHF),
    ("count, unlocked", count(False), BIG, LAHF),
    ("count, locked, pushfq/popfq", count(True), BIG, PUSHF),
    ("record, rdfsbase", record(ThreadId.FSBASE), BIG, LAHF),
    ("record, fs:0", record(ThreadId.FS0), BIG, LAHF),
    ("record, pushfq/popfq", record(ThreadId.FSBASE), BIG, PUSHF),
    ("record, no registers", record(ThreadId.FSBASE, with_regs=False), BIG, LAHF),
    ("record, no registers, %di @bias", record_fetching, BIG, LAHF),
    ("record, ring full (drop)", record(ThreadId.FSBASE), FULL, LAHF),
    ("record, stack (3 return addresses)", record_stack, BIG, LAHF),
    ("record, stack, indirect", record_stack_indirect, BIG, LAHF),
    ("stack count (3 return addresses)", stack_count, BIG, LAHF),
]
WALKS = (record_stack, record_stack_indirect, stack_count)
DIRECTORY_COUNTERS = 16384  # 1 MiB: the tables of the harness, libc and ld.so


def measure(exe: Path, func: str, calls: int, case: Case) -> str:
    name, make, capacity, flags = case
    stack = make in WALKS
    ids = (64, stride_for(16)) if make is stack_count else (0, 0)
    layout = sa.AreaLayout(DIRECTORY_COUNTERS if stack else 1, capacity, *ids)
    area = create_area(layout)
    cmd = ["taskset", "-c", "0", str(exe), func, area.path, "1", str(calls), "bench"]
    cmd.append(f"mirror={sa.MIRROR}")
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(area.fd,)
    )
    assert proc.stdin is not None and proc.stdout is not None
    words = proc.stdout.readline().split()
    addrs = {k: int(v, 16) for k, v in zip(words[0::2], words[1::2], strict=True)}
    fn, page, base = addrs["func"], addrs["page"], addrs["area"]
    if stack:  # the directory a page after the first counter, which points to it
        blob = directory_of(proc.pid).blob
        at = layout.counter_offset(0) + sa.PAGE
        area.mm[at : at + len(blob)] = blob
        addrs["directory"] = base + at
        addrs["cell"] = base + layout.counter_offset(0)
        area.mm[at - sa.PAGE : at - sa.PAGE + 8] = (base + at).to_bytes(8, "little")
    f = functions(exe)[func]
    region = find_region(f.code, fn, fn, f.size)
    assert isinstance(region, Region), region
    detour = build_detour(page, region, make(base, layout, addrs), flags=flags)
    proc.stdin.write(f"{detour.code.hex()}\n0 {detour.patch.hex()}\n")
    proc.stdin.close()
    out = proc.stdout.read().split()
    assert proc.wait() == 0
    plain, patched = float(out[1]), float(out[3])
    drops = area.view.cast("Q")[sa.OFF_DROPS // 8]
    os.close(area.fd)
    note = f"  ({drops} drops: the ring is too small)" if drops and capacity != FULL else ""
    return f"{func:8} {name:32} {plain:6.2f} {patched:6.2f} {patched - plain:+6.2f} ns{note}"


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "detour_harness"
        flags = ["-O1", "-g", "-Wall", "-pthread", "-fcf-protection=branch"]
        subprocess.run(["gcc", *flags, "-o", str(exe), str(SOURCE)], check=True)
        print(f"{'':8} {'detour':32} {'plain':>6} {'probed':>6} {'cost':>6}")
        for func in ("work", "work_fp"):
            for case in CASES:
                if case[1] in WALKS and func != "work":
                    continue  # work_fp, in asm, has no unwind table: its walks end at once
                print(measure(exe, func, calls, case), flush=True)


if __name__ == "__main__":
    assert mmap.PAGESIZE == sa.PAGE
    main()
