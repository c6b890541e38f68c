"""Smoke tests of the benchmark harness (``python -m bench``), which the suite does not run whole.

The cheap peers run in ``--quick`` mode on a small N and must report exactly N hits in both
placements; the kernel's uprobes must also leave ``uprobe_events`` and the tracefs instances as
they found them. GDB, python-ptrace and our own tiers are left to ``make bench``: too slow here,
and ours measures an engine the rest of the suite tests for correctness.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.build import compile_c
from bench.elf import find_site

ROOT = Path(__file__).resolve().parent.parent
TRACEFS = Path("/sys/kernel/tracing")
CALLS = 300


def run_bench(only: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench", "--quick", "--only", only, "--calls", str(CALLS)]
    result = subprocess.run(
        [*argv, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(out.read_text())
    return document


def assert_every_hit_counted(document: dict[str, Any], keys: set[str]) -> None:
    rows = {row["key"]: row for row in document["rows"]}
    assert set(rows) == keys
    for key, row in rows.items():
        for placement, cell in row["cells"].items():
            where = f"{key} {placement}"
            assert cell["error"] is None, f"{where}: {cell['error']}"
            assert cell["hits"] == [CALLS], where
            assert cell["count_ok"], where
            assert cell["overhead_ns"] > 0, where


def test_sites_are_the_instructions_the_tiers_need() -> None:
    """The ELF arithmetic lands on the intended first bytes (push, lea, syscall at +5)."""
    target = compile_c("target")
    data = target.read_bytes()
    expected = {
        ("work_push", 0): b"\x55",
        ("work_lea", 0): b"\x48\x8d",
        ("work_sys", 5): b"\x0f\x05",
    }
    for (func, offset), prefix in expected.items():
        site = find_site(target, func, offset)
        assert data[site.file_offset :].startswith(prefix), func
    nm = subprocess.run(["nm", str(target)], capture_output=True, text=True, check=True).stdout
    symbols = {
        line.split()[2]: int(line.split()[0], 16)
        for line in nm.splitlines()
        if len(line.split()) == 3
    }
    assert find_site(target, "work_push").vaddr == symbols["work_push"]


@pytest.mark.ptrace
def test_floor_counts_every_hit(tmp_path: Path) -> None:
    assert_every_hit_counted(run_bench("floor", tmp_path), {"floor-one", "floor-two"})


@pytest.mark.tracefs
def test_uprobes_count_every_hit_and_clean_up(tmp_path: Path) -> None:
    # Only the benchmark's own events and instances are checked: other tools (or another test
    # run) may add and remove theirs at the same time.
    document = run_bench("uprobes", tmp_path)
    assert_every_hit_counted(document, {"uprobes-push", "uprobes-lea"})
    assert "kpbench" not in (TRACEFS / "uprobe_events").read_text()
    assert not [p.name for p in (TRACEFS / "instances").iterdir() if "kpbench" in p.name]
