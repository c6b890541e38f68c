"""``python -m bench.optimized [N]``: an optimized count probe's cost per hit, one run.

Runs the bench target's ``work_push`` loop pinned (``taskset -c 0``) without a probe, then
under ``spawn`` with ``Kprobe(optimize=True)`` (a count: a jump to a detour, no trap), and
prints both ``ns_per_call`` figures, their difference and the hits counted. A stopgap until the
optimized rows join ``python -m bench`` (issue 12).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import kprobes
from bench.build import build_all


def ns_per_call(text: str) -> float:
    m = re.search(r"ns_per_call=([\d.]+)", text)
    if m is None:
        raise SystemExit(f"no ns_per_call= line in {text!r}")
    return float(m.group(1))


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_000
    target = str(build_all().target)
    argv = ["taskset", "-c", "0", target, "work_push", str(calls)]
    base = ns_per_call(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    r, w = os.pipe()
    with os.fdopen(w, "wb") as out:
        proc = kprobes.spawn(argv, stdout=out)
    kp = kprobes.Kprobe(symbol=f"{target}:work_push", optimize=True)
    proc.register_kprobe(kp)
    proc.run()
    with os.fdopen(r, "rb") as got:
        probed = ns_per_call(got.read().decode())
    listed = " ".join(str(e) for e in proc.list())
    print(
        f"unprobed {base:.3f} ns/call, optimized count {probed:.3f} ns/call: "
        f"{probed - base:.3f} ns per hit; hits {kp.nhit} of {calls}; {listed}"
    )


if __name__ == "__main__":
    main()
