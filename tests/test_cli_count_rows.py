"""``kprobes count``'s rows (issue 22, item 7): one row per function however many names it
has, ``--top N``, and the same rows in the table and in ``--json``.

``tests/programs/aliases.c`` calls ``twin`` N times by each of its three names (one address)
and libc's ``strtol`` and ``strtoll`` (one function of libc's) N times each; bcc's funccount
counts such a function once, on one probe, and so do we. The names of one address are read
with ``nm`` here, the reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support
from support import cli
from test_cli_trace import count_rows

pytestmark = pytest.mark.ptrace

N = 4


@pytest.fixture
def aliases(build: Callable[[str], Path]) -> Path:
    return build("aliases")


def counted(*args: object) -> tuple[dict[str, int], str]:
    result = cli("count", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    return count_rows(result.stdout), result.stderr


def json_rows(*args: object) -> list[dict[str, Any]]:
    result = cli("count", "--json", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def names_at(path: Path, name: str, glob: Callable[[str], bool], dynamic: bool) -> set[str]:
    """The other names ``nm`` gives the address of ``name`` in ``path`` that ``glob`` takes."""
    table = support.nm_symbols(path, dynamic=dynamic)
    value = table[name].value
    return {n for n, s in table.items() if s.value == value and n != name and glob(n)}


# -- one row per function --------------------------------------------------------------------


@pytest.mark.parametrize("backend", support.CLI_BACKENDS)
def test_the_names_of_one_function_are_one_row(aliases: Path, backend: str) -> None:
    command = f"{aliases} {N}"
    rows, _ = counted("--backend", backend, "-c", command, "*twin*", "lone")
    assert rows == {"twin": 3 * N, "lone": 1}  # not twin, twin_too and _twin with 12 each
    lines = json_rows("--backend", backend, "-c", command, "*twin*", "lone")
    assert lines == [
        {"probe": "lone", "hits": 1},
        {"probe": "twin", "hits": 3 * N, "aliases": ["twin_too", "_twin"]},
    ]


def test_a_glob_places_one_probe_per_address(aliases: Path) -> None:
    r = cli("count", "-c", f"{aliases} {N}", "*twin*")
    assert r.returncode == 0, r.stderr
    # One probe, one hit a call: the summary counts the hits of every probe placed.
    assert f"{3 * N} events, {3 * N} hits, 0 missed" in r.stderr


def test_verbose_says_the_other_names_of_a_row(aliases: Path) -> None:
    _, stderr = counted("-v", "-c", f"{aliases} {N}", "*twin*")
    assert "kprobes: twin is also twin_too, _twin (one address)\n" in stderr


@pytest.mark.parametrize("backend", support.CLI_BACKENDS)
def test_a_libc_glob_counts_a_function_of_several_names_once(aliases: Path, backend: str) -> None:
    """``libc:strtol*`` waits for libc (-c) and is matched there: strtol, strtoll, strtoq
    and strtoimax are one function, one row, counting the calls of every name; a second
    glob that matches one of its names adds no row."""
    libc = support.libc_path(aliases)
    others = names_at(libc, "strtol", lambda n: n.startswith("strtol"), dynamic=True)
    assert "strtoll" in others  # glibc's alias on x86-64, where long is long long
    command = f"{aliases} {N}"
    rows, _ = counted("--backend", backend, "-c", command, "libc:strtol*", "libc:strtoll*")
    assert rows == {"strtol": 2 * N}
    (line,) = json_rows("--backend", backend, "-c", command, "libc:strtol*")
    assert line["probe"] == "strtol" and line["hits"] == 2 * N
    assert set(line["aliases"]) == others


# -- --top N ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", support.CLI_BACKENDS)
def test_top_keeps_the_busiest_rows_in_the_tables_order(build: Any, backend: str) -> None:
    command = f"{build('target')} 5"
    specs = ("work", "compute", "kpt_*")  # work 5, kpt_asm 2, kpt_leaf 2, compute 1
    r = cli("count", "--backend", backend, "--top", "2", "-c", command, *specs)
    assert r.returncode == 0, r.stderr
    table = r.stdout[r.stdout.index("FUNC") :]
    assert table == f"{'FUNC':<36} {'COUNT':>8}\n{'kpt_leaf':<36} {2:>8}\n{'work':<36} {5:>8}\n"
    lines = json_rows("--backend", backend, "--top", "2", "-c", command, *specs)
    assert lines == [{"probe": "kpt_leaf", "hits": 2}, {"probe": "work", "hits": 5}]


def test_top_applies_to_each_interval(build: Any) -> None:
    command = f"{build('ticker')} 10 100000"  # a work() call every 0.1 s
    r = cli("count", "--top", "1", "-i", "0.2", "-c", command, "work", "main")
    assert r.returncode == 0, r.stderr
    tables = r.stdout.split("FUNC")[1:]
    assert len(tables) >= 2, r.stdout
    rows = [
        [line.split() for line in table.splitlines() if line.split()[:1] in (["work"], ["main"])]
        for table in tables
    ]
    assert all(len(each) <= 1 for each in rows), r.stdout  # main's row is never beside work's
    assert sum(int(hits) for each in rows for name, hits in each if name == "work") <= 10
    assert any(each for each in rows), r.stdout


def test_top_must_be_positive(build: Any) -> None:
    r = cli("count", "--top", "0", "-c", str(build("target")), "work")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        "kprobes count: error: argument --top: must be 1 or more, not 0"
    )


# -- the table and --json list the same rows --------------------------------------------------


@pytest.mark.parametrize("backend", support.CLI_BACKENDS)
def test_the_table_and_json_list_the_same_rows(aliases: Path, backend: str) -> None:
    command = f"{aliases} {N}"
    specs = ("*twin*", "lone", "idle")  # idle is never called
    rows, _ = counted("--backend", backend, "-c", command, *specs)
    lines = json_rows("--backend", backend, "-c", command, *specs)
    assert rows == {"lone": 1, "twin": 3 * N}
    assert {line["probe"]: line["hits"] for line in lines} == rows
    zeros, _ = counted("--backend", backend, "--zeros", "-c", command, *specs)
    lines = json_rows("--backend", backend, "--zeros", "-c", command, *specs)
    assert zeros == {**rows, "idle": 0}
    assert [(line["probe"], line["hits"]) for line in lines] == list(zeros.items())
