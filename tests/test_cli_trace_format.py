"""``kprobes trace`` with a probe's own line, bcc ``trace``'s way (issue 22, item 7):
``'p work i=%di:s64 "work(%d)", i'`` prints ``work(3)`` per hit instead of the kernel's
trace line. The names reach the probe's arguments, ``$retval``, bcc's ``arg1``..``arg6`` and
the common fields; a bad format is one line with its column, before the program runs.

``tests/programs/target.c``: ``target N`` calls work(0..N-1), which returns
``counter ^ (i << 1)`` with ``counter`` the running sum (0, 3, 7 for N = 3), then compute(7).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import support
from support import cli

pytestmark = pytest.mark.ptrace


@pytest.fixture
def target(build: Callable[[str], Path]) -> Path:
    return build("target")


def own_lines(stdout: str, prefix: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("backend", support.CLI_BACKENDS)
def test_a_probe_prints_its_own_line(target: Path, backend: str) -> None:
    r = cli(
        "trace",
        "--backend",
        backend,
        "-c",
        f"{target} 3",
        'p work i=%di:s64 "> %s work(%d) %#04x pid=%d tid=%d", comm, i, i, pid, tid',
        'r work "< %s returned %ld", func, $retval',
    )
    assert r.returncode == 0, r.stderr
    (ids,) = {line.split(" pid=")[1] for line in own_lines(r.stdout, "> ")}
    pid, tid = ids.split(" tid=")
    assert pid == tid and int(pid) > 0  # one thread: the tid is the pid
    shown = [line.split(" pid=")[0] for line in own_lines(r.stdout, "> ")]
    # C's %#04x: no 0x before a 0
    assert shown == ["> target work(0) 0000", "> target work(1) 0x01", "> target work(2) 0x02"]
    assert own_lines(r.stdout, "< ") == [
        "< work returned 0",
        "< work returned 3",
        "< work returned 7",
    ]


@pytest.mark.parametrize("backend", support.CLI_BACKENDS)
def test_bccs_arg_names_fetch_the_functions_arguments(target: Path, backend: str) -> None:
    r = cli("trace", "--backend", backend, "-c", f"{target} 1", 'p compute "compute(%d)", arg1')
    assert r.returncode == 0, r.stderr
    assert own_lines(r.stdout, "compute(") == ["compute(7)"]


def test_other_probes_keep_the_trace_line(target: Path) -> None:
    r = cli("trace", "-c", f"{target} 2", 'p work i=%di "i=%d", i', "p compute x=%di:u32")
    assert r.returncode == 0, r.stderr
    assert own_lines(r.stdout, "i=") == ["i=0", "i=1"]
    (line,) = [line for line in r.stdout.splitlines() if "p_compute_0: (compute+0x0" in line]
    assert line.endswith(" x=7")


@pytest.mark.parametrize(
    ("spec", "error", "caret"),
    [
        (
            'p work i=%di "i=%d", j',
            "kprobes: unknown name 'j' in the format (the probe's arguments: i; the common "
            "fields: tid, pid, comm, cpu, time, probe, func); arg1..arg6 are the function's "
            "arguments, $retval a return probe's value",
            21,
        ),
        (
            'p work i=%di "i=%k", i',
            "kprobes: unknown conversion in the format (valid: d i u o x X c s p f e E g G, "
            "with flags -+ #0, a width, .precision, hh h l ll z j t)",
            16,
        ),
        (
            'p work "r=%d", $retval',
            "kprobes: $retval is what a return probe sees: not on an entry probe",
            15,
        ),
        ('p work "i=%d %d", arg1', "kprobes: the format has 2 conversion(s) and 1 argument(s)", 13),
    ],
)
def test_a_bad_format_is_one_line_with_its_column_before_the_program_runs(
    target: Path, spec: str, error: str, caret: int
) -> None:
    r = cli("trace", "-c", f"{target} 2", spec)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [error, f"  {spec}", "  " + " " * caret + "^"]
    assert "sum=" not in r.stdout  # the program never ran


def test_a_probes_own_line_and_json_are_refused_together(target: Path) -> None:
    r = cli("trace", "--json", "-c", f"{target} 2", 'p work "x"')
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "kprobes: a probe's own line and --json are two outputs: give one",
        '  p work "x"',
        "         ^",
    ]
