"""Optimized return probes (process/fast/returns.py, arch/x86_64/retstack.py): entry and return
without a trap, timed and counted in the program.

The programs are the trap tier's (tests/programs/rets.c, rets_cxx.cpp): each prints what its
calls computed, so an unchanged output says every return reached its real caller, and the
counts are exactly what its calls imply. Each test also checks the probe really ran on the
fast tier (``[OPTIMIZED]`` in the listing, no trap taken at its entry).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

from kprobes import Kretprobe

pytestmark = pytest.mark.ptrace


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def start(
    spawn: Callable[..., Any], tmp_path: Path, argv: list[Any], **kw: Any
) -> tuple[Any, Path]:
    out = tmp_path / f"stdout.{len(list(tmp_path.iterdir()))}"
    with open(out, "wb") as f:
        proc = spawn(argv, stdout=f, **kw)
    return proc, out


def run_to_exit(proc: Any, timeout: float = 120) -> None:
    assert proc.run(timeout=timeout), f"program {proc.pid} did not exit within {timeout} s"
    assert proc.exit_code == 0


def optimized(proc: Any, rp: Kretprobe) -> bool:
    (entry,) = [e for e in proc.list() if e.addr == rp.addr]
    assert entry.kind == "r"
    assert entry.is_optimized, entry.why_not_optimized
    return "[OPTIMIZED]" in str(entry)


def test_deep_recursion_counts_every_return_in_the_program(spawn, rets, tmp_path):
    depth = 10_000  # the kernel's uretprobes drop returns nested deeper than 64
    proc, out = start(spawn, tmp_path, [rets, "rec", depth])
    rp = Kretprobe(symbol="rec", optimize=True)
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    run_to_exit(proc)
    assert out.read_bytes() == f"rec={depth * (depth + 1) // 2}\n".encode()
    assert rp.nhit == depth + 1 and rp.nmissed == 0 and rp.nabandoned == 0
    assert rp.kp.nhit == depth + 1  # every entry, by the detour: no trap
    assert sum(rp.duration_slots) == depth + 1
