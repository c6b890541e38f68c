"""A probe point names code in a file, on every backend (issue 17, item 6).

``count -c CMD work``: a bare symbol is the command's own executable (its first image, as the
kernel runs it), as the kernel's uprobes hang on an inode. A program of the tree that execs
another file with a function of the same name is not counted by it, on our ptrace backend as
on the kernel's uprobes; an exec of the same file is. Where two files are counted under one
name, the rows name their files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_backends import needs_uprobes, tracefs_state  # noqa: F401 - a fixture
from test_cli_trace import cli, count_rows

pytestmark = pytest.mark.ptrace

BACKENDS = [
    pytest.param(("--no-optimize",), id="ptrace-traps"),
    pytest.param((), id="ptrace-optimized"),
    pytest.param(("--backend", "uprobes"), id="uprobes", marks=needs_uprobes),
]


@pytest.fixture
def passon(build) -> Path:
    return build("passon")


@pytest.fixture
def target(build) -> Path:
    return build("target")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bare_symbol_is_the_commands_own_file(backend, passon, target, tracefs_state):  # noqa: F811
    """passon's work() runs 10 times, then it execs target, whose work() runs 4 times."""
    done = cli("count", *backend, "-c", f"{passon} 10 {target} 4", "work")
    assert done.returncode == 0, done.stderr
    assert "passon 45" in done.stdout and "sum=" in done.stdout  # both programs ran
    assert count_rows(done.stdout) == {"work": 10}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exec_of_the_same_file_is_counted(backend, passon, tracefs_state):  # noqa: F811
    """passon runs work() 10 times, execs itself to run it 5 times more, then /bin/true."""
    done = cli("count", *backend, "-c", f"{passon} 10 {passon} 5 /bin/true", "work")
    assert done.returncode == 0, done.stderr
    assert "passon 45" in done.stdout and "passon 10" in done.stdout
    assert count_rows(done.stdout) == {"work": 15}


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_files_of_one_name_are_two_rows_named_by_file(
    backend,
    passon,
    target,
    tracefs_state,  # noqa: F811
):
    """The other program's work() counted by its path: the bare row says which file it is."""
    done = cli("count", *backend, "-c", f"{passon} 10 {target} 4", "work", f"{target}:work")
    assert done.returncode == 0, done.stderr
    assert count_rows(done.stdout) == {"passon:work": 10, f"{target}:work": 4}
