"""The command line's stress test: every command, ended every way, against busy programs.

    python tests/stress_commands.py [--seconds N] [--seed S] [--no-load] [--no-other-tool]
                                    [--verbose]

(``make stress`` runs it for ten minutes; ``tests/test_stress_commands.py`` runs it for one
minute in the suite.) For the whole time, in a loop:

* the targets are result-checking programs that run until told to stop: ``checker 4``
  (tests/programs/checker.c: four threads calling ``work``, recursing, allocating, each
  result checked) and a live Python whose loop checks what it computes;
* each round picks a command (``trace``, ``count``, ``latency``, ``hist``), optimized or
  ``--no-optimize`` (an optimized ``trace`` one time in two with ``--block``), with specs
  on the program's own code and on libc, attaches it with ``-p`` and ends it one way: its
  own ``-d``, ``-n``, SIGINT, SIGTERM, SIGHUP, or SIGKILL at a random moment (before it
  placed its probes, while it places them, while it runs);
* a CPU burner runs in another process all along (``--no-load`` leaves it out);
* in every other round on ``malloc``, another tool's kernel uprobe (a tracefs event in an
  instance of its own, as bpftrace or ``perf probe`` places one) goes on the target's libc
  ``malloc`` once our command's int3 or jump is there, and off at another random moment: the
  kernel writes its int3 into every process mapping libc (process/fast/shield.py);
  ``--no-other-tool`` leaves it out, for a run beside other tests, whose programs it would
  slow down and whose checks of libc's bytes it would fail.

What must hold, checked every round and at the end:

* no target dies and none reports a wrong result; at the end each is told to stop and must
  print that every call was checked and exit 0;
* a command ended any way but SIGKILL exits 0 with its summary on stderr;
* after a clean ending, on a target no tool was ever killed in: every byte of every
  executable file mapping is the file's own (no int3, no jump of ours left), and no mapping
  of ours remains beyond what the documented, reused minimum allows (``ours_allowed``).

It prints one line per round with ``--verbose``, and a summary; exit status 0 when all held,
1 with what failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import support  # noqa: E402 - the tests' own helpers
from conftest import build_program  # noqa: E402 - the tests' own builder

KPROBES = [sys.executable, "-c", "import sys; from kprobes.cli.main import main; sys.exit(main())"]

PYTHON_LOOP = r"""
import signal, sys
stop = False
def on_stop(sig, frame):
    global stop
    stop = True
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(s, on_stop)
print("python ready", flush=True)
i = 0
while not stop:
    data = [bytes((i + k) % 251 for k in range(i % 300 + 20)) for _ in range(3)]
    table = {k: k * k for k in range(i % 64)}
    for blob in data:
        if len(blob) != i % 300 + 20 or blob[0] != i % 251:
            print(f"python: BAD blob at {i}", file=sys.stderr, flush=True)
            sys.exit(1)
    if sum(table.values()) != sum(k * k for k in range(i % 64)):
        print(f"python: BAD table at {i}", file=sys.stderr, flush=True)
        sys.exit(1)
    i += 1
print("python: every result checked", flush=True)
"""

# What each command probes, on each kind of target: (command, extra args, specs).
CHECKER_RUNS = [
    ("count", (), ("work", "rec", "libc:malloc", "libc:free")),
    ("trace", (), ("libc:malloc size=%di", "work w=%di i=%si")),
    ("trace", (), ("p work", "r work")),
    ("latency", (), ("work",)),
    ("latency", (), ("nest",)),  # nested returns, through the shadow stacks when optimized
    ("hist", ("--key", "size"), ("libc:malloc size=%di:u64",)),
    ("hist", ("-H", "--key", "x"), ("r nest x=$retval:u64",)),  # aggregated in the program
]
PYTHON_RUNS = [
    ("count", (), ("libc:malloc", "libc:free", "libc:realloc")),
    ("trace", (), ("libc:malloc size=%di",)),
    ("latency", (), ("libc:malloc",)),
    ("hist", ("--key", "size"), ("libc:malloc size=%di:u64",)),
]
ENDINGS = ["duration", "max_events", "SIGINT", "SIGTERM", "SIGHUP", "SIGKILL"]


@dataclass
class Target:
    kind: str  # "checker" or "python"
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    killed_in: int = 0  # tools SIGKILLed while attached: bytes and pages may stay
    rounds: int = 0
    baseline: set[str] = field(default_factory=set)  # its mappings before any tool


@dataclass
class Tally:
    rounds: int = 0
    endings: dict[str, int] = field(default_factory=dict)
    clean_checks: int = 0
    longest_end: float = 0.0
    failures: list[str] = field(default_factory=list)


def start_target(kind: str, workdir: Path, n: int) -> Target:
    out = workdir / f"{kind}{n}.out"
    err = workdir / f"{kind}{n}.err"
    if kind == "checker":
        argv = [str(build_program("checker")), "4"]
        marker = "ready"
        watch = err
    else:
        argv = [sys.executable, "-c", PYTHON_LOOP]
        marker = "python ready"
        watch = out
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while marker not in watch.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{kind} did not start: {err.read_text(errors='replace')}")
        time.sleep(0.02)
    return Target(kind, proc, out, err, baseline=set(mapping_names(proc.pid)))


def mapping_names(pid: int) -> list[str]:
    """Each mapping as "perms name" (anonymous ones by perms and size)."""
    names = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5].strip() if len(fields) > 5 else f"[anon {end - start:#x}]"
            names.append(f"{fields[1]} {name}")
    return names


def ours_now(target: Target) -> list[str]:
    """Mappings the target did not have before any tool attached that look like ours."""
    found = []
    for name in mapping_names(target.proc.pid):
        if name in target.baseline:
            continue
        perms, _, what = name.partition(" ")
        if "kprobes" in what or ("x" in perms and what.startswith("[anon")):
            found.append(name)
    return found


def foreign_bytes(pid: int) -> list[str]:
    """Executable file mappings whose bytes differ from the file's: where and what. The
    int3 of a kernel uprobe (another test's or tool's beside this run: the kernel writes it
    into every process that maps the file) is not ours, and is left out."""
    kernels = kernel_uprobes()
    differ = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or "x" not in fields[1] or not fields[5].startswith("/"):
                continue
            path = fields[5].strip()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            offset = int(fields[2], 16)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    want = f.read(end - start)
            except OSError:
                continue  # deleted or replaced on disk: nothing to compare with
            mem.seek(start)
            got = mem.read(len(want))
            if got == want:
                continue
            kernels |= kernel_uprobes()  # one placed while we read is the kernel's too
            for at in (i for i in range(len(want)) if got[i] != want[i]):
                if got[at] == 0xCC and (os.path.realpath(path), offset + at) in kernels:
                    continue
                differ.append(
                    f"{path}+{offset + at:#x}: {got[at : at + 5].hex()} (file: "
                    f"{want[at : at + 5].hex()})"
                )
                break
    return differ


def kernel_uprobes() -> set[tuple[str, int]]:
    """(file, offset) of every uprobe defined in the kernel (uprobe_events)."""
    root = support.tracefs_root()
    if root is None:
        return set()
    found = set()
    with contextlib.suppress(OSError), open(root / "uprobe_events") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2 and ":" in fields[1]:
                path, _, where = fields[1].rpartition(":")
                with contextlib.suppress(ValueError):
                    found.add((os.path.realpath(path), int(where.split("(")[0], 16)))
    return found


def is_attached(target: int, tool: int) -> bool:
    """Does the command trace the target yet? (Before, a signal only ends an interpreter
    that is still importing: Python's own SIGINT handler, SIGTERM's default action.)"""
    try:
        with open(f"/proc/{target}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1]) == tool
    except OSError:
        pass
    return False


class OtherTool:
    """Another tool's kernel uprobe on the target's libc ``malloc``, on at a random moment
    once our command's int3 or jump is there, off at another (or at ``close``)."""

    def __init__(self, target: Target, rng: random.Random, seconds: float) -> None:
        with open(f"/proc/{target.proc.pid}/maps") as maps:
            libc = next(
                line.split()[5]
                for line in maps
                if "/libc.so" in line and line.split()[2] == "00000000"
            )
        self.addr = support.runtime_address(target.proc.pid, libc, "malloc", dynamic=True)
        self.pid = target.proc.pid
        self.uprobes = support.ForeignUprobes("stress")
        try:
            self.name = self.uprobes.define(
                libc, support.symbol(libc, "malloc", dynamic=True).value
            )
        except BaseException:
            self.uprobes.close()
            raise
        self.wait_on = rng.uniform(0.0, seconds)
        self.wait_off = rng.uniform(0.0, 2 * seconds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _ours_there(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/mem", "rb") as mem:
                mem.seek(self.addr)
                return mem.read(1) in (b"\xcc", b"\xe9")
        except OSError:
            return False

    def _run(self) -> None:
        while not self._ours_there():
            if self.stop.wait(0.005):
                return
        if self.stop.wait(self.wait_on):
            return
        self.uprobes.enable(self.name)
        self.stop.wait(self.wait_off)
        self.uprobes.enable(self.name, False)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.uprobes.close()


def one_round(
    target: Target, rng: random.Random, tally: Tally, verbose: bool, other_tool: bool = True
) -> None:
    runs = CHECKER_RUNS if target.kind == "checker" else PYTHON_RUNS
    command, extra, specs = rng.choice(runs)
    optimized = rng.random() < 0.5
    ending = rng.choice(ENDINGS)
    argv = [*KPROBES, command, "-p", str(target.proc.pid), *extra, *specs]
    if not optimized:
        argv.append("--no-optimize")
    elif command == "trace" and rng.random() < 0.5:
        argv.append("--block")  # threads wait in the detours for the reader (test_block.py)
    seconds = round(rng.uniform(0.2, 2.0), 2)
    if ending == "duration":
        argv += ["-d", str(seconds)]
    elif ending == "max_events":
        if command in ("count",):
            argv += ["-n", str(rng.randint(1, 5000)), "-d", "30"]
        else:
            argv += ["-n", str(rng.randint(1, 5000))]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    other = None
    # Not after a tool was killed in the target: its int3 left at malloc is one the kernel
    # would take for its own (a case of its own: decisions.md, "Our probes are kept out of
    # the kernel's uprobes").
    wants_other = any("malloc" in spec for spec in specs) and rng.random() < 0.5
    if wants_other and other_tool and not target.killed_in:
        with contextlib.suppress(OSError):
            other = OtherTool(target, rng, seconds)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        tool = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        asked = None
        if ending.startswith("SIG"):
            sig = signal.Signals[ending]
            if sig != signal.SIGKILL or rng.random() < 0.7:
                while not is_attached(target.proc.pid, tool.pid) and tool.poll() is None:
                    time.sleep(0.005)
            time.sleep(rng.uniform(0.0, seconds))
            asked = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                tool.send_signal(sig)
        try:
            rc = tool.wait(timeout=300)
        except subprocess.TimeoutExpired:
            tool.kill()
            tool.wait()
            rc = None
        took = 0.0 if asked is None else time.monotonic() - asked  # after a signal
        if other is not None:
            other.close()
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    tally.rounds += 1
    tally.endings[ending] = tally.endings.get(ending, 0) + 1
    tier = ("opt+block" if "--block" in argv else "opt") if optimized else "traps"
    beside = " beside another tool's uprobe" if other is not None else ""
    what = f"{command} {' '.join(specs)} {tier} {ending} on {target.kind}{beside}"
    if verbose:
        print(f"round {tally.rounds}: {what}: rc {rc} in {took:.2f} s", flush=True)
    if target.proc.poll() is not None:
        tally.failures.append(
            f"{what}: the target died (status {target.proc.returncode}): "
            f"{target.err.read_text(errors='replace')[-500:]}"
        )
        return
    if ending == "SIGKILL":
        target.killed_in += 1
        return
    tally.longest_end = max(tally.longest_end, took)
    if rc != 0:
        tally.failures.append(f"{what}: exit status {rc}: {stderr[-800:]}")
        return
    if " hits" not in stderr:
        tally.failures.append(f"{what}: no summary on stderr: {stderr[-800:]}")
    if target.killed_in:
        return  # a dead tool's jumps may stay until a later tool probes their sites
    tally.clean_checks += 1
    left = foreign_bytes(target.proc.pid)
    if left:
        tally.failures.append(f"{what}: bytes of ours left after a clean end: {left[:5]}")
    pages = ours_now(target)
    if len(pages) > ours_allowed():
        said = [line for line in stderr.splitlines() if "stay in process" in line]
        tally.failures.append(f"{what}: mappings of ours left after a clean end: {pages} {said}")


def ours_allowed() -> int:
    """How many mappings of ours may stay in a program after clean endings: a page a thread
    may still return into is kept, marked, and given back by a later clean end
    (docs/decisions.md, "A clean end unmaps our pages"); they must not pile up."""
    return int(os.environ.get("KPROBES_STRESS_PAGES_ALLOWED", "2"))


def finish_target(target: Target, tally: Tally) -> None:
    if target.proc.poll() is None:
        target.proc.send_signal(signal.SIGTERM)
        try:
            target.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            target.proc.kill()
            target.proc.wait()
            tally.failures.append(f"{target.kind} did not end on SIGTERM")
            return
    out = target.out.read_text(errors="replace")
    if target.proc.returncode != 0 or (
        "every call checked" not in out and "every result checked" not in out
    ):
        tally.failures.append(
            f"{target.kind} ended with status {target.proc.returncode}: {out[-300:]} "
            f"{target.err.read_text(errors='replace')[-500:]}"
        )


@contextlib.contextmanager
def cpu_burner(enabled: bool):  # type: ignore[no-untyped-def]
    """Load from another process: one busy loop, at the programs' priority."""
    if not enabled:
        yield
        return
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def stress(seconds: float, seed: int, load: bool, verbose: bool, other_tool: bool = True) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    rounds_per_target = 6
    with tempfile.TemporaryDirectory(prefix="kprobes-stress-") as tmp, cpu_burner(load):
        workdir = Path(tmp)
        serial = 0
        targets: dict[str, Target] = {}
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end and not tally.failures:
                kind = rng.choice(["checker", "checker", "python"])
                target = targets.get(kind)
                if target is None:
                    serial += 1
                    target = targets[kind] = start_target(kind, workdir, serial)
                one_round(target, rng, tally, verbose, other_tool)
                target.rounds += 1
                if target.rounds >= rounds_per_target or target.proc.poll() is not None:
                    finish_target(targets.pop(kind), tally)
        finally:
            for target in targets.values():
                finish_target(target, tally)
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--no-other-tool", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args()
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 32)
    print(f"stress: {opts.seconds:.0f} s, seed {seed}", flush=True)
    tally = stress(opts.seconds, seed, not opts.no_load, opts.verbose, not opts.no_other_tool)
    endings = ", ".join(f"{k} {v}" for k, v in sorted(tally.endings.items()))
    print(
        f"stress: {tally.rounds} rounds ({endings}), "
        f"{tally.clean_checks} clean endings checked byte for byte, longest end after being "
        f"asked {tally.longest_end:.2f} s, {len(tally.failures)} failures"
    )
    for failure in tally.failures:
        print(f"FAILED: {failure}")
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
