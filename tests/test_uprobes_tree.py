"""Both backends follow the process tree, and count exactly what the kernel counts.

Each test runs the same command twice, once under ``kprobes count`` (``--backend uprobes``, and
our own ptrace backend where the test says so) and once
under the kernel's own uprobes placed by hand (``kernel_reference``, which shares no code with
kprobes), and compares the counts probe by probe: ``-c`` counts the command and every process
it starts (fork, vfork, clone, posix_spawn, through exec) from its first instruction; ``-p``
counts the process, and with ``--follow-forks`` the processes it starts afterwards.

The runs must be alike for the counts to be: the same environment (``PYTHONHASHSEED`` fixed,
no bytecode written), the same argv, a pipe for stdout and stderr and /dev/null for stdin.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import support
from kernel_reference import TRACEFS, KernelReference, ReferenceRun, RefProbe
from test_cli_trace import KPROBES

from kprobes.process.survival.cleanup import read_state

pytestmark = pytest.mark.ptrace

PROGRAMS = Path(__file__).resolve().parent / "programs"
PYTHON = "/usr/bin/python3"
PROGRAM = "import json; d = {str(i): [i] * i for i in range(300)}; print(len(json.dumps(d)))"
N = 5  # tree.c's unit of work


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tree") / "tree"
    cmd = ["gcc", "-O1", "-g", "-fno-inline", "-Wall", "-pthread", "-o", str(out)]
    subprocess.run([*cmd, str(PROGRAMS / "tree.c")], check=True, timeout=60)
    return out


@pytest.fixture
def clean_tracefs() -> Iterator[None]:
    """Neither kprobes nor the reference may leave an instance or an event behind."""

    def ours() -> tuple[set[str], list[str]]:
        names = {p.name for p in (TRACEFS / "instances").iterdir()}
        lines = (TRACEFS / "uprobe_events").read_text().splitlines()
        return (
            {n for n in names if n.startswith(("kprobes_", "kpref_"))},
            [line for line in lines if ":kprobes_" in line or ":kpref_" in line],
        )

    before = ours()
    yield
    assert ours() == before, "a session left something in tracefs"


def same_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{tmp_path / 'bin'}:{env.get('PATH', os.defpath)}"
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def count_json(*args: object, env: dict[str, str], timeout: float = 120) -> dict[str, int]:
    """``kprobes count --json ARGS``: {probe as given: hits}; it must say nothing was lost."""
    r = subprocess.run(
        [str(KPROBES), "count", "--json", *map(str, args)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr
    assert " 0 dropped" in r.stderr, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {row["probe"]: row["hits"] for row in rows}


def reference_run(probes: list[RefProbe], command: str, *, env: dict[str, str]) -> ReferenceRun:
    """The kernel's counts for ``command`` run as ``kprobes count -c`` runs it."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with KernelReference(probes) as ref:
            run = ref.run(shlex.split(command), env=env, stdin=null, stdout=out_w, stderr=err_w)
    finally:
        for fd in (out_w, err_w, null):
            os.close(fd)
        for fd in (out_r, err_r):
            os.close(fd)  # the outputs are small: they fit in the pipes
    assert run.returncode == 0
    return run


def libc_probes(libc: Path, *names: str) -> list[RefProbe]:
    return [RefProbe(name, libc, name) for name in names]


# ---------------------------------------------------------------------------------------------
# -c: the command and every process it starts


BACKENDS = pytest.mark.parametrize("backend", ["uprobes", "ptrace"])


@BACKENDS
def test_python_through_a_wrapper_script(tmp_path, clean_tracefs, backend):
    """python3 as a pyenv shim is: bash that runs helpers, then execs the interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(
        "#!/bin/bash\n"
        "# a shim: find the real interpreter with a few helper processes, then exec it\n"
        'here=$(dirname "$0")\n'
        "version=$(uname -r | cut -d. -f1)\n"
        '/bin/true "$here" "$version"\n'
        f'exec {PYTHON} "$@"\n'
    )
    shim.chmod(0o755)
    env = same_env(tmp_path)
    libc = support.libc_path(PYTHON)
    command = f"python3 -c {shlex.quote(PROGRAM)}"

    ref = reference_run(libc_probes(libc, "malloc", "free", "realloc"), command, env=env)
    ours = count_json(
        "--backend", backend, "-c", command, "libc:malloc", "libc:free", "libc:realloc", env=env
    )

    assert len(ref.by_process) >= 4  # the shim, $(dirname), $(uname), cut, true
    assert ref.counts_of(ref.root)["malloc"] < ref.counts["malloc"]  # children count too
    expected = {f"libc:{name}": n for name, n in ref.counts.items()}
    assert ours == expected


@BACKENDS
def test_a_script_that_runs_a_program_as_a_child_and_by_exec(
    build, tmp_path, clean_tracefs, backend
):
    procs = build("procs")
    script = tmp_path / "twice.sh"
    script.write_text(f"#!/bin/sh\n{procs} exit 0\nexec {procs} exit 0\n")
    script.chmod(0o755)
    env = same_env(tmp_path)
    libc = support.libc_path(procs)
    probes = [RefProbe("work", procs, "work"), *libc_probes(libc, "malloc", "free")]

    ref = reference_run(probes, str(script), env=env)
    ours = count_json(
        "--backend", backend, "-c", script, f"{procs}:work", "libc:malloc", "libc:free", env=env
    )

    assert ref.counts["work"] == 6  # "procs exit" works 3 times, once in each process
    assert ours == {
        f"{procs}:work": ref.counts["work"],
        "libc:malloc": ref.counts["malloc"],
        "libc:free": ref.counts["free"],
    }


@BACKENDS
def test_every_way_of_starting_a_process(tree, tmp_path, clean_tracefs, backend):
    """fork, vfork + exec, a raw clone and posix_spawn, each from the first instruction."""
    env = same_env(tmp_path)
    probes = [RefProbe("work", tree, "work"), RefProbe("leaf", tree, "leaf")]
    ref = reference_run(probes, f"{tree} go {N}", env=env)
    ours = count_json("--backend", backend, "-c", f"{tree} go {N}", "work", "leaf", env=env)
    assert ref.counts == {"work": 10 * N, "leaf": 2}
    assert ours == dict(ref.counts)


# ---------------------------------------------------------------------------------------------
# -p: a running process, with and without the processes it starts


def _waiting_tree(tree: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([str(tree), str(N)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert support.read_line(proc.stdout.fileno(), timeout=10).strip() == b"ready"
    return proc


def _go(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    def go() -> None:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()

    return go


def _armed(cli_pid: int, events: int) -> bool:
    """Whether the session of the kprobes process ``cli_pid`` has ``events`` events enabled."""
    group = TRACEFS / "instances" / f"kprobes_{cli_pid}" / "events" / f"kprobes_{cli_pid}"
    try:
        enables = [p / "enable" for p in group.iterdir() if (p / "enable").exists()]
        return len(enables) == events and all(e.read_text().strip() == "1" for e in enables)
    except OSError:
        return False


def _placed(cli_pid: int, pid: int, probes: int, backend: str) -> bool:
    """Whether the session of the kprobes process ``cli_pid`` has placed its probes."""
    if backend == "uprobes":
        return _armed(cli_pid, probes)
    state = read_state(pid)  # our backend publishes what it placed (kprobes list -p)
    return state is not None and len(state[1]) == probes


@BACKENDS
@pytest.mark.parametrize("follow", [False, True], ids=["process", "follow-forks"])
def test_attach_with_and_without_the_children(tree, follow, clean_tracefs, backend):
    """-p, and --follow-forks; on our backend the children that exec have images of their own,
    placed as they come (family.py)."""
    probes = [RefProbe("work", tree, "work"), RefProbe("leaf", tree, "leaf")]
    proc = _waiting_tree(tree)
    try:
        with KernelReference(probes) as ref:
            run = ref.attach(proc.pid, _go(proc), lambda: proc.poll() is not None)
    finally:
        proc.kill()
        proc.wait()
    expected = run.counts if follow else run.counts_of(proc.pid)
    assert dict(expected) == ({"work": 10 * N, "leaf": 2} if follow else {"work": 3 * N})

    proc = _waiting_tree(tree)
    try:
        cli = subprocess.Popen(
            [str(KPROBES), "count", "--json", "--zeros", "--backend", backend, "-p", str(proc.pid)]
            + (["--follow-forks"] if follow else [])
            + ["work", "leaf"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        support.wait_until(lambda: _placed(cli.pid, proc.pid, 2, backend), 10, "the probes")
        _go(proc)()
        out, err = cli.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, err
    rows = {r["probe"]: r["hits"] for r in map(json.loads, out.splitlines()) if r}
    assert rows == {"work": expected["work"], "leaf": expected["leaf"]}


# ---------------------------------------------------------------------------------------------
# What the buffer cannot keep is said


def test_lost_events_are_counted_not_hidden(tmp_path, clean_tracefs):
    """With a buffer far too small and a slow reader, hits delivered + hits the kernel could
    not keep (the summary's "dropped") = the kernel's own count."""
    from kprobes.cli.session import parse_spec
    from kprobes.tracefs.uprobes import Uprobes

    env = same_env(tmp_path)
    libc = support.libc_path(PYTHON)
    argv = [PYTHON, "-c", PROGRAM]
    with KernelReference(libc_probes(libc, "malloc")) as ref:
        expected = ref.run(argv, env=env).counts["malloc"]  # stdio: ours, as below

    delivered = 0

    def slow_sink(event: object) -> None:
        nonlocal delivered
        delivered += 1
        time.sleep(0.0001)

    u = Uprobes(command=argv, env=env, sink=slow_sink, buffer_kb=4)
    try:
        u.place_spec(parse_spec("libc:malloc"))
        deadline = time.monotonic() + 30
        while not u.run(1):
            assert time.monotonic() < deadline, "the command did not finish"
        lost = u.lost_events()
    finally:
        u.close()
        support.wait_child(u.pid, 10)
    assert lost > 0
    assert delivered + lost == expected


@BACKENDS
def test_a_program_that_loads_and_unloads_a_plugin_twice(build, tmp_path, clean_tracefs, backend):
    """dlopen, dlclose, dlopen again: the plugin's constructor and calls, each load."""
    host, plugin = build("plughost"), build("libplug.so")
    env = same_env(tmp_path)
    command = f"{host} {plugin} 2 3"
    probes = [RefProbe("work", plugin, "plug_work"), RefProbe("resolve", plugin, "plug_resolve")]
    ref = reference_run(probes, command, env=env)
    specs = (f"{plugin}:plug_work", f"{plugin}:plug_resolve")
    ours = count_json("--backend", backend, "-c", command, *specs, env=env)
    assert ref.counts == {"work": 2 * (1 + 3), "resolve": 2}  # constructor + calls, per load
    assert ours == {f"{plugin}:plug_work": 8, f"{plugin}:plug_resolve": 2}
