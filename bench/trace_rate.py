"""Events per second through ``kprobes trace`` on our own backend: the fast reader (issue 21).

    python -m bench.trace_rate [--calls N] [--runs R] [--per-event] [--return]
                               [--only text-null,...]
    python -m bench.trace_rate --in-process [--gap NS]

runs ``kprobes trace -c 'bench/bin/target work_push N' 'p work_push i=%di'`` (a tight loop
calling a 5-instruction function, jump-optimized: each call writes a record into the ring)
``R`` times for each output (text and ``--json``, into ``/dev/null`` and into a file), and
prints for each the median over the runs of: the tool's wall time from start to exit, the
events printed per second of it, the events per second of the run proper (the summary's
"in X s": from the probes going live to the end of the reading, which is the formatting of
what the program wrote), and the events dropped (ring full). ``--per-event`` measures the
per-event path instead (``Event`` values and the handlers: what ``trace`` did before the
batch path), by running the command with the batch output turned off. ``--return`` traces
the returns instead, ``'r work_push ret=$retval'``: each call's record is written by the
return trampoline in the program (issue 20) and the line is ``(caller <- work_push)``.

Each run is the command line's ``main()`` in a child interpreter of its own (``--child``),
so that the tool's start-up (imports, spawning, placing the probe) is in the wall time, as
a user sees it.

``--in-process`` measures the decoding and formatting alone, in this process: the decoder
``trace`` generates for ``p work i=%di`` with its text and JSON lines, called on a block of
1,024 packed records 150 ns apart (``--gap NS``: another spacing; the bench's loop calls
every 15-30 ns) (min of 60 passes), ns an event: batch.py's per-event loop, and the columns
(process/fast/columns.py) that ``trace`` takes for such a line.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.build import compile_c

SUMMARY = re.compile(r"(\d+) events, (\d+) hits, (\d+) missed, (\d+) dropped in ([\d.]+) s")
OUTPUTS = ("text-null", "text-file", "json-null", "json-file")


def child(argv: list[str]) -> int:
    """The command line in this interpreter; ``--per-event`` first turns the batch path off."""
    if argv and argv[0] == "--per-event":
        from kprobes.cli import trace_cmd

        trace_cmd.TraceRows.writer = lambda self, layout: None  # type: ignore[method-assign]
        argv = argv[1:]
    from kprobes.cli.main import main

    return main(argv)


def in_process(gap: int = 150) -> None:
    """The batch path's decoding and formatting alone (see the module docstring)."""
    from kprobes.arch.x86_64 import shared_area as sa
    from kprobes.arch.x86_64.capture import CapturePlan, Reg, Value
    from kprobes.output.rows import json_line, text_line
    from kprobes.process.fast.batch import LineFormat, plan_decoder
    from kprobes.process.fast.columns import ColumnFormat
    from kprobes.spec import parse

    n, tid, thread = 1024, 1234, 0x7F00_0000_1000
    plan = CapturePlan()
    plan.add(Value(Reg("rdi")))
    decoder = plan_decoder(parse("p work i=%di"), (lambda _s: 0, lambda _o: 0), plan, 0x5555)
    assert decoder is not None
    layout = decoder.layout("kprobes", "p_work_0", 99, lambda _tid: "target")
    record = struct.Struct("<5Q24x")
    meta = 1 | 1 << sa.META_SLOTS_SHIFT | 1 << sa.META_CPU_SHIFT
    block = memoryview(
        b"".join(
            record.pack(sa.COMMIT_TAG | t + 1, meta, thread, 10**12 + gap * t, t) for t in range(n)
        )
    )
    args = (layout.names, layout.types, layout.plain, layout.comm)
    for name, line in (
        ("text", text_line("p_work_0", *args)),
        ("json", json_line("kprobes/p_work_0", 99, *args)),
    ):
        assert line is not None and line.template is not None
        t = line.template
        as_columns = ColumnFormat(t.line, t.show, t.stamp)
        for path, columns in (("per event", None), ("columns", as_columns)):
            fmt = LineFormat(
                line.expr, line.setup, line.context, line.names, lambda *_: None, "", columns
            )
            decode = decoder.compile(
                fmt, 1, {thread: tid}, lambda _t: 0, lambda t: t / 1e9, layout.comm
            )
            best = float("inf")
            for _ in range(60):
                started = time.perf_counter()
                decode(block, 10**12, 83000e9, 1.0, float("inf"), 0x5555, "work+0x0/0x19")
                best = min(best, time.perf_counter() - started)
            print(f"{name} ({path}): {best / n * 1e9:,.0f} ns an event ({n / best:,.0f}/s)")


SPECS = {False: "p work_push i=%di", True: "r work_push ret=$retval"}


def one_run(
    target: Path, calls: int, output: str, per_event: bool, returns: bool = False
) -> dict[str, float]:
    kind, sink = output.split("-")
    cmd = [sys.executable, "-m", "bench.trace_rate", "--child"]
    cmd += ["--per-event"] if per_event else []
    cmd += ["trace", *(["--json"] if kind == "json" else [])]
    cmd += ["-c", f"{target} work_push {calls}", SPECS[returns]]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.devnull if sink == "null" else os.path.join(tmp, "trace.out")
        with open(path, "w") as out:
            started = time.monotonic()
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, check=True)
            wall = time.monotonic() - started
        lines = 0
        if sink == "file":
            with open(path, "rb") as f:
                lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    m = SUMMARY.search(done.stderr)
    if m is None:
        raise RuntimeError(f"no summary in: {done.stderr}")
    events, hits, _, dropped, seconds = (float(g) for g in m.groups())
    if sink == "file" and lines != events + 1:  # the program's own line, too
        raise RuntimeError(f"{lines} lines for {events:.0f} events")
    if events + dropped != hits or hits != calls:
        raise RuntimeError(f"{events} events + {dropped} dropped, {hits} hits of {calls} calls")
    return {"wall": wall, "events": events, "dropped": dropped, "run": seconds}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--in-process":
        in_process(int(sys.argv[3]) if sys.argv[2:3] == ["--gap"] else 150)
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.trace_rate", description=__doc__)
    p.add_argument("--calls", type=int, default=500_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--per-event", action="store_true")
    p.add_argument("--return", dest="returns", action="store_true")
    p.add_argument("--only", default=",".join(OUTPUTS))
    args = p.parse_args()
    target = compile_c("target")
    path = "per-event" if args.per_event else "batch"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.calls:,} calls of work_push, {args.runs} runs each, median; {path} path")
    print(f"trace {SPECS[args.returns]!r}")
    print(f"load average before: {load}")
    head = ("output", "wall s", "events/s (wall)", "events/s (run)", "dropped")
    print("{:<10} {:>8} {:>16} {:>15} {:>9}".format(*head))
    for output in args.only.split(","):
        runs = [
            one_run(target, args.calls, output, args.per_event, args.returns)
            for _ in range(args.runs)
        ]
        wall = statistics.median(r["wall"] for r in runs)
        rate = statistics.median(r["events"] / r["wall"] for r in runs)
        run_rate = statistics.median(r["events"] / r["run"] for r in runs)
        dropped = statistics.median(r["dropped"] for r in runs)
        print(f"{output:<10} {wall:8.2f} {rate:16,.0f} {run_rate:15,.0f} {dropped:9,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
