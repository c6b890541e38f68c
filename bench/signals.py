"""``python -m bench.signals``: how a program under a fast SIGALRM timer slows down when probed.

    python -m bench.signals [--calls N] [--periods US,US,...] [--cap SECONDS]

The sysloop case of issue 18: ``tests/programs/signals sysloop N US`` makes N raw ``getppid``
syscalls (``kpt_getppid``) under an ``ITIMER_REAL`` of US microseconds, whose handler counts
the alarms. Probed as in the issue (``kpt_getppid``, a boosted ``mov``, and ``kpt_getppid+5``,
the single-stepped ``syscall``, with a post handler), each call costs three stops. For each
period: the program alone, then probed (the time of ``run()``), the probed time over the probed
time without a timer, the alarms the program handled; then 300,000 calls alone and traced
with no probe hit (one on ``work``, never called): under ptrace every signal is a stop of its
own, so a period shorter than one stop starves a program whatever the probes do. A run still going
after ``--cap`` seconds is stopped and reported as stalled. Every probed run's hits and output
are checked.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import kprobes
from bench.build import BIN, BuildError

SOURCE = Path(__file__).resolve().parent.parent / "tests" / "programs" / "signals.c"
PERIODS = (0, 1000, 500, 300, 200, 100, 50)
TRACED_CALLS = 300_000  # long enough alone (~0.1 s) to meet many signals


@dataclass(frozen=True, slots=True)
class Row:
    period_us: int
    alone_s: float
    probed_s: float | None  # None: still running at the cap
    alarms: int
    traced_s: float | None  # TRACED_CALLS traced, no probe hit: only the signals stop
    traced_alone_s: float  # the same calls alone


def build() -> Path:
    output = BIN / "signals"
    if output.exists() and output.stat().st_mtime >= SOURCE.stat().st_mtime:
        return output
    BIN.mkdir(exist_ok=True)
    cmd = ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(output), str(SOURCE)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"gcc {SOURCE.name} failed:\n{result.stderr}")
    return output


def _alarms(stderr: bytes) -> int:
    m = re.fullmatch(rb"alarms=(\d+)\n", stderr)
    if m is None:
        raise RuntimeError(f"unexpected stderr: {stderr!r}")
    return int(m.group(1))


def alone(exe: Path, calls: int, period_us: int) -> float:
    argv = [str(exe), "sysloop", str(calls), str(period_us)]
    start = time.monotonic()
    subprocess.run(argv, capture_output=True, check=True)
    return time.monotonic() - start


def probed(
    exe: Path, calls: int, period_us: int, cap: float, *, hits: bool = True
) -> tuple[float | None, int]:
    """Seconds of ``run()`` (None if still running at ``cap``) and the alarms handled. Without
    ``hits``, the one probe is on ``work``, which sysloop never calls."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = kprobes.spawn(
                [str(exe), "sysloop", str(calls), str(period_us)], stdout=fo, stderr=fe
            )
        syscall = kprobes.Kprobe(symbol="kpt_getppid", offset=5, post_handler=lambda p, r, f: None)
        entry = kprobes.Kprobe(symbol="kpt_getppid")
        if hits:
            proc.register_kprobes([syscall, entry])
        else:
            proc.register_kprobe(kprobes.Kprobe(symbol="work"))
        start = time.monotonic()
        finished = proc.run(timeout=cap)
        took = time.monotonic() - start
        if not finished:
            _end(proc)
            return None, 0
        if out.read_bytes() != f"sysloop ok={calls} of {calls}\n".encode():
            raise RuntimeError(f"wrong output at {period_us} us: {out.read_bytes()!r}")
        if hits and (syscall.nhit, entry.nhit) != (calls, calls):
            raise RuntimeError(f"hits {syscall.nhit}, {entry.nhit} of {calls}")
        return took, _alarms(err.read_bytes())


def _end(proc: kprobes.Process) -> None:
    """Detach from a stalled run (every byte restored) and kill the program."""
    proc.detach()
    os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(proc.pid, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--periods", default=",".join(map(str, PERIODS)))
    parser.add_argument("--cap", type=float, default=5.0)
    opts = parser.parse_args()
    exe = build()
    rows: list[Row] = []
    for period in (int(p) for p in opts.periods.split(",")):
        took, alarms = probed(exe, opts.calls, period, opts.cap)
        traced, _ = probed(exe, TRACED_CALLS, period, opts.cap, hits=False)
        traced_alone = alone(exe, TRACED_CALLS, period)
        rows.append(Row(period, alone(exe, opts.calls, period), took, alarms, traced, traced_alone))
    base = next((r.probed_s for r in rows if r.period_us == 0), None)
    print(f"sysloop {opts.calls}: kpt_getppid (boost) + kpt_getppid+5 (syscall, post handler)")
    print(
        f"{'period':>8} {'alone':>9} {'probed':>9} {'/ no timer':>10} {'alarms':>7}"
        f" {'no hit: alone':>13} {'traced':>9}"
    )
    for r in rows:
        period = f"{r.period_us} us" if r.period_us else "none"
        if r.probed_s is None:
            probed_s, ratio = f">{opts.cap:g} s", "stalled"
        else:
            probed_s = f"{r.probed_s * 1e3:.0f} ms"
            ratio = f"{r.probed_s / base:.2f}x" if base else "-"
        traced = f">{opts.cap:g} s" if r.traced_s is None else f"{r.traced_s * 1e3:.0f} ms"
        print(
            f"{period:>8} {r.alone_s * 1e3:>6.1f} ms {probed_s:>9} {ratio:>10} {r.alarms:>7}"
            f" {r.traced_alone_s * 1e3:>10.0f} ms {traced:>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
