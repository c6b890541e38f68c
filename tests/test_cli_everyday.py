"""Everyday habits of the command line (issue 22, items 3 and 5), on real programs:

the peers' spellings       bpftrace's uprobe:/uretprobe: (u:/ur:), bcc's c:, p:c:, r:c:
                           count what our own line counts; bpftrace's other probe types
                           (mem:, kprobe:, tracepoint:, ...) are refused, saying what
                           they are, never taken for a library
the exit status with -c    the command's own (its code, 128 + a signal), as strace's, on
                           our backend and the kernel's uprobes; 0 when we ended it
--kernel without kprobes   refused before the command is started
a fast start               --help and --version import none of the machinery
no silent nothing          -p: a probe on a library not mapped is an error at once unless
                           --pending; -c: each probe never placed is named at the end
                           with why, and none placed at all is exit status 1
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import support
from test_cli_trace import count_rows

from kprobes.cli.spellings import read_spelling
from kprobes.errors import SpecError

pytestmark = pytest.mark.ptrace

cli = support.cli
TRACEFS = support.tracefs_root()
needs_uprobes = support.needs_uprobes
BACKENDS = support.CLI_BACKENDS


@pytest.fixture
def target(build: Callable[[str], Path]) -> Path:
    return build("target")


# -- the peers' spellings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "ours"),
    [
        ("uprobe:/bin/prog:work", "p /bin/prog:work"),
        ("u:/bin/prog:work", "p /bin/prog:work"),
        ("uretprobe:/bin/prog:work", "r /bin/prog:work"),
        ("ur:libc:malloc", "r libc:malloc"),
        ("uprobe:c:malloc", "p libc:malloc"),
        ("c:malloc", "libc:malloc"),
        ("c:malloc size=%di", "libc:malloc size=%di"),
        ("p:c:malloc", "p libc:malloc"),
        ("r:c:malloc", "r libc:malloc"),
        ("p:/bin/prog:work", "p /bin/prog:work"),
        # ours, left as they are: the kernel's grammar has a space after its event name
        ("p:alloc libc:malloc size=%di", "p:alloc libc:malloc size=%di"),
        ("r libc:malloc", "r libc:malloc"),
        ("libc:malloc", "libc:malloc"),
        ("work", "work"),
    ],
)
def test_a_peers_spelling_reads_as_our_line(given: str, ours: str) -> None:
    assert read_spelling(given) == ours


@pytest.mark.parametrize(
    ("given", "what"),
    [
        ("mem:counter/8:w", "'mem:' is bpftrace's watchpoint probe"),
        ("watchpoint:0x1000:8:w", "'watchpoint:' is bpftrace's watchpoint probe"),
        ("kprobe:do_sys_open", "'kprobe:' is bpftrace's kernel function probe"),
        ("kretprobe:vfs_read", "'kretprobe:' is bpftrace's kernel function probe"),
        ("tracepoint:syscalls:sys_enter_read", "'tracepoint:' is bpftrace's kernel tracepoint"),
        ("usdt:/bin/prog:probe", "'usdt:' is bpftrace's USDT marker probe"),
        ("profile:hz:99", "'profile:' is bpftrace's timer or event probe"),
        ("p::do_sys_open", "p::FUNC is bcc's kernel function"),
    ],
)
def test_a_probe_type_we_do_not_have_is_refused_saying_what_it_is(given: str, what: str) -> None:
    with pytest.raises(SpecError) as caught:
        read_spelling(given)
    assert caught.value.message.startswith(what), caught.value.message
    assert caught.value.column == 0


def test_mem_is_refused_before_the_command_runs(target: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r = cli("count", "-c", f"sh -c 'touch {marker}'", "mem:counter/8:w")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (
        "kprobes: 'mem:' is bpftrace's watchpoint probe, which kprobes does not have; "
        "kprobes probes code: a function, an offset or an address in a program"
    )
    assert not marker.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bpftrace_and_bcc_spellings_count_what_our_line_counts(target: Path, backend: str) -> None:
    """``target 5`` calls work() 5 times and libc's printf 4 times (as the kernel's uprobes
    count them); each spelling of a probe counts what our line for it counts."""
    counts = {}
    for spelling in (f"{target}:work", f"uprobe:{target}:work", f"u:{target}:work"):
        r = cli("count", "--backend", backend, "-c", f"{target} 5", spelling)
        assert r.returncode == 0, r.stderr
        (counts[spelling],) = count_rows(r.stdout).values()
    assert set(counts.values()) == {5}, counts
    printfs = {}
    for spelling in ("libc:printf", "c:printf", "p:c:printf", "uprobe:libc:printf"):
        r = cli("count", "--backend", backend, "-c", f"{target} 5", spelling)
        assert r.returncode == 0, r.stderr
        printfs[spelling] = sum(count_rows(r.stdout).values())
    assert set(printfs.values()) == {4}, printfs


@pytest.mark.parametrize("backend", BACKENDS)
def test_perfs_exec_names_the_file_of_bare_names(target: Path, backend: str) -> None:
    """``-x PATH`` (perf probe's): ``work`` and ``comp*`` are PATH's, in every process of the
    tree that runs it, not those of the shell the command starts first."""
    command = f"sh -c '{target} 3 >/dev/null; {target} 4 >/dev/null'"
    r = cli("count", "--backend", backend, "-x", target, "-c", command, "work", "comp*")
    assert r.returncode == 0, r.stderr
    assert count_rows(r.stdout) == {"work": 7, "compute": 2}
    traced = cli("trace", "--backend", backend, "-x", target, "-c", f"{target} 2", "r work")
    assert len(re.findall(r"<- work\b", traced.stdout)) == 2, traced.stdout


def test_perfs_exec_must_name_a_file(target: Path) -> None:
    r = cli("count", "-x", "/no/such/prog", "-c", f"{target} 2", "work")
    assert (r.returncode, r.stderr) == (1, "kprobes: -x /no/such/prog: no such file\n")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_return_spelling_makes_a_return_probe(target: Path, backend: str) -> None:
    for spelling in (f"uretprobe:{target}:work", f"ur:{target}:work", f"r:{target}:work"):
        r = cli("trace", "--backend", backend, "-c", f"{target} 3", spelling)
        assert r.returncode == 0, r.stderr
        returns = [line for line in r.stdout.splitlines() if re.search(r"<- work\b", line)]
        assert len(returns) == 3, (spelling, r.stdout)


# -- the exit status with -c ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("script", "status"), [("exit 7", 7), ("kill -SEGV $$", 139)])
def test_the_exit_status_is_the_commands(backend: str, script: str, status: int) -> None:
    r = cli("count", "--backend", backend, "-c", f"sh -c '{script}'", "libc:exit")
    assert r.returncode == status, r.stderr


def test_a_command_that_the_session_ended_leaves_status_0(target: Path) -> None:
    r = cli("count", "-d", "0.5", "-c", "sleep 30", "libc:malloc")
    assert r.returncode == 0, r.stderr


# -- --kernel without kprobes ----------------------------------------------------------------------


@pytest.mark.skipif(
    TRACEFS is not None and (TRACEFS / "kprobe_events").exists(),
    reason="this kernel has kprobe events: the refusal is for one without (the VM has them)",
)
def test_kernel_without_kprobes_refuses_before_the_command_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r = cli("trace", "--kernel", "-c", f"sh -c 'touch {marker}'", "p do_sys_openat2")
    assert r.returncode == 1
    assert "CONFIG_KPROBES" in r.stderr or "kprobe_events" in r.stderr, r.stderr
    assert not marker.exists()


# -- no silent nothing ---------------------------------------------------------------------------


@pytest.fixture
def ticker(build: Callable[[str], Path], popen: Callable[..., subprocess.Popen[bytes]]) -> int:
    """A ticker that calls work() every 20 ms for a minute, libc mapped: its pid."""
    proc = popen([build("ticker"), 3000, 20000], stdout=subprocess.DEVNULL)
    support.wait_until(
        lambda: "libc.so" in Path(f"/proc/{proc.pid}/maps").read_text(), 10, "libc mapped"
    )
    return proc.pid


def test_p_with_a_library_not_mapped_is_an_error_unless_pending(ticker: int) -> None:
    r = cli("trace", "-p", ticker, "-d", "1", "libfoo:bar")
    assert r.returncode == 1
    assert re.fullmatch(
        rf"kprobes: no module 'libfoo' is mapped in process {ticker} \(mapped: [^)]*\); "
        r"--pending waits until it loads it",
        r.stderr.rstrip("\n"),
    ), r.stderr
    r = cli("trace", "-p", ticker, "-d", "0.5", "--pending", "libfoo:bar")
    assert r.returncode == 0, r.stderr
    assert (
        "kprobes: libfoo:bar is pending: it is placed when its file is mapped (a library "
        "loaded, or a program run by exec)"
    ) in r.stderr.splitlines()


def test_c_names_each_probe_never_placed_and_why(target: Path) -> None:
    r = cli("count", "-c", f"{target} 2", "libc:mallco", "work")
    assert r.returncode == 0, r.stderr  # work was placed (and hit twice)
    assert count_rows(r.stdout)["work"] == 2
    (line,) = [line for line in r.stderr.splitlines() if "never placed" in line]
    assert re.fullmatch(
        r"kprobes: libc:mallco was never placed: no symbol 'mallco' in /\S*/libc\.so\.6 "
        r"\(searched \.dynsym\); did you mean 'malloc'.*\?",
        line,
    ), line


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "through-sh"])
@pytest.mark.parametrize("command", ["count", "trace"])
def test_c_with_no_probe_ever_placed_exits_1(target: Path, command: str, wrapped: bool) -> None:
    """Through a shell that forks the program (a followed child with copies of the probes),
    as run directly: each probe once, and status 1."""
    run = f"sh -c '{target} 2; true'" if wrapped else f"{target} 2"
    r = cli(command, "-c", run, "libfoo:bar", "r libfoo:baz")
    assert r.returncode == 1, r.stderr
    never = [line for line in r.stderr.splitlines() if "never placed" in line]
    assert never == [
        "kprobes: libfoo:bar was never placed: the program never loaded libfoo",
        "kprobes: libfoo:baz was never placed: the program never loaded libfoo",
    ], r.stderr


# -- the tool starts fast --------------------------------------------------------------------------

HEAVY = ("kprobes.process.target", "kprobes.tracefs.session", "iced_x86", "elftools")


def _modules_after(argv: list[str]) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules a new interpreter holds after ``kprobes ARGV``, and its run."""
    code = (
        "import sys\n"
        "from kprobes.cli import main\n"
        "try:\n"
        f"    main.main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODULES', ' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    listed = [line for line in r.stderr.splitlines() if line.startswith("MODULES ")]
    assert listed, r.stderr[-2000:]
    return set(listed[-1].split()[1:]), r


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], *([c, "--help"] for c in ("count", "record", "script", "report"))],
)
def test_help_imports_no_engine(argv: list[str]) -> None:
    """``kprobes --help``, ``--version`` and a command's ``--help`` import none of the
    machinery (start-up is measured by ``python -m bench.tool_start``)."""
    loaded, r = _modules_after(argv)
    assert "kprobes.cli.main" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert "count" in r.stdout or "kprobes " in r.stdout


def test_counting_with_c_imports_neither_dwarf_nor_pyelftools(target: Path) -> None:
    """Placing a jump probe reads symbols and FDE headers with our own readers: pyelftools
    (about 30 ms to import) and the DWARF readers are for jprobes and unwinding only."""
    loaded, r = _modules_after(["count", "-c", f"{target} 3", "work"])
    assert "kprobes.process.target" in loaded and "kprobes.symbols.cfi" in loaded
    assert re.search(r"^work +3$", r.stdout, re.M), r.stdout + r.stderr
    unwanted = {"elftools", "kprobes.symbols.dwarf", "kprobes.symbols.cfi_decode"}
    assert not loaded & unwanted, sorted(loaded & unwanted)


def test_every_public_name_is_there_when_asked() -> None:
    """``kprobes`` imports its names on first use: each one in ``__all__`` resolves."""
    code = "import kprobes\nfor name in kprobes.__all__:\n    getattr(kprobes, name)\nprint('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout == "ok\n", r.stderr
