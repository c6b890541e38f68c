"""``kprobes count`` over thousands of functions: placed in seconds, in short stops.

A glob such as ``'libc:*'`` (about 3,000 functions) used to be placed one probe at a time,
each in a stop of the program that swept every site placed before (the jumps, the program's
counts, the published state): quadratic, and ``'libpython3.11:_Py*'`` (1,105 functions)
held a program for minutes. Now the probes go in batches sized so that each stop of the
program lasts about ``PLACING_STOP``; the program runs between two.

The command runs in this process (``kprobes.cli.main.main``), with the world's stops and the
probes each stop registered recorded on the way. The program, tests/programs/mallocs.c,
mallocs, fills, checks and frees blocks in two threads that never sleep, and says at its end
whether every call it made was right.
"""

from __future__ import annotations

import io
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from test_cli_trace import count_rows

from kprobes.cli import main as cli_main
from kprobes.cli.notes import Progress
from kprobes.process.engine.world import World
from kprobes.process.target import Process

pytestmark = pytest.mark.ptrace

THREADS = 2


@pytest.fixture
def mallocs(popen: Callable[..., Any], build: Callable[[str], Path]) -> Iterator[Any]:
    prog = popen(
        ["nice", "-n", "10", build("mallocs"), THREADS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = support.read_line(prog.stderr.fileno(), timeout=20)
    assert line == f"mallocs {prog.pid} ready\n".encode(), line
    yield prog


def finish(prog: Any) -> None:
    """The program ends by itself, every call it made checked."""
    assert prog.poll() is None, f"the program died: status {prog.returncode}"
    prog.send_signal(signal.SIGUSR1)
    out, err = prog.communicate(timeout=30)
    assert prog.returncode == 0, err.decode()[-2000:]
    lines = [f"thread {t}: every call checked" for t in range(THREADS)]
    assert out.decode() == "\n".join([*lines, f"total: {THREADS} threads stopped"]) + "\n"


class Stops:
    """Each stop of the world: how long it held the program, how many probes it registered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held: list[float] = []
        self.registered: list[int] = []
        self._since = 0.0
        self._count = 0
        stop, resume, register = World.stop, World.resume, Process.register_kprobes

        def stopping(world: World, **kw: bool) -> None:
            if not world.is_stopped:
                self._since, self._count = time.monotonic(), 0
            stop(world, **kw)

        def resuming(world: World) -> None:
            resume(world)
            if not world.is_stopped:
                self.held.append(time.monotonic() - self._since)
                self.registered.append(self._count)

        def registering(proc: Process, kps: Any, *args: Any, **kwargs: Any) -> None:
            self._count += len(kps)
            register(proc, kps, *args, **kwargs)

        monkeypatch.setattr(World, "stop", stopping)
        monkeypatch.setattr(World, "resume", resuming)
        monkeypatch.setattr(Process, "register_kprobes", registering)


def test_every_function_of_libc_is_counted_from_short_stops(mallocs, monkeypatch, capsys):
    stops = Stops(monkeypatch)
    code = cli_main.main(["count", "-p", str(mallocs.pid), "-d", "1", "libc:*"])
    out, err = capsys.readouterr()
    assert code == 0, err
    placed = sum(stops.registered)
    assert placed > 1000, err  # libc has ~3,000 functions; a few cannot be probed
    # Many stops, none holding more than a small part of the probes, each of them short
    # (the median: a busy two-CPU machine stretches a few). The size of a batch follows
    # what the stops before it took, so a slower machine places fewer a stop.
    busy = [n for n in stops.registered if n]
    assert len(busy) >= 10, stops.registered
    assert max(busy) <= placed // 4, stops.registered
    assert statistics.median(stops.held) < 1.0, sorted(stops.held)[-10:]
    rows = count_rows(out)
    assert rows.get("malloc", 0) > 0 and rows.get("free", 0) > 0, out
    finish(mallocs)


def test_a_glob_over_the_cap_is_refused_before_anything_is_placed(mallocs, monkeypatch, capsys):
    stops = Stops(monkeypatch)
    code = cli_main.main(["count", "-p", str(mallocs.pid), "--max-probes", "50", "libc:str*"])
    err = capsys.readouterr().err
    assert code == 2
    first = err.splitlines()[0]
    assert first.startswith("kprobes: "), err
    assert first.endswith(
        " functions match, more than --max-probes allows (50); narrow the pattern, or raise "
        f"the cap: --max-probes {first.split()[1]}"
    ), err
    assert int(first.split()[1]) > 50
    assert sum(stops.registered) == 0
    finish(mallocs)


def test_a_terminal_is_told_how_many_probes_are_being_placed(mallocs, monkeypatch, capsys):
    """On a terminal, a status line while a big glob is placed; cleared once it is done."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(Progress, "PERIOD", 0.0)  # the line is refreshed after every probe
    code = cli_main.main(["count", "-p", str(mallocs.pid), "-d", "0.2", "libc:*"])
    assert code == 0, terminal.getvalue()
    shown = terminal.getvalue()
    total = shown.split("placing ")[1].split(" probes")[0] if "placing " in shown else ""
    assert total.replace(",", "").isdigit() and int(total.replace(",", "")) > 1000, shown[:500]
    assert "\r\x1b[K" in shown.split("probes…")[-1], "the status line is cleared"
    finish(mallocs)
