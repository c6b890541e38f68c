"""Our tool, through the ``kprobes`` library's public API, one row per out-of-line tier.

| row | site | what the engine should do per hit |
|---|---|---|
| emulate push | ``work_push`` | emulate ``push %rbp``: 1 stop |
| emulate lea | ``work_lea`` | emulate ``lea``: 1 stop |
| colocate | ``work_push`` | emulate push after ``proc.colocate()`` (one CPU for both) |
| boost | ``work_boost`` | run ``imul`` out of line, jmp back: 1 stop |
| boost rip | ``work_rip`` | the same with the rip-relative displacement relocated |
| step | ``work_boost`` + post handler | copy + int3: 2 stops, the second a cheap int3 |
| singlestep | ``work_sys+5`` | hardware single-step of the ``syscall``: the slowest tier |

The plan the engine really chose (``proc.list()[0].plan``) is printed and shown in the table.
The harness runs this module as a separate process (so that it can be pinned)::

    python -m bench.peer_kprobes FUNC OFFSET pre|post PROGRAM [ARGS...]

which prints the program's output, then ``hits=``, ``nhit=`` and ``plan=`` lines. Any failure
(the library not importable yet, a tier it refuses) is one ``error:`` line on stderr and exit
status 3: the harness shows it in the cell and goes on.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench.peer import Outcome, Peer, Row, RunError, hits_from_fields

TIERS: tuple[tuple[str, str, str, int, str], ...] = (
    # key, label, func, offset, handlers
    ("kprobes-push", "kprobes, push site (boosted)", "work_push", 0, "pre"),
    ("kprobes-emulate-lea", "kprobes, emulate (lea)", "work_lea", 0, "pre"),
    ("kprobes-colocate", "kprobes, push site, proc.colocate()", "work_push", 0, "colocate"),
    ("kprobes-boost", "kprobes, boost (imul)", "work_boost", 0, "pre"),
    ("kprobes-boost-rip", "kprobes, boost (rip-relative mov)", "work_rip", 0, "pre"),
    ("kprobes-step", "kprobes, step: copy + int3 (imul, post handler)", "work_boost", 0, "post"),
    ("kprobes-singlestep", "kprobes, hardware single-step (syscall)", "work_sys", 5, "pre"),
)


@dataclass(frozen=True, slots=True)
class KprobesRunner:
    target: str
    func: str
    offset: int
    handlers: str

    def argv(self, calls: int) -> list[str]:
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
        outcome = hits_from_fields(stdout)
        nhit = outcome.info.get("nhit")
        if nhit is not None and nhit != str(outcome.hits):
            raise RunError(f"handler saw {outcome.hits} hits but kp.nhit is {nhit}")
        return outcome


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

    hits = 0

    def pre(p: Any, regs: Any) -> None:
        nonlocal hits
        hits += 1

    def post(p: Any, regs: Any, flags: Any) -> None:
        return None

    with tempfile.TemporaryFile() as out:
        with kprobes.spawn(argv, stdout=out) as proc:
            kp = kprobes.Kprobe(
                symbol=func,
                offset=offset,
                pre_handler=pre,
                post_handler=post if handlers == "post" else None,
            )
            proc.register_kprobe(kp)
            if handlers == "colocate":
                proc.colocate()  # the tool's own answer to CPU placement
            plan = proc.list()[0].plan
            proc.run()
        exit_code = proc.exit_code
        out.seek(0)
        sys.stdout.flush()
        shutil.copyfileobj(out, sys.stdout.buffer)
    sys.stdout.buffer.flush()
    print(f"hits={hits}\nnhit={kp.nhit}\nplan={plan}", flush=True)
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
