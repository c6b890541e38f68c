"""Our tool, through the ``kprobes`` library's public API, one row per out-of-line tier.

| row | site | what the engine should do per hit |
|---|---|---|
| emulate push | ``work_push`` | emulate ``push %rbp``: 1 stop |
| emulate lea | ``work_lea`` | emulate ``lea``: 1 stop |
| colocate | ``work_push`` | emulate push after ``proc.colocate()`` (one CPU for both) |
| push, no pin | ``work_push`` | the push row, ``pin_hot_threads=False`` (as before it existed) |
| boost | ``work_boost`` | run ``imul`` out of line, jmp back: 1 stop |
| boost rip | ``work_rip`` | the same with the rip-relative displacement relocated |
| step | ``work_boost`` + post handler | copy + int3: 2 stops, the second a cheap int3 |
| singlestep | ``work_sys+5`` | hardware single-step of the ``syscall``: the slowest tier |
| j | ``work_push`` | jprobe: the entry stop, the argument fetched, the stack mirrored: 1 stop |
| r | ``work_push`` | kretprobe: the entry stop hooks the return, the trampoline: 2 stops |
| kr | ``work_push`` | kprobe + kretprobe on one function: both at the entry stop, 2 stops |
| jr | ``work_push`` | jprobe + kretprobe on one function: 2 stops |

The last four are the Kprobes document's §6 notation (k is the push row); the report sets them
beside the document's 2005 figures and the kernel's uretprobes.

The plan the engine really chose (``proc.list()[0].plan``) is printed and shown in the table,
and so is the number of stops the program made (its voluntary context switches, from
``RUSAGE_CHILDREN`` once it is reaped: every ptrace stop is one, and the start-up adds a handful
to the whole run). The harness runs this module as a separate process (so that it can be
pinned)::

    python -m bench.peer_kprobes FUNC OFFSET VARIANT PROGRAM [ARGS...]

with VARIANT one of pre, post, colocate, nopin, split, split-busy, follow, spin, j, r, kr, jr

(``nopin``: ``pre`` with ``pin_hot_threads=False``; ``split``: ``pre`` with the tool held on
CPU 0 and the program on CPU 1, ``split-busy`` the same with no CPU idle; ``follow`` and
``spin``: rejected ways of waiting; see ``bench/placement.py``), which prints the program's
output, then ``hits=``, ``nhit=``, ``stops=`` and ``plan=`` lines
(with a return probe also ``returns=``, ``rp_nhit=``, ``nmissed=``, ``nabandoned=`` and
``retval_sum=``; with a jprobe ``arg_sum=``). Any failure (the library not importable yet, a
tier it refuses) is one ``error:`` line on stderr and exit status 3: the harness shows it in the
cell and goes on.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.peer import Outcome, Peer, Row, RunError, hits_from_fields

TIERS: tuple[tuple[str, str, str, int, str], ...] = (
    # key, label, func, offset, handlers
    ("kprobes-push", "kprobes, push site (boosted)", "work_push", 0, "pre"),
    ("kprobes-emulate-lea", "kprobes, emulate (lea)", "work_lea", 0, "pre"),
    ("kprobes-colocate", "kprobes, push site, proc.colocate()", "work_push", 0, "colocate"),
    ("kprobes-push-nopin", "kprobes, push site, pin_hot_threads off", "work_push", 0, "nopin"),
    ("kprobes-boost", "kprobes, boost (imul)", "work_boost", 0, "pre"),
    ("kprobes-boost-rip", "kprobes, boost (rip-relative mov)", "work_rip", 0, "pre"),
    ("kprobes-step", "kprobes, step: copy + int3 (imul, post handler)", "work_boost", 0, "post"),
    ("kprobes-singlestep", "kprobes, hardware single-step (syscall)", "work_sys", 5, "pre"),
    # The document's §6 tiers besides k (= kprobes-push), all on the push site.
    ("kprobes-j-push", "kprobes, jprobe (j), push site", "work_push", 0, "j"),
    ("kprobes-r-push", "kprobes, kretprobe (r), push site", "work_push", 0, "r"),
    ("kprobes-kr-push", "kprobes, kprobe + kretprobe (kr), push site", "work_push", 0, "kr"),
    ("kprobes-jr-push", "kprobes, jprobe + kretprobe (jr), push site", "work_push", 0, "jr"),
)
ENTRY_KPROBE = ("pre", "post", "colocate", "nopin", "split", "split-busy", "follow", "spin", "kr")
ENTRY_JPROBE = ("j", "jr")
RETURN_PROBE = ("r", "kr", "jr")


def expected_sums(calls: int) -> tuple[int, int]:
    """(sum of the arguments, sum of the return values) over a run of work_push.

    bench/target.c calls work_push(i) for i = 0 .. N-1, and work_push returns i + 1.
    """
    return calls * (calls - 1) // 2, calls * (calls + 1) // 2


@dataclass(slots=True)
class KprobesRunner:
    target: str
    func: str
    offset: int
    handlers: str
    calls: int = field(default=0)

    def argv(self, calls: int) -> list[str]:
        self.calls = calls
        return [
            sys.executable,
            "-m",
            "bench.peer_kprobes",
            self.func,
            str(self.offset),
            self.handlers,
            self.target,
            self.func,
            str(calls),
        ]

    def outcome(self, stdout: str) -> Outcome:
        """The hit count, checked against the probes' own counters and the values seen.

        With a kprobe or jprobe and a kretprobe on one function, both must count every call:
        the hit count handed to the harness is whichever of the two is not N (or N).
        """
        outcome = hits_from_fields(stdout)
        info = outcome.info
        nhit = info.get("nhit")
        if nhit is not None and nhit != str(outcome.hits):
            raise RunError(f"handler saw {outcome.hits} hits but the probe's nhit is {nhit}")
        counts = [outcome.hits]
        if "returns" in info:
            rp_nhit = info.get("rp_nhit")
            if info["returns"] != rp_nhit:
                raise RunError(
                    f"return handler ran {info['returns']} times but rp.nhit is {rp_nhit}"
                )
            counts.append(int(info["returns"]))
        arg_sum, retval_sum = expected_sums(self.calls)
        if "arg_sum" in info and outcome.hits == self.calls and int(info["arg_sum"]) != arg_sum:
            raise RunError(f"jprobe saw arguments summing to {info['arg_sum']}, not {arg_sum}")
        returns = int(info.get("returns", outcome.hits))
        if "retval_sum" in info and returns == self.calls and int(info["retval_sum"]) != retval_sum:
            raise RunError(f"returns summed to {info['retval_sum']}, not {retval_sum}")
        hits = next((c for c in counts if c != self.calls), self.calls)
        return Outcome(hits=hits, info=info)


class KprobesPeer(Peer):
    name = "kprobes"

    def rows(self) -> list[Row]:
        return [
            Row(
                peer=self.name,
                key=key,
                label=label,
                func=func,
                offset=offset,
                calls=10_000,
                quick_calls=300,
                variant=handlers,
                ours=True,
            )
            for key, label, func, offset, handlers in TIERS
        ]

    def version(self) -> str:
        try:
            from importlib import metadata

            return f"kprobes {metadata.version('kprobes')}"
        except Exception:
            return "kprobes (not installed)"

    @contextmanager
    def session(self, row: Row) -> Iterator[KprobesRunner]:
        yield KprobesRunner(str(self.programs.target), row.func, row.offset, row.variant)


def run(func: str, offset: int, handlers: str, argv: list[str]) -> int:
    """Probe ``func+offset`` with trivial counting handlers while ``argv`` runs to its end."""
    import kprobes
    from bench.placement import busy_cpus, waiting_variant

    entries = returns = arg_sum = retval_sum = 0

    def pre(p: Any, regs: Any) -> None:
        nonlocal entries
        entries += 1

    def post(p: Any, regs: Any, flags: Any) -> None:
        return None

    def entry(i: int) -> None:  # work_push's one argument, fetched by the jprobe
        nonlocal entries, arg_sum
        entries += 1
        arg_sum += i

    def ret(ri: Any, regs: Any) -> None:
        nonlocal returns, retval_sum
        returns += 1
        retval_sum += regs.return_value

    first: Any = None  # the entry probe if there is one, else the return probe
    rp: Any = None
    with tempfile.TemporaryFile() as out:
        pin = handlers not in ("nopin", "follow", "spin", "colocate", "split-busy")
        with kprobes.spawn(argv, stdout=out, pin_hot_threads=pin) as proc:
            if handlers in ENTRY_KPROBE:
                first = kprobes.Kprobe(
                    symbol=func,
                    offset=offset,
                    pre_handler=pre,
                    post_handler=post if handlers == "post" else None,
                )
                proc.register_kprobe(first)
            elif handlers in ENTRY_JPROBE:
                first = kprobes.Jprobe(symbol=func, entry=entry)
                proc.register_jprobe(first)
            if handlers in RETURN_PROBE:
                rp = kprobes.Kretprobe(symbol=func, handler=ret)
                proc.register_kretprobe(rp)
            if first is None and rp is None:
                raise ValueError(f"unknown handlers {handlers!r}")
            if handlers == "colocate":
                proc.colocate()  # everything on one CPU, asked for
            elif handlers.startswith("split"):  # apart: the cost the default avoids
                os.sched_setaffinity(0, {0})
                os.sched_setaffinity(proc.pid, {1})
            plan = proc.list()[0].plan
            waiting = waiting_variant(handlers)  # follow, spin: rejected, measured
            if waiting is not None:
                os.waitpid = waiting  # type: ignore[assignment]
            with busy_cpus([0, 1] if handlers == "split-busy" else []):
                proc.run()
        exit_code = proc.exit_code
        out.seek(0)
        sys.stdout.flush()
        shutil.copyfileobj(out, sys.stdout.buffer)
    # The program is reaped: its voluntary context switches are ours to read, one per stop.
    stops = resource.getrusage(resource.RUSAGE_CHILDREN).ru_nvcsw
    sys.stdout.buffer.flush()
    lines = []
    if first is not None:
        lines += [f"hits={entries}", f"nhit={first.nhit}"]
        if rp is not None:
            lines += [f"returns={returns}", f"rp_nhit={rp.nhit}"]
    else:
        lines += [f"hits={returns}", f"nhit={rp.nhit}"]
    if rp is not None:
        lines += [f"nmissed={rp.nmissed}", f"nabandoned={rp.nabandoned}"]
        lines.append(f"retval_sum={retval_sum}")
    if handlers in ENTRY_JPROBE:
        lines.append(f"arg_sum={arg_sum}")
    lines += [f"stops={stops}", f"plan={plan}"]
    print("\n".join(lines), flush=True)
    return int(exit_code or 0)


def main(args: list[str]) -> int:
    func, offset, handlers, argv = args[0], int(args[1], 0), args[2], args[3:]
    try:
        return run(func, offset, handlers, argv)
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
