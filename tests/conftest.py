"""Fixtures shared by the live tests: test programs built on demand, traced processes that are
always cleaned up, and a per-test deadline so that a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import support

TESTS = Path(__file__).resolve().parent
PROGRAMS = TESTS / "programs"
BIN = PROGRAMS / "bin"
DRIVERS = TESTS / "drivers"
REPO = TESTS.parent

# Seconds a single test may take before the watchdog fails it: a hang detector, not a speed
# check. The longest tests take 20-30 s on an idle 2-vCPU EPYC guest and several times that on
# a loaded one (80-90 s at a load average of 29): ten times the longest, so that a slow or busy
# machine never trips it and a hang still ends.
TEST_DEADLINE = 300

DEBUG = ("-g", "-fno-inline", "-Wall")


@dataclass(frozen=True, slots=True)
class Build:
    """How one program of tests/programs is compiled."""

    source: str
    flags: tuple[str, ...] = ("-O1", *DEBUG)
    libs: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # other builds that must exist first (shared libraries)
    compiler: str = "gcc"


BUILDS: dict[str, Build] = {
    "target": Build("target.c"),
    "target-nopie": Build("target.c", flags=("-O1", *DEBUG, "-no-pie")),
    "passon": Build("passon.c"),
    "checker": Build("checker.c", flags=("-O1", *DEBUG, "-pthread")),
    "ticker": Build("ticker.c"),
    "stamps": Build("stamps.c"),
    "tree": Build("tree.c", flags=("-O1", *DEBUG, "-pthread")),
    "threads": Build("threads.c", flags=("-O1", *DEBUG, "-pthread")),
    "placement": Build("placement.c", flags=("-O1", *DEBUG, "-pthread")),
    "optimized": Build("optimized.c", flags=("-O1", *DEBUG, "-pthread")),
    "records": Build("records.c", flags=("-O1", *DEBUG, "-pthread")),
    "fetchfault": Build("fetchfault.c", flags=("-O1", *DEBUG, "-pthread")),
    "hammer": Build("hammer.c", flags=("-O1", *DEBUG, "-pthread")),
    # -O2 for the jump table; no red zone because hand() pushes in inline asm.
    "fidelity": Build("fidelity.c", flags=("-O2", *DEBUG, "-mno-red-zone")),
    # The same without the jump table, whose indirect jump refuses every jump in hand().
    "fidelity-nojt": Build(
        "fidelity.c", flags=("-O2", *DEBUG, "-mno-red-zone", "-fno-jump-tables")
    ),
    "signals": Build("signals.c"),
    "owntraps": Build("owntraps.c"),
    "selfsignal": Build("selfsignal.c"),
    "blocked": Build("blocked.c"),
    "procs": Build("procs.c"),
    "ifunc": Build("ifunc.c", libs=("-ldl",)),
    "rets": Build("rets.c", flags=("-O1", *DEBUG, "-pthread")),
    "busy": Build("busy.c", flags=("-O1", *DEBUG, "-pthread")),
    "mallocs": Build("mallocs.c", flags=("-O1", *DEBUG, "-pthread")),
    "window": Build("window.c"),
    "nosigaction": Build("nosigaction.c"),
    "churn": Build("churn.c", flags=("-O1", *DEBUG, "-pthread")),
    "allocs": Build("allocs.c", flags=("-O1", *DEBUG, "-pthread")),
    "shy": Build("shy.c"),
    "aliases": Build("aliases.c"),
    "listing": Build("listing.c"),
    "rets_cxx": Build("rets_cxx.cpp", compiler="g++"),
    "coldpad": Build("coldpad.cpp", flags=("-O2", *DEBUG), compiler="g++"),
    "backtrace": Build("backtrace.c"),
    "jprobe": Build("jprobe.c"),
    "jprobe-nodebug": Build("jprobe.c", flags=("-O1", "-fno-inline")),
    "libkpt.so": Build("libkpt.c", flags=("-O1", *DEBUG, "-fPIC", "-shared")),
    "uselib": Build(
        "uselib.c",
        libs=(f"-L{BIN}", "-lkpt", "-Wl,-rpath,$ORIGIN"),
        needs=("libkpt.so",),
    ),
    "libplug.so": Build("libplug.c", flags=("-O1", *DEBUG, "-fPIC", "-shared")),
    "plugged": Build(
        "plugged.c",
        libs=(f"-L{BIN}", "-lplug", "-Wl,-rpath,$ORIGIN"),
        needs=("libplug.so",),
    ),
    "plughost": Build("plughost.c", libs=("-ldl",)),
    # Stacks without frame pointers (tests/test_stacks.py): -O2, rbp an ordinary register.
    "libstk.so": Build("libstk.c", flags=("-O2", "-fomit-frame-pointer", "-fPIC", "-shared")),
    "libaudit_gate.so": Build("libaudit_gate.c", flags=("-O1", *DEBUG, "-fPIC", "-shared")),
    "stacks": Build(
        "stacks.c",
        flags=("-O2", "-fomit-frame-pointer", "-Wall"),
        libs=(f"-L{BIN}", "-lstk", "-Wl,-rpath,$ORIGIN"),
        needs=("libstk.so",),
    ),
    # With frame pointers: what the kernel's userstacktrace (--backend uprobes) follows.
    "stacks-fp": Build(
        "stacks.c",
        flags=("-O2", "-fno-omit-frame-pointer", "-Wall"),
        libs=(f"-L{BIN}", "-lstk", "-Wl,-rpath,$ORIGIN"),
        needs=("libstk.so",),
    ),
    # Unwind rows of several shapes for the compact frame tables (symbols/test_frametable.py).
    "frames": Build("frames.c", flags=("-O2", "-fomit-frame-pointer", "-Wall")),
    "frames-fp": Build("frames.c", flags=("-O2", "-fno-omit-frame-pointer", "-Wall")),
    # The fast tier's stack walker run alone (tests/arch/test_stackwalk.py).
    "walk_harness": Build(
        "walk_harness.c",
        flags=("-O2", "-fomit-frame-pointer", "-Wall", "-pthread"),
        libs=(f"-L{BIN}", "-lstk", "-Wl,-rpath,$ORIGIN"),
        needs=("libstk.so",),
    ),
    # Recursion deeper than a walk's limit (tests/test_fast_stack_records.py).
    "recurse": Build("recurse.c", flags=("-O2", "-fomit-frame-pointer", "-Wall")),
    # The same without unwind tables for its own functions: walks end there, and say so.
    "stacks-nocfi": Build(
        "stacks.c",
        flags=("-O2", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables", "-Wall"),
        libs=(f"-L{BIN}", "-lstk", "-Wl,-rpath,$ORIGIN"),
        needs=("libstk.so",),
    ),
}


def build_program(name: str) -> Path:
    """Compile tests/programs/<source> into tests/programs/bin/<name> unless it is up to date
    (newer than its source, the headers beside it and this file, which holds the flags);
    return its path."""
    spec = BUILDS[name]
    for dep in spec.needs:
        build_program(dep)
    BIN.mkdir(exist_ok=True)
    out = BIN / name
    source = PROGRAMS / spec.source
    headers = [h.stat().st_mtime for h in PROGRAMS.glob("*.h")]
    newest_input = max(source.stat().st_mtime, Path(__file__).stat().st_mtime, *headers)
    with open(BIN / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and out.stat().st_mtime >= newest_input:
            return out
        tmp = out.with_name(f".{name}.{os.getpid()}.tmp")
        cmd = [spec.compiler, *spec.flags, "-o", str(tmp), str(source), *spec.libs]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr}")
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def build() -> Callable[[str], Path]:
    """``build("target")`` → path of the compiled test program."""
    return build_program


class _Deadline(Exception):
    pass


@pytest.fixture(autouse=True)
def deadline(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail (instead of hang) any test that runs longer than TEST_DEADLINE seconds, or the
    seconds of its ``@pytest.mark.deadline(SECONDS)``."""
    marker = request.node.get_closest_marker("deadline")
    seconds = float(marker.args[0]) if marker is not None else TEST_DEADLINE

    def expired(signum: int, frame: Any) -> None:
        raise _Deadline(f"test did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """``spawn(argv, **kwargs)`` = ``kprobes.spawn`` whose process is detached and killed at
    teardown if the test left it running (a failing test must not leave a stopped tracee)."""
    import kprobes

    procs: list[Any] = []

    def _spawn(argv: list[Any], **kwargs: Any) -> Any:
        proc = kprobes.spawn([str(a) for a in argv], **kwargs)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        support.cleanup_proc(proc)


@pytest.fixture
def attach() -> Iterator[Callable[..., Any]]:
    """``attach(pid, **kwargs)`` = ``kprobes.attach`` with the same teardown as ``spawn``
    (except that the process, which the test started, is only detached, not killed)."""
    import kprobes

    procs: list[Any] = []

    def _attach(pid: int, **kwargs: Any) -> Any:
        proc = kprobes.attach(pid, **kwargs)
        procs.append(proc)
        return proc

    yield _attach
    for proc in procs:
        if proc.exit_code is None:
            with contextlib.suppress(Exception):
                proc.detach()


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``subprocess.Popen`` whose processes are killed at teardown if still running."""
    started: list[subprocess.Popen[bytes]] = []

    def _popen(argv: list[Any], **kwargs: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([str(a) for a in argv], **kwargs)
        started.append(p)
        return p

    yield _popen
    for p in started:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
