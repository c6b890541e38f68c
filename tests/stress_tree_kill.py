"""Reproduce, by hand, a crash left open: SIGKILL of a tool following a tree with records.

    .venv/bin/python tests/stress_tree_kill.py [--runs N] [--seed S] [SPEC] [-- EXTRA...]

Runs tests/test_following.py's tree (a shell that starts ``plughost libplug.so`` as a child
and then execs it) under ``kprobes trace -p SHELL --follow-forks --pending SPEC`` (default
``p libplug:plug_work x=%di``, a record probe on the fast tier), kills the tool with SIGKILL
20-100 ms after the shell starts its children, and counts the runs where a process of the
tree died ("Segmentation fault" from the shell, or a status that is not 0). Core files go
to each run's directory (``ulimit -c unlimited``); dmesg has the kernel's line.

Seen on 2026-11-27: 3-7 runs in 10 with the default spec, none with ``-- --no-optimize``;
0 of 10 (and 0 of 10 with ``'r libplug:plug_work'``) since the fix (docs/decisions.md, "A
tool killed inside an injection"), which tests/test_following.py now checks at each
injection deterministically. Kept as the random-moment check, by hand (not in ``make test``).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kprobes.process.survival.cleanup import read_state

BIN = Path(__file__).parent / "programs" / "bin"
KPROBES = Path(sys.executable).parent / "kprobes"


def one_run(spec: str, extra: list[str], delay: float) -> str | None:
    """One tree, one SIGKILL ``delay`` seconds after "go": what went wrong, or None."""
    tmp = Path(tempfile.mkdtemp(prefix="tree-kill-"))
    host, plugin = BIN / "plughost", BIN / "libplug.so"
    script = tmp / "tree.sh"
    script.write_text(
        f"#!/bin/sh\nulimit -c unlimited\ncd {tmp}\nread go\n"
        f"{host} {plugin} 300 40 > {tmp}/out.child\nexec {host} {plugin} 300 40\n"
    )
    script.chmod(0o755)
    with open(tmp / "out", "wb") as out:
        prog = subprocess.Popen(
            [str(script)], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.PIPE
        )
    assert prog.stdin is not None and prog.stderr is not None
    argv = [str(KPROBES), "trace", "-p", str(prog.pid), "--follow-forks", "--pending"]
    tool = subprocess.Popen(
        [*argv, *extra, spec], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 10
    while (state := read_state(prog.pid)) is None or not state[1]:
        if time.monotonic() > deadline:
            tool.kill()
            prog.kill()
            return "the probe was never registered"
        time.sleep(0.01)
    prog.stdin.write(b"go\n")
    prog.stdin.flush()
    time.sleep(delay)
    tool.kill()
    tool.wait()
    status = prog.wait(timeout=120)
    said = prog.stderr.read().decode(errors="replace").strip()
    if status != 0 or "Segmentation" in said:
        return f"status {status}: {said[-200:]} (in {tmp})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("spec", nargs="?", default="p libplug:plug_work x=%di")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    bad = 0
    for run in range(args.runs):
        delay = rng.uniform(0.02, 0.1)
        what = one_run(args.spec, args.extra, delay)
        if what is not None:
            bad += 1
            print(f"run {run}, killed after {delay:.3f} s: {what}", flush=True)
    print(f"{bad} of {args.runs} runs harmed a process of the tree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
