"""``kprobes count`` of return specs (``count 'r rec'``): counted by the program's own
trampolines where the entry takes a jump (process/specs.py, fast/returns.py), as entry counts
are; the same counts as the trap tier's (``--no-optimize``) and the kernel's uretprobes.

The program is tests/programs/rets.c: its calls imply the counts exactly (``threads T N D``
makes T*N*(D+1) calls of ``rec``; ``longjmp N`` leaves every ``deep`` frame by longjmp, so
``deep`` never returns, then calls ``leaf`` once).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import support

pytestmark = pytest.mark.ptrace

SPECS = ("r rec", "rec", "r leaf", "r deep")
RUNS = {
    "threads": (("threads", 4, 3, 40), {"r rec": 492, "rec": 492, "r leaf": 0, "r deep": 0}),
    "longjmp": (("longjmp", 5), {"r rec": 0, "rec": 0, "r leaf": 1, "r deep": 0}),
}


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def rows(stdout: str) -> dict[str, int]:
    """The ``FUNC COUNT`` table, a row's name being its spec (``r rec``)."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("FUNC"))
    return {name: int(hits) for name, hits in (line.rsplit(None, 1) for line in lines[head + 1 :])}


def counted(*flags: str, argv: tuple[object, ...], rets: Path) -> dict[str, int]:
    command = " ".join(map(str, (rets, *argv)))
    r = support.cli("count", "--zeros", *flags, "-c", command, *SPECS, timeout=120)
    assert r.returncode == 0, r.stderr
    assert support.reference_output([rets, *map(str, argv)]).decode() in r.stdout
    return rows(r.stdout)


@pytest.mark.parametrize("run", RUNS, ids=list(RUNS))
def test_count_of_returns_takes_no_trap_and_matches_the_trap_tier(rets: Path, run: str) -> None:
    argv, expected = RUNS[run]
    command = " ".join(map(str, (rets, *argv)))
    fast = support.cli("count", "--zeros", "-v", "-c", command, *SPECS, timeout=120)
    assert fast.returncode == 0, fast.stderr
    # Every entry took its jump: no probe says it keeps a breakpoint, returns included.
    assert "uses a breakpoint" not in fast.stderr, fast.stderr
    assert rows(fast.stdout) == expected
    assert counted("--no-optimize", argv=argv, rets=rets) == expected


def test_count_of_a_return_whose_entry_keeps_its_trap_says_why(rets: Path) -> None:
    r = support.cli("count", "-c", f"{rets} tail 10", "r tail_a", "r tail_b")
    assert r.returncode == 0, r.stderr
    # tail_a is `add; jmp tail_b`: the jump's five bytes would take the jmp; tail_b's jumps.
    assert "r_tail_a_0 uses a breakpoint: a jump in the region" in r.stderr
    assert "r_tail_b_0" not in r.stderr
    assert rows(r.stdout) == {"r tail_a": 10, "r tail_b": 10}


@support.needs_uprobes
@pytest.mark.parametrize("run", RUNS, ids=list(RUNS))
def test_count_of_returns_matches_the_kernels_uretprobes(rets: Path, run: str) -> None:
    argv, expected = RUNS[run]
    assert counted("--backend", "uprobes", argv=argv, rets=rets) == expected
    assert counted(argv=argv, rets=rets) == expected
