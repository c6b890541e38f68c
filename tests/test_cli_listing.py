"""``kprobes list -l`` (issue 22, item 6): the functions that can be probed, as ``bpftrace -l``,
``funccount -l`` and ``perf probe -F`` list them, of a process (``-p``), of the files a command
maps when it starts (``-c``, not run) or of one ELF file (``PATH``).

The references: the symbol tables as ``readelf`` reads them (which functions there are), and
``count`` itself, placing a probe on each of them in the same process (what the listing says
of a function is what placing it does: a jump, a breakpoint and why, or a refusal and why).
The program ``listing`` has a function of each kind.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import support
from test_cli_trace import count_rows

from kprobes.cli import main as cli_main

pytestmark = pytest.mark.ptrace

cli = support.cli
Build = Callable[[str], Path]


@pytest.fixture
def program(build: Build) -> Path:
    return build("listing")


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    line = support.read_line(proc.stderr.fileno(), timeout=10).decode()
    assert line == f"listing {proc.pid} ready\n", line
    return proc


@pytest.fixture
def running(program: Path) -> Iterator[int]:
    """The pid of a running ``listing``."""
    proc = _start([str(program)])
    yield proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def listed(*args: object) -> list[str]:
    """The lines ``kprobes list -l ARGS`` prints (it must succeed), through the command
    line's ``main()`` in this process: listing starts no program, and an interpreter's
    start-up per call made these tests the suite's slowest (the round trip through the
    real ``kprobes`` and ``count`` is checked by its own test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main.main(["list", "-l", *map(str, args)])
    assert code == 0, err.getvalue()
    return out.getvalue().splitlines()


def verbose(*args: object) -> dict[str, str]:
    """``list -l -v ARGS`` as {probe: how and why}."""
    rows = {}
    for line in listed("-v", *args):
        name, _, note = line.partition("  ")
        rows[name] = note.strip()
    return rows


def readelf_functions(path: Path | str, *, dynamic: bool) -> set[str]:
    """The defined FUNC and IFUNC symbols of ``path`` with a value, by readelf (``--dyn-syms``
    alone for ``dynamic``, else every table)."""
    option = "--dyn-syms" if dynamic else "-sW"
    out = subprocess.run(
        ["readelf", "-W", option, str(path)], capture_output=True, text=True, check=True
    ).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        is_function = len(parts) >= 8 and parts[3] in ("FUNC", "IFUNC")
        if is_function and parts[6] != "UND" and int(parts[1], 16) != 0:
            names.add(parts[7].split("@")[0])
    return names


def test_each_kind_of_function_is_said_with_its_reason(running: int, program: Path) -> None:
    rows = verbose("-p", running)

    def at(name: str) -> str:
        return f"{support.runtime_address(running, program, name):#x}"

    loop = at("loops_back")
    inner = f"{int(loop, 16) + 2:#x}"  # the loop's head: its second instruction
    jl = f"{int(loop, 16) + 7:#x}"
    assert rows["roomy"] == "jump"
    assert rows["tiny"] == "breakpoint: only 1 bytes to the function's end; the jump needs 5"
    assert rows["unsized"] == "breakpoint: the function's size is unknown"
    assert rows["loops_back"] == (
        f"breakpoint: `jl {inner}` at {jl} jumps into the region ({inner})"
    )
    assert rows["starts_int3"] == (
        f"refused: cannot probe `int3` at {at('starts_int3')}: already a breakpoint (another "
        "debugger, or a kernel uprobe of another tool?)"
    )
    assert rows["starts_int80"] == (
        f"refused: cannot probe `int 0x80` at {at('starts_int80')}: a software interrupt (int n)"
    )
    assert rows["in_data"] == f"refused: {at('in_data')} (in_data+0x0) is not in executable code"
    assert rows["chosen"] == "ifunc: placed on the implementation its resolver returns, judged then"


def test_without_v_the_probeable_are_listed_and_the_refused_said_on_stderr(
    running: int, program: Path
) -> None:
    result = cli("list", "-l", "-p", running)
    assert result.returncode == 0, result.stderr
    names = result.stdout.splitlines()
    every = readelf_functions(program, dynamic=False)
    refused = {"starts_int3", "starts_int80", "in_data"}
    assert names == sorted(every - refused)  # breakpoints and ifuncs are probeable
    rows = verbose("-p", running)
    assert result.stderr == "".join(
        f"kprobes: {name} cannot be probed: {rows[name].removeprefix('refused: ')}\n"
        for name in sorted(refused)
    )


def test_the_listing_says_what_count_does_with_each_function(running: int) -> None:
    """``count`` places a probe on every function of the program and of libc's ``str*``:
    it keeps a breakpoint where the listing says so and for the same reason, and skips
    what the listing says is refused, with the same words."""
    for pattern, module in (("*", ""), ("libc:str*", "libc")):
        rows = verbose(pattern, "-p", running)
        result = cli("count", "-v", "-p", running, "-d", "0.3", pattern, timeout=120)
        assert result.returncode == 0, result.stderr
        prefix = f"{module}_" if module else ""
        kept = dict(
            re.findall(rf"kprobes/p_{prefix}(\w+?)_\d+ uses a breakpoint: (.*)", result.stderr)
        )
        skipped = dict(re.findall(r"kprobes: (\S+) skipped: (.*)", result.stderr))
        for function, note in rows.items():
            bare = function.rpartition(":")[2]
            how, _, why = note.partition(": ")
            if how == "jump":
                assert bare not in kept and function not in skipped, function
            elif how == "breakpoint":
                assert kept.get(bare) == why, function
            elif how == "refused":
                assert skipped.get(function) == why, function
            else:  # an ifunc is judged at its implementation, which is what count probes
                assert how == "ifunc", note
        assert module or {"tiny", "unsized", "loops_back"} <= kept.keys()


def test_the_names_are_the_function_symbols_readelf_reads(running: int, program: Path) -> None:
    libc = support.libc_path(program)
    assert set(verbose("libc:*", "-p", running)) == {
        f"libc:{name}" for name in readelf_functions(libc, dynamic=True)
    }
    assert set(verbose("-p", running)) == readelf_functions(program, dynamic=False)


def test_what_is_listed_count_takes_back(running: int) -> None:
    """``kprobes list -l 'libc:str*' -p PID | xargs kprobes count -p PID``."""
    for pattern in ("libc:str*", "*", "*:ro*"):
        names = listed(pattern, "-p", running)
        result = cli("count", "-p", running, "-d", "0.3", *names, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "skipped" not in result.stderr and "never placed" not in result.stderr
    rows = count_rows(cli("count", "-p", running, "-d", "0.3", "roomy", "tiny").stdout)
    assert rows["roomy"] > 0 and rows["tiny"] > 0


def test_a_module_glob_lists_every_file_it_matches(running: int, program: Path) -> None:
    """``'*:malloc'``: which files have it, as bpftrace's ``uprobe:*:malloc`` with ``-p``;
    each named by its basename, which ``count`` takes back."""
    libc = [name.removeprefix("libc:") for name in listed("libc:str*", "-p", running)]
    assert listed("*:str*", "-p", running) == [f"libc.so.6:{name}" for name in libc]
    assert listed("*:roomy", "-p", running) == ["listing:roomy"]
    assert listed("li*:ro*", "-c", program) == listed("li*:ro*", "-p", running)
    every = listed("*:*", "-p", running)
    for path in {Path(m.path) for m in support.maps(running) if m.path.startswith("/")}:
        ours = {n.partition(":")[2] for n in every if n.startswith(f"{path.name}:")}
        names = readelf_functions(path, dynamic=path.resolve() != program)
        assert ours == names - {"starts_int3", "starts_int80", "in_data"}, path


def test_c_lists_the_files_the_command_maps_without_running_it(
    running: int, program: Path, tmp_path: Path
) -> None:
    assert listed("libc:*", "-c", program) == listed("libc:*", "-p", running)
    assert listed("-c", f"{program} 5") == listed("-p", running)
    # The file's own addresses, as PATH gives them (a process shows its load bias's).
    assert verbose("-c", program) == {
        name.rpartition(":")[2]: note for name, note in verbose(program).items()
    }
    marker = tmp_path / "ran"
    names = listed("libc:str*", "-c", f"touch {marker}")
    assert "libc:strlen" in names
    assert not marker.exists()


def test_a_path_lists_its_file_in_every_spelling(running: int, program: Path) -> None:
    own = listed("-p", running)
    assert listed(program) == [f"{program}:{name}" for name in own]
    expected = [f"{program}:roomy"]
    assert listed(f"{program}:ro*") == expected
    assert listed(f"uprobe:{program}:ro*") == expected
    assert listed("ro*", program) == expected
    # perf probe -F -x PATH; with -p or -c, the file as the process or command maps it.
    assert listed("-x", program) == listed(program)
    assert listed("ro*", "-x", program) == expected
    assert listed("ro*", "-x", program, "-p", running) == expected
    assert listed("ro*", "-x", program, "-c", program) == expected
    assert listed("c:str*", "-p", running) == listed("libc:str*", "-p", running)


def test_the_process_is_neither_stopped_nor_traced(program: Path) -> None:
    """A process another tracer holds (here its parent: PTRACE_TRACEME) cannot be attached
    to, and is listed all the same."""
    proc = _start([str(program), "traceme"])
    try:
        tracer = support.tracer_of(proc.pid, proc.pid)
        assert tracer != 0
        assert "roomy" in listed("-p", proc.pid)
        assert support.tracer_of(proc.pid, proc.pid) == tracer
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_json_rows_are_the_text_rows_with_their_fields(running: int, program: Path) -> None:
    text = listed("-p", running)
    rows = [json.loads(line) for line in listed("--json", "-p", running)]
    assert [row["probe"] for row in rows] == text
    every = [json.loads(line) for line in listed("--json", "-v", "-p", running)]
    assert [row["probe"] for row in every] == list(verbose("-p", running))
    by_name = {row["probe"]: row for row in every}
    roomy = by_name["roomy"]
    sym = support.symbol(program, "roomy")
    assert roomy == {
        "probe": "roomy",
        "how": "jump",
        "why": "",
        "addr": support.runtime_address(running, program, "roomy"),
        "size": sym.size,
        "file": str(program),
    }
    assert by_name["starts_int3"]["how"] == "refused"


def test_nothing_probeable_is_exit_status_1(running: int) -> None:
    result = cli("list", "-l", "starts_*", "-p", running)
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 2


def _pid_that_does_not_exist() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_each_error_is_one_line(
    running: int, program: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each error through the command line's ``main()`` in this process (the same code as
    ``kprobes list``, without an interpreter's start-up per case)."""

    def cli(*args: object) -> subprocess.CompletedProcess[str]:
        code = cli_main.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    text = tmp_path / "notes.txt"
    text.write_text("not a program\n")
    stripped = tmp_path / "stripped"
    shutil.copy(program, stripped)
    subprocess.run(["strip", str(stripped)], check=True)
    mapped = ", ".join(
        sorted({Path(m.path).name for m in support.maps(running) if m.path.startswith("/")})
    )
    libc = support.libc_path(program)
    nopid = _pid_that_does_not_exist()
    cases = [
        (("-p", nopid), f"no process {nopid}"),
        (
            ("libnosuch:*", "-p", running),
            f"no module 'libnosuch' is mapped in process {running} (mapped: {mapped})",
        ),
        ((tmp_path / "absent",), f"cannot read {tmp_path / 'absent'}: No such file or directory"),
        ((text,), f"{text} is not an ELF file"),
        (
            ("zz*", "-p", running),
            f"no function of {program} matches 'zz*' (searched .symtab, .dynsym)",
        ),
        (("libc:zz*", "-c", program), f"no function of {libc} matches 'zz*' (searched .dynsym)"),
        (
            (stripped,),
            f"no function in {stripped} (searched .dynsym); the file is stripped: its own "
            "functions have no names (a library's are listed as MODULE:GLOB, as 'libc:*')",
        ),
        (
            ("libnosuch:*", "-c", program),
            "no file 'libnosuch' among those listing maps when it starts (listing, libc.so.6, "
            "ld-linux-x86-64.so.2); a file it maps later is named by its absolute path",
        ),
        (("-c", "no-such-command-here"), "cannot run no-such-command-here: not found in PATH"),
        ((), "list -l: give -p PID, -c CMD or an ELF file's PATH"),
        (("-x", tmp_path / "absent"), f"-x {tmp_path / 'absent'}: no such file"),
        (("a*", "b*", "-p", running), "list -l: one PATTERN with -p or -c, not 2 words"),
        (("-p", running, "-c", program), "list -l: -p PID or -c CMD, not both"),
        (
            ("libno*:*", "-p", running),
            f"no module matching 'libno*' is mapped in process {running} (mapped: {mapped})",
        ),
        (
            ("libno*:*", "-c", program),
            "no file matching 'libno*' among those listing maps when it starts (listing, "
            "libc.so.6, ld-linux-x86-64.so.2)",
        ),
        (
            ("c:str*", program),
            "list -l c:str* PATH: with a PATH the pattern is a GLOB over its functions, with no "
            "MODULE:",
        ),
        (
            ("--kernel", "-p", running),
            "list -l judges functions for kprobes' own mechanism; the kernel's uprobes and "
            "kprobes judge a probe when it is enabled (leave out --backend and --kernel)",
        ),
    ]
    for args, message in cases:
        result = cli("list", "-l", *args)
        assert (result.returncode, result.stdout, result.stderr) == (
            1,
            "",
            f"kprobes: {message}\n",
        ), args
    result = cli("list", "-p", running, "libc:*")
    assert result.stderr == "kprobes: list: PATTERN or PATH goes with -l (list -l: the functions)\n"
