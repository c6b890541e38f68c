"""Optimized probes (issue 12): ours through the API and the CLI, and the C detour floor.

A jump-optimized probe replaces the breakpoint by a ``jmp`` to a detour in the program, so a
hit costs no trap and no tool: ours are measured against the kernel's uprobe on the same site
(the ``uprobes`` peer, also with 4 threads) and against ``detour_floor.c``, the same detours
written by hand. Every row runs single-threaded and with 4 threads (the target's
``threads=4``: N calls split between 4 threads, timed in the threads' CPU time, the baseline
likewise).

What runs per hit, and what is checked after each run:

- **count**: ``Kprobe(optimize=True)`` with no handler, a ``lock inc`` of the probe's counter;
  ``nhit`` = N.
- **record**: ``Kprobe(optimize=True, async_handler=h, args="i=%di")``, a record in the shared
  ring that the tool hands to ``h`` later; records delivered + dropped = ``nhit`` = N, each
  thread's ``i`` increasing and in range, and summing to 0 + ... + N-1 when none was dropped.
- **trace CLI**: ``kprobes trace -c PROGRAM 'p work_push i=%di'``, the events written to
  /dev/null; the summary's events + dropped = its hits = N.
- **return** (issue 20): ``Kretprobe(optimize=True)``, entry and return in the program (the
  shadow stack, the trampoline, the call timed into the log2 histogram); ``nhit`` (returns)
  = the entry's hits = N, none missed. Beside it: the kernel's uretprobe (``uprobes-r-push``)
  and our trap tier's (``kprobes-r-push``).
- **return record** (issue 20): ``Kretprobe(optimize=True, async_handler=h,
  args="ret=$retval")``, the trampoline writing a record of each return; and the CLI's
  ``kprobes trace 'r work_push ret=$retval'``: records delivered + dropped = N.
- **stacks** (issue 23, item 5): at ``work_deep10``, 10 frames deep, through
  ``SpecTracer`` as ``trace -U --stack-depth 10`` and ``stackcount`` make their probes: a
  record with its stack walked in the program (``record-stack``), beside the same record
  without a stack (``record-big``), and the stack counted in the program by its id
  (``stackcount``, no record); every stack complete and 10 frames long, delivered (or
  counted) + dropped = N.
- **latency CLI**: ``kprobes latency -c PROGRAM work_push``, the histogram timed in the
  program; its count = N.
- **detour floor**: ``detour_floor count``, ``record`` or ``record-cold``, the hand-written
  detours; the counter, or the records walked in the ring (each committed) and their
  arguments' sum.

Ours are optimized or the run fails (a trap would measure another tier). Records carry their
fetch-args alone, one ring slot (the API's carry the registers only with ``with_regs=True``:
three slots). The ring is not read fast enough to keep up with a loop that does nothing else:
the tool hands records to Python at some µs each while the program writes one every few ns,
so the record rows' N is chosen to fit the default ring (32 MiB: 524,288 one-slot records)
and the notes say how many were dropped. A run is therefore the ring's first lap, whose pages
the program faulted in when the probe went in (process/fast/memory.py, ``fault_in_ring``):
as the floor's ``record`` rows, not its ``record-cold`` ones. The harness runs this
module as a separate process (so that it can be pinned)::

    python -m bench.peer_optimized MODE FUNC PROGRAM [ARGS...]

(MODE: count, record, record-big, record-stack, stackcount, ret, ret-record, cli, cli-ret
or latency)

which prints the program's output, then ``hits=`` and the other fields the runner checks; any
failure is one ``error:`` line on stderr and exit status 3.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.peer import Outcome, Peer, Row, RunError, hits_from_fields, target_argv

ARGS = "i=%di"  # work_push's one argument, fetched by every record row
BIG_RING = 128 << 20  # bytes: 2,097,152 one-slot records
# key, label, variant, threads, N, quick N
OURS: tuple[tuple[str, str, str, int, int, int], ...] = (
    ("optimized-count", "kprobes, optimized count (jmp, lock inc)", "count", 1, 20_000_000, 20_000),
    (
        "optimized-count-4t",
        "kprobes, optimized count, 4 threads (CPU time)",
        "count",
        4,
        20_000_000,
        20_000,
    ),
    (
        "optimized-record",
        "kprobes, optimized record (i=%di: 1 slot), async_handler",
        "record",
        1,
        150_000,
        2_000,
    ),
    # The same record over a run long enough to time steadily (2,000,000 calls, ~30 ms),
    # in a 128 MiB ring that holds them all: each record's cost after the first lap's
    # faults (the ring is faulted in when the probe goes in), issue 21's "<= 15 ns".
    (
        "optimized-record-2m",
        "kprobes, optimized record (i=%di: 1 slot), async_handler, 128 MiB ring",
        "record-big",
        1,
        2_000_000,
        2_000,
    ),
    (
        "optimized-record-4t",
        "kprobes, optimized record (i=%di), async_handler, 4 threads (CPU time)",
        "record",
        4,
        150_000,
        2_000,
    ),
    (
        "optimized-trace",
        "kprobes trace 'p work_push i=%di' > /dev/null (CLI: 1-slot record)",
        "cli",
        1,
        500_000,
        2_000,
    ),
    (
        "optimized-trace-4t",
        "kprobes trace 'p work_push i=%di' > /dev/null (CLI), 4 threads (CPU time)",
        "cli",
        4,
        500_000,
        2_000,
    ),
    (
        "optimized-ret",
        "kprobes, optimized kretprobe (shadow stack + trampoline, timed into a histogram)",
        "ret",
        1,
        10_000_000,
        20_000,
    ),
    (
        "optimized-ret-4t",
        "kprobes, optimized kretprobe, 4 threads (CPU time)",
        "ret",
        4,
        10_000_000,
        20_000,
    ),
    (
        "optimized-ret-record",
        "kprobes, optimized kretprobe, async_handler, args='ret=$retval' (a record a return)",
        "ret-record",
        1,
        150_000,
        2_000,
    ),
    (
        "optimized-trace-ret",
        "kprobes trace 'r work_push ret=$retval' > /dev/null (CLI: a record a return)",
        "cli-ret",
        1,
        500_000,
        2_000,
    ),
    ("optimized-latency", "kprobes latency work_push (CLI)", "latency", 1, 10_000_000, 20_000),
    (
        "optimized-latency-4t",
        "kprobes latency work_push (CLI), 4 threads (CPU time)",
        "latency",
        4,
        10_000_000,
        20_000,
    ),
)
# User stacks walked in the program (issue 23, item 5), at work_deep10 (work_push with unwind
# info, called 5 frames below main: a 10-frame stack): the record without a stack, the same
# with its stack (--stack-depth 10: 9 return addresses, a 2-slot record), and the stack
# counted in the program by its stack id (stackcount: no record). As OURS: key, label,
# variant, threads, N, quick N.
STACK_ROWS: tuple[tuple[str, str, str, int, int, int], ...] = (
    (
        "optimized-record-deep10",
        "kprobes, optimized record (i=%di) at work_deep10, no stack, 128 MiB ring",
        "record-big",
        1,
        500_000,
        2_000,
    ),
    (
        "optimized-record-stack10",
        "kprobes, optimized record (i=%di) + its 10-frame user stack walked in the program",
        "record-stack",
        1,
        500_000,
        2_000,
    ),
    (
        "optimized-stackcount10",
        "kprobes stackcount: a 10-frame stack's id counted in the program (no record)",
        "stackcount",
        1,
        2_000_000,
        20_000,
    ),
)
STACK_DEPTH = 10
FLOORS: tuple[tuple[str, str, str, int, int, int], ...] = (
    ("detour-floor-count", "C detour floor, count (lock inc)", "count", 1, 20_000_000, 20_000),
    (
        "detour-floor-count-4t",
        "C detour floor, count, 4 threads (CPU time)",
        "count",
        4,
        20_000_000,
        20_000,
    ),
    ("detour-floor-record", "C detour floor, 64-byte record (rdi)", "record", 1, 2_000_000, 20_000),
    (
        "detour-floor-record-4t",
        "C detour floor, 64-byte record (rdi), 4 threads (CPU time)",
        "record",
        4,
        2_000_000,
        20_000,
    ),
    # The same, its ring's pages faulted in by the hits, as our ring's are on its first lap.
    (
        "detour-floor-record-cold",
        "C detour floor, 64-byte record, ring not faulted in",
        "record-cold",
        1,
        2_000_000,
        20_000,
    ),
    (
        "detour-floor-record-cold-4t",
        "C detour floor, 64-byte record, ring not faulted in, 4 threads (CPU time)",
        "record-cold",
        4,
        2_000_000,
        20_000,
    ),
)
_SUMMARY = re.compile(r"(\d+) events, (\d+) hits, (\d+) missed, (\d+) dropped")


def arg_sum(calls: int) -> int:
    """bench/target.c calls work_push(i) for i = 0 .. N-1, in any number of threads."""
    return calls * (calls - 1) // 2


def _int(info: dict[str, str], name: str) -> int:
    try:
        return int(info[name])
    except (KeyError, ValueError) as e:
        raise RunError(f"no valid {name}= line") from e


def _rows(
    peer: str,
    table: tuple[tuple[str, str, str, int, int, int], ...],
    ours: bool,
    func: str = "work_push",
) -> list[Row]:
    return [
        Row(
            peer=peer,
            key=key,
            label=label,
            func=func,
            calls=calls,
            quick_calls=quick,
            variant=variant,
            ours=ours,
            threads=threads,
        )
        for key, label, variant, threads, calls, quick in table
    ]


@dataclass(slots=True)
class OptimizedRunner:
    target: str
    func: str
    mode: str
    threads: int
    calls: int = field(default=0)

    def argv(self, calls: int) -> list[str]:
        self.calls = calls
        program = target_argv(self.target, self.func, calls, self.threads)
        return [sys.executable, "-m", "bench.peer_optimized", self.mode, self.func, *program]

    def outcome(self, stdout: str) -> Outcome:
        """The hits the tool saw, checked against the probe's own count and the values."""
        outcome = hits_from_fields(stdout)
        info = outcome.info
        nhit = _int(info, "nhit")
        if self.mode in ("count", "ret", "latency"):
            if nhit != outcome.hits:
                raise RunError(f"hits={outcome.hits} but nhit={nhit}")
            return outcome
        delivered, dropped = _int(info, "delivered"), _int(info, "dropped")
        if delivered + dropped != outcome.hits or nhit != outcome.hits:
            raise RunError(f"{delivered} delivered + {dropped} dropped, but {nhit} hits")
        if int(info.get("bad_values", "0")):
            raise RunError(f"{info['bad_values']} values or stacks wrong")
        if self.mode in ("record", "record-big", "record-stack"):
            if int(info.get("bad_values", "0")):
                raise RunError(f"{info['bad_values']} values out of range or out of order")
            if dropped == 0 and _int(info, "arg_sum") != arg_sum(self.calls):
                raise RunError(f"arguments summed to {info['arg_sum']}, not {arg_sum(self.calls)}")
        return outcome


def nest_rows(
    peer: str, prefix: str, label: str, variant: str, calls: tuple[int, int]
) -> list[Row]:
    """The nest 10 / nest 100 rows of a return probe (issue 20): work_nestD recursing D deep,
    every frame a call of the probed site, so a run's returns must be N x D (the kernel's
    uretprobes drop those nested deeper than 64). ``calls``: N for nest 10 and nest 100."""
    return [
        Row(
            peer=peer,
            key=f"{prefix}-nest{depth}",
            label=f"{label}, nest {depth} (work_nest{depth}: {depth} returns a call)",
            func=f"work_nest{depth}",
            calls=n,
            quick_calls=max(1, 2_000 // depth),
            variant=variant,
            ours=peer == "optimized",
            hits_per_call=depth,
        )
        for depth, n in zip((10, 100), calls, strict=True)
    ]


class OptimizedPeer(Peer):
    name = "optimized"

    def rows(self) -> list[Row]:
        nest = nest_rows(
            self.name, "optimized-ret", "kprobes, optimized kretprobe", "ret", (1_000_000, 100_000)
        )
        stacks = _rows(self.name, STACK_ROWS, ours=True, func="work_deep10")
        return _rows(self.name, OURS, ours=True) + nest + stacks

    @contextmanager
    def session(self, row: Row) -> Iterator[OptimizedRunner]:
        yield OptimizedRunner(str(self.programs.target), row.func, row.variant, row.threads)


@dataclass(frozen=True, slots=True)
class DetourFloorRunner:
    program: str
    mode: str
    func: str
    threads: int

    def argv(self, calls: int) -> list[str]:
        program, *args = target_argv(self.program, self.func, calls, self.threads)
        return [program, self.mode, *args]

    def outcome(self, stdout: str) -> Outcome:
        outcome = hits_from_fields(stdout)
        info = outcome.info
        if self.mode.startswith("record"):
            calls = _int(info, "records") + _int(info, "dropped")
            if calls != outcome.hits:
                raise RunError(f"{info['records']} records + {info['dropped']} dropped")
            if info["dropped"] == "0" and _int(info, "arg_sum") != arg_sum(calls):
                raise RunError(f"arguments summed to {info['arg_sum']}, not {arg_sum(calls)}")
        return outcome


class DetourFloorPeer(Peer):
    name = "detour-floor"

    def rows(self) -> list[Row]:
        return _rows(self.name, FLOORS, ours=False)

    @contextmanager
    def session(self, row: Row) -> Iterator[DetourFloorRunner]:
        yield DetourFloorRunner(str(self.programs.detour_floor), row.variant, row.func, row.threads)


# -- the tool's side: python -m bench.peer_optimized MODE FUNC PROGRAM [ARGS...] ------------


def _check_optimized(proc: Any) -> None:
    (entry,) = proc.list()
    if not entry.is_optimized:
        raise RuntimeError(f"not optimized: {entry.why_not_optimized}")


def _pass_output(proc: Any, out: Any) -> None:
    """The program ended well: its output (kept in ``out``) goes to our stdout."""
    if proc.exit_code:
        raise RuntimeError(f"the program exited with status {proc.exit_code}")
    out.seek(0)
    sys.stdout.flush()
    shutil.copyfileobj(out, sys.stdout.buffer)
    sys.stdout.buffer.flush()


def run_api(mode: str, func: str, argv: list[str]) -> list[str]:
    """A count or record probe on ``func`` through the API while ``argv`` runs to its end."""
    import kprobes

    calls = int(argv[2])
    delivered = total = bad = 0
    last: dict[int, int] = {}  # tid -> the last argument its records carried

    def on_hit(p: Any, hit: Any) -> None:
        nonlocal delivered, total, bad
        i = hit.arg("i")
        delivered += 1
        total += i
        if not 0 <= i < calls or i <= last.get(hit.tid, -1):
            bad += 1
        last[hit.tid] = i

    def on_return(p: Any, ev: Any) -> None:
        nonlocal delivered
        delivered += 1

    with tempfile.TemporaryFile() as out:
        with kprobes.spawn(argv, stdout=out) as proc:
            rp: kprobes.Kretprobe | None = None
            if mode in ("ret", "ret-record"):
                handler = on_return if mode == "ret-record" else None
                args = "ret=$retval" if handler else ()
                rp = kprobes.Kretprobe(symbol=func, optimize=True, async_handler=handler, args=args)
                kp = rp.kp
                proc.register_kretprobe(rp)
            elif mode == "count":
                kp = kprobes.Kprobe(symbol=func, optimize=True)
                proc.register_kprobe(kp)
            else:
                if mode == "record-big":
                    proc.ring_size = BIG_RING
                kp = kprobes.Kprobe(symbol=func, optimize=True, async_handler=on_hit, args=ARGS)
                proc.register_kprobe(kp)
            _check_optimized(proc)
            proc.run()
            dropped = proc.dropped
        _pass_output(proc, out)
    if rp is not None:
        if rp.nmissed or rp.nabandoned:
            raise RuntimeError(f"{rp.nmissed} missed, {rp.nabandoned} abandoned")
        if mode == "ret-record":
            return [
                f"hits={delivered + dropped}",
                f"nhit={rp.nhit}",
                f"delivered={delivered}",
                f"dropped={dropped}",
            ]
        return [f"hits={rp.nhit}", f"nhit={kp.nhit}"]
    if mode == "count":
        return [f"hits={kp.nhit}", f"nhit={kp.nhit}"]
    return [
        f"hits={delivered + dropped}",
        f"nhit={kp.nhit}",
        f"delivered={delivered}",
        f"dropped={dropped}",
        f"arg_sum={total}",
        f"bad_values={bad}",
    ]


def run_stacks(mode: str, func: str, argv: list[str]) -> list[str]:
    """A probe on ``func`` taking a 10-frame user stack in the program (``SpecTracer``, as
    ``trace -U`` and ``stackcount`` make it) while ``argv`` runs to its end: a record of each
    hit with its stack (``record-stack``), or each stack's hits counted in the program
    (``stackcount``). Every stack must be complete and 10 frames long."""
    import kprobes
    from kprobes.process.specs import SpecTracer
    from kprobes.spec import parse

    delivered = total = bad = 0

    def good(ev: Any) -> bool:
        stack = ev.stack
        return stack is not None and not stack.stop and len(stack.frames) == STACK_DEPTH

    def on_event(ev: Any) -> None:
        nonlocal delivered, total, bad
        delivered += 1
        total += ev.arg("i") if mode == "record-stack" else 0
        bad += not good(ev)

    def on_count(ev: Any, n: int) -> None:
        nonlocal delivered, bad
        delivered += n
        bad += 0 if good(ev) else n

    counting = mode == "stackcount"
    with tempfile.TemporaryFile() as out:
        with kprobes.spawn(argv, stdout=out) as proc:
            proc.ring_size = BIG_RING
            tracer = SpecTracer(
                proc, on_event, optimize=True, stack_depth=STACK_DEPTH, fast_stacks=True,
                stack_counts=on_count if counting else None, max_stacks=4096 if counting else 0,
            )  # fmt: skip
            (placed,) = tracer.place([parse(f"p {func}" if counting else f"p {func} {ARGS}")])
            _check_optimized(proc)
            proc.run()
            proc.records.read_records()
            dropped = proc.dropped
            tracer.close()
        _pass_output(proc, out)
    lines = [f"hits={delivered + dropped}", f"nhit={placed.hits}", f"delivered={delivered}"]
    lines += [f"dropped={dropped}", f"bad_values={bad}"]
    return lines + ([] if counting else [f"arg_sum={total}"])


def run_cli(func: str, argv: list[str], *, latency: bool = False, ret: bool = False) -> list[str]:
    """``kprobes trace -c 'ARGV' 'p FUNC i=%di'`` (or ``kprobes latency -c 'ARGV' FUNC``) as
    the ``kprobes`` script runs it, its output written to /dev/null. The program's output
    goes to our file descriptor 1 (only Python's ``sys.stdout`` is replaced), its summary is
    read from what it wrote to stderr."""
    from kprobes.cli.main import main as kprobes_main

    if latency:
        command = ["latency", "-c", shlex.join(argv), func]
    else:
        spec = f"r {func} ret=$retval" if ret else f"p {func} {ARGS}"
        command = ["trace", "-c", shlex.join(argv), spec]
    err = io.StringIO()
    with (
        open(os.devnull, "w") as null,
        contextlib.redirect_stdout(null),
        contextlib.redirect_stderr(err),
    ):
        status = kprobes_main(command)
    said = err.getvalue()
    if status != 0:
        raise RuntimeError(f"kprobes {shlex.join(command)}: status {status}: {said.strip()}")
    if "uses a breakpoint" in said:
        raise RuntimeError(f"not optimized: {said.strip()}")
    m = _SUMMARY.search(said)
    if m is None:
        raise RuntimeError(f"no summary in {said!r}")
    events, hits, missed, dropped = (int(g) for g in m.groups())
    if missed:
        raise RuntimeError(f"{missed} hits missed")
    return [f"hits={events + dropped}", f"nhit={hits}", f"delivered={events}", f"dropped={dropped}"]


def main(args: list[str]) -> int:
    mode, func, argv = args[0], args[1], args[2:]
    try:
        if mode in ("cli", "cli-ret", "latency"):
            lines = run_cli(func, argv, latency=mode == "latency", ret=mode == "cli-ret")
        elif mode in ("record-stack", "stackcount"):
            lines = run_stacks(mode, func, argv)
        else:
            lines = run_api(mode, func, argv)
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
