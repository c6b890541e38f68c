"""One line, with a hint (issue 22, item 4): the command line's error lines say what would do.

Each case runs the real command on a real program and checks its line verbatim, or by a
regular expression where the line names what differs between machines (libc's path, the
closest names libc happens to have):

    an unknown fetch-arg type      the types valid for this probe, the column still shown
    an unknown symbol              "did you mean" the closest names, on the ptrace backend
                                   and on --backend uprobes, pending (-c) or not
    --filter tid/pid/comm          the thread id, the process id and the name, on both
                                   backends; a field not found lists the fields
    permission                     what is needed, without a traceback: run as user nobody
                                   with no capability (``as_nobody``)
    many notes of a kind           one line with counts by reason (pending probes, probes
                                   that keep a breakpoint); ``-v`` says each on its line
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import support

from kprobes.cli.notes import kind_of, summarise
from kprobes.linux import procfs

pytestmark = pytest.mark.ptrace

KPROBES = support.KPROBES
TRACEFS = support.tracefs_root()
needs_uprobes = support.needs_uprobes
cli = support.cli
BACKENDS = support.CLI_BACKENDS
CONTEXT = re.compile(r"^ *(?P<comm>\S+)-(?P<pid>\d+) +\[\d{3}\] +\d+\.\d{6}: ")
# The closest names of a misspelt libc function: malloc first, then whatever libc has.
MALLOC_HINT = r"; did you mean 'malloc'(?:, '\w+')*(?: or '\w+')?\?"


@pytest.fixture
def target(build: Callable[[str], Path]) -> Path:
    return build("target")


@pytest.fixture
def ticker(build: Callable[[str], Path], popen: Callable[..., subprocess.Popen[bytes]]) -> int:
    """A ticker that calls work() every 20 ms for a minute, run by root: its pid."""
    proc = popen([build("ticker"), 3000, 20000], stdout=subprocess.DEVNULL)
    support.wait_until(lambda: _maps_libc(proc.pid), 10, "libc mapped")
    return proc.pid


def _maps_libc(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libc" in maps.read()


# --- an unknown type -------------------------------------------------------------------------

ALL_TYPES = (
    "valid types: s8/16/32/64, u8/16/32/64, x8/16/32/64, char, string, ustring, symbol, "
    "symstr, %pd/%pD, b<width>@<offset>/<container> (a bitfield), TYPE[N] (an array)"
)
UPROBE_TYPES = (
    "valid types: s8/16/32/64, u8/16/32/64, x8/16/32/64, char, string, ustring, "
    "b<width>@<offset>/<container> (a bitfield), TYPE[N] (an array)"
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unknown_type_lists_the_valid_types(target: Path, backend: str) -> None:
    r = cli("trace", "--backend", backend, "-c", f"{target} 1", "work x=%di:u63")
    assert r.returncode == 2
    assert r.stderr == (
        f"kprobes: Unknown type is specified; {ALL_TYPES}\n"
        "  work x=%di:u63\n"
        "             ^\n"
    )


def test_a_kprobe_type_on_a_uprobe_says_so(target: Path) -> None:
    line = f"{target}:work x=%di:symstr"
    r = cli("trace", "-c", f"{target} 1", line)
    assert r.returncode == 2
    caret = " " * line.index("symstr")
    assert r.stderr == (
        f"kprobes: Unknown type is specified; symstr is for kprobes only; {UPROBE_TYPES}\n"
        f"  {line}\n"
        f"  {caret}^\n"
    )


def test_a_bad_bitfield_container_says_which_are_good(target: Path) -> None:
    r = cli("trace", "-c", f"{target} 1", "work x=%di:b3@0/12")
    assert r.returncode == 2
    assert r.stderr == (
        "kprobes: Unknown type is specified; a bitfield's container is 8, 16, 32 or 64 bits; "
        f"{ALL_TYPES}\n"
        "  work x=%di:b3@0/12\n"
        "             ^\n"
    )


@needs_uprobes
def test_a_type_the_kernels_uprobes_refuse_lists_theirs(target: Path) -> None:
    """Our grammar takes :symbol for a bare name (a kprobe's spelling); the kernel's uprobes
    refuse it: its error_log line comes with the types a uprobe may use."""
    r = cli("trace", "--backend", "uprobes", "-c", f"{target} 1", "work x=%di:symbol")
    assert r.returncode == 1
    head = (
        r"kprobes: uprobe_events: Unknown type is specified \(column \d+, at 'symbol' in "
        r"'p:kprobes_\d+/p_work_0 \S+:0x[0-9a-f]+ x=%di:symbol'\); "
    )
    assert re.fullmatch(head + re.escape(UPROBE_TYPES), r.stderr.splitlines()[0]), r.stderr


# --- an unknown symbol -----------------------------------------------------------------------


def test_a_misspelt_symbol_gets_the_closest_name(target: Path) -> None:
    r = cli("trace", "-c", f"{target} 1", "wrok")
    assert r.returncode == 1
    assert r.stderr == (
        f"kprobes: no symbol 'wrok' in {target} (searched .symtab, .dynsym); "
        "did you mean 'work'?\n"
    )


@needs_uprobes
def test_a_misspelt_symbol_gets_the_closest_name_on_the_kernels_uprobes(target: Path) -> None:
    r = cli("trace", "--backend", "uprobes", "-c", f"{target} 1", "wrok")
    assert r.returncode == 1
    assert r.stderr == f"kprobes: no symbol 'wrok' in {target}; did you mean 'work'?\n"


def test_a_misspelt_data_symbol_gets_the_closest_names(target: Path) -> None:
    r = cli("trace", "-c", f"{target} 1", "work c=@countr:u64")
    assert r.returncode == 1
    assert r.stderr == (
        f"kprobes: no symbol 'countr' in {target}; did you mean 'counter' or 'compute'?\n"
    )


def test_a_misspelt_libc_symbol_in_a_running_process(ticker: int) -> None:
    r = cli("trace", "-p", ticker, "libc:mallco", "-d", "1")
    assert r.returncode == 1
    assert re.fullmatch(
        r"kprobes: no symbol 'mallco' in /\S*/libc\.so\.6 \(searched \.dynsym\)" + MALLOC_HINT,
        r.stderr.rstrip("\n"),
    ), r.stderr


def test_a_misspelt_libc_symbol_pending_with_c_names_the_closest(target: Path) -> None:
    """libc is not mapped when the probes are placed: the probe is pending, and the line
    that says it cannot be placed when libc appears names the closest names."""
    r = cli("trace", "-c", f"{target} 1", "libc:mallco")
    said = r.stderr.splitlines()
    pattern = (
        r"kprobes: pending probe libc:mallco stays pending: no symbol 'mallco' in "
        r"/\S*/libc\.so\.6 \(searched \.dynsym\)" + MALLOC_HINT
    )
    assert any(re.fullmatch(pattern, line) for line in said), r.stderr


@needs_uprobes
def test_a_misspelt_libc_symbol_with_c_on_the_kernels_uprobes(target: Path) -> None:
    r = cli("trace", "--backend", "uprobes", "-c", f"{target} 1", "libc:mallco")
    assert r.returncode == 1
    assert re.fullmatch(
        r"kprobes: no symbol 'mallco' in /\S*/libc\.so\.6" + MALLOC_HINT,
        r.stderr.rstrip("\n"),
    ), r.stderr


# --- --filter tid, pid, comm -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_filter_knows_tid_pid_and_comm(ticker: int, backend: str) -> None:
    keep = f'pid == {ticker} && tid == {ticker} && comm == "ticker" && common_pid == {ticker}'
    r = cli("trace", "--backend", backend, "-p", ticker, "-n", "2", "--filter", keep, "work")
    assert r.returncode == 0, r.stderr
    contexts = [CONTEXT.match(line) for line in r.stdout.splitlines()]
    assert [(m["comm"], int(m["pid"])) for m in contexts if m] == [("ticker", ticker)] * 2
    r = cli(
        "trace", "--backend", backend, "-p", ticker, "-d", "0.5", "--filter",
        f"pid != {ticker} || tid != {ticker}", "work",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert not any(CONTEXT.match(line) for line in r.stdout.splitlines()), r.stdout
    assert re.search(r"\b0 printed, [1-9]\d* filtered out", r.stderr), r.stderr


def test_a_field_not_found_lists_the_fields(target: Path) -> None:
    r = cli("trace", "-c", f"{target} 1", "--filter", "tdi == 1", "work i=%di")
    assert r.returncode == 2
    assert r.stderr == (
        "kprobes: Field not found; fields: common_pid, comm, cpu, tid, pid, i\n"
        "  tdi == 1\n"
        "  ^\n"
    )


# --- permission ------------------------------------------------------------------------------


def as_nobody(argv: Sequence[object]) -> subprocess.CompletedProcess[str]:
    """``argv`` run as user nobody, with no capability (``setpriv``), to its end.

    The venv's Python may live under a directory only root may enter (``/root/.pyenv``): a
    private mount namespace (``unshare``) then lays a tmpfs over that directory, with the
    Python installation bound back at its own path, so the command runs unchanged and
    nothing outside the namespace sees a difference.
    """
    if os.geteuid() != 0:
        pytest.skip("running a command as another user needs root")
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (util-linux) is not installed")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("there is no user nobody")
    prefix = Path(os.path.realpath(KPROBES.parent / "python")).parent.parent
    closed = next(
        (d for d in reversed(prefix.parents) if not os.stat(d).st_mode & 0o001),
        None,
    )
    drop = [
        "setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
        "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
    ]  # fmt: skip
    argv = [str(a) for a in argv]
    if closed is None:
        return subprocess.run([*drop, *argv], capture_output=True, text=True, timeout=60)
    with tempfile.TemporaryDirectory() as hold:
        os.chmod(hold, 0o755)
        script = (
            'set -e; mount --bind "$PREFIX" "$HOLD"; '
            'mount -t tmpfs -o mode=755 tmpfs "$CLOSED"; mkdir -p "$PREFIX"; '
            'mount --bind "$HOLD" "$PREFIX"; exec "$@"'
        )
        env = {**os.environ, "PREFIX": str(prefix), "HOLD": hold, "CLOSED": str(closed)}
        private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
        return subprocess.run(
            [*private, *drop, *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )


def _what_is_needed() -> str:
    """What the line says is needed, by this kernel's kernel.yama.ptrace_scope."""
    scope = procfs.ptrace_scope()
    if scope is None:
        return "needs root, CAP_SYS_PTRACE, or the same user"
    return {
        0: "needs root, CAP_SYS_PTRACE, or the same user (kernel.yama.ptrace_scope is 0)",
        1: "needs root or CAP_SYS_PTRACE: kernel.yama.ptrace_scope is 1, so a user may "
        "trace only the programs it starts (-c)",
        2: "needs root or CAP_SYS_PTRACE (kernel.yama.ptrace_scope is 2)",
    }.get(scope, f"no process may be traced: kernel.yama.ptrace_scope is {scope} until a reboot")


def test_another_users_process_says_what_tracing_it_needs(ticker: int) -> None:
    r = as_nobody([KPROBES, "count", "-p", ticker, "work", "-d", "1"])
    assert r.returncode == 1
    assert r.stderr == (
        f"kprobes: cannot trace process {ticker} (ticker, user root): permission denied; "
        f"{_what_is_needed()}\n"
    )
    assert support.tracer_of(ticker, ticker) == 0


def test_another_users_process_on_the_kernels_uprobes_needs_root(ticker: int) -> None:
    r = as_nobody([KPROBES, "trace", "--backend", "uprobes", "-p", ticker, "work", "-d", "1"])
    assert r.returncode == 1
    assert r.stderr == (
        "kprobes: tracing through tracefs needs root: tracefs and debugfs are root-only "
        "(run as root)\n"
    )


def test_listing_the_kernels_kprobes_needs_root() -> None:
    r = as_nobody([KPROBES, "list", "--kernel"])
    assert r.returncode == 1
    assert r.stderr == (
        "kprobes: reading the kernel's kprobes (debugfs kprobes/) needs root: tracefs and "
        "debugfs are root-only (run as root)\n"
    )


@pytest.mark.parametrize(
    ("scope", "needs"),
    [
        (None, "needs root, CAP_SYS_PTRACE, or the same user"),
        (1, "needs root or CAP_SYS_PTRACE: kernel.yama.ptrace_scope is 1, so a user may "
         "trace only the programs it starts (-c)"),
        (3, "no process may be traced: kernel.yama.ptrace_scope is 3 until a reboot"),
    ],
)  # fmt: skip
def test_the_need_follows_yamas_ptrace_scope(
    monkeypatch: pytest.MonkeyPatch, ticker: int, scope: int | None, needs: str
) -> None:
    """Each ptrace_scope says its own need (this kernel may have no Yama to set)."""
    from kprobes.process import launch

    monkeypatch.setattr(procfs, "ptrace_scope", lambda: scope)
    said = str(launch._not_permitted(ticker))
    assert said == f"cannot trace process {ticker} (ticker, user root): permission denied; {needs}"


# --- many notes of a kind: one line ------------------------------------------------------------

FOUR_IN_LIBC = ["libc:malloc", "libc:free", "libc:strlen", "libc:memcpy"]


def test_four_pending_probes_are_one_line_and_v_lists_them(target: Path) -> None:
    r = cli("count", "-c", f"{target} 1", *FOUR_IN_LIBC)
    assert r.returncode == 0, r.stderr
    pending = [line for line in r.stderr.splitlines() if "pending" in line]
    assert pending == [
        "kprobes: 4 probes are pending, each placed when its file is mapped (a library "
        "loaded, or a program run by exec): 4 in libc (-v lists them)"
    ], r.stderr
    r = cli("count", "-v", "-c", f"{target} 1", *FOUR_IN_LIBC)
    pending = [line for line in r.stderr.splitlines() if "pending" in line]
    assert pending == [
        f"kprobes: {name} is pending: it is placed when its file is mapped (a library loaded, "
        "or a program run by exec)"
        for name in FOUR_IN_LIBC
    ], r.stderr


def test_probes_that_keep_a_breakpoint_are_counted_by_reason(ticker: int) -> None:
    """Most of libc's str* functions begin with a conditional jump within five bytes, or
    are too short: each keeps its int3, and the reasons are counted on one line."""
    r = cli("count", "-p", ticker, "-d", "0.2", "libc:str*")
    assert r.returncode == 0, r.stderr
    kept = [line for line in r.stderr.splitlines() if "use a breakpoint" in line]
    assert len(kept) == 1, r.stderr
    m = re.fullmatch(r"kprobes: (\d+) probes use a breakpoint: (.*) \(-v lists them\)", kept[0])
    assert m is not None, kept[0]
    counts = [int(part.split(" ", 1)[0]) for part in m.group(2).split("; ")]
    assert sum(counts) == int(m.group(1)) > 3 and counts == sorted(counts, reverse=True)
    r = cli("count", "-v", "-p", ticker, "-d", "0.2", "libc:str*")
    each = [line for line in r.stderr.splitlines() if " uses a breakpoint: " in line]
    assert len(each) == int(m.group(1)), r.stderr


def test_a_reason_counts_with_its_kind_whatever_its_details() -> None:
    assert kind_of("a conditional jump in the region (`je 0x7f30` at 0x7f2c)") == (
        "a conditional jump in the region"
    )
    assert kind_of("indirect jump at 0x7fe6b65ae774") == "indirect jump"
    assert kind_of("only 4 bytes to the function's end; the jump needs 5") == (
        "only N bytes to the function's end; the jump needs N"
    )
    notes = [(f"f{i}", f"indirect jump at {0x1000 + i:#x}") for i in range(3)]
    assert summarise(notes, one="uses", many="use", verbose=False) == [
        f"f{i} uses: indirect jump at {0x1000 + i:#x}" for i in range(3)
    ]
    notes.append(("g", "a call in the region (`call 0x10` at 0x2)"))
    assert summarise(notes, one="uses", many="use", verbose=False) == [
        "4 probes use: 3 indirect jump; 1 a call in the region (-v lists them)"
    ]

