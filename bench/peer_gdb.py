"""GDB with a Python breakpoint whose ``stop()`` counts and returns False (``gdb_script.py``).

GDB lifts the breakpoint, single-steps and re-inserts it on each hit (two stops), and runs the
Python callback in between: the figure a user of a scripted debugger sees.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.peer import Outcome, Peer, Row, hits_from_fields

SCRIPT = Path(__file__).resolve().parent / "gdb_script.py"


@dataclass(frozen=True, slots=True)
class GdbRunner:
    gdb: str
    location: str
    target: str
    func: str

    def argv(self, calls: int) -> list[str]:
        # The location travels in the environment: argv after --args belongs to the program.
        return [
            "env",
            f"KPBENCH_LOCATION={self.location}",
            self.gdb,
            "-batch",
            "-nx",
            "-x",
            str(SCRIPT),
            "--args",
            self.target,
            self.func,
            str(calls),
        ]

    def outcome(self, stdout: str) -> Outcome:
        return hits_from_fields(stdout)


class GdbPeer(Peer):
    name = "gdb"

    def rows(self) -> list[Row]:
        return [
            Row(
                peer=self.name,
                key="gdb",
                label="GDB, Python Breakpoint.stop()",
                func="work_push",
                calls=20_000,
                quick_calls=300,
                max_runs=3,
            )
        ]

    def unavailable(self) -> str | None:
        return None if shutil.which("gdb") else "gdb is not installed"

    def version(self) -> str:
        out = subprocess.run(["gdb", "--version"], capture_output=True, text=True, check=False)
        return out.stdout.splitlines()[0] if out.stdout else "gdb"

    @contextmanager
    def session(self, row: Row) -> Iterator[GdbRunner]:
        # "*" puts the breakpoint on the first instruction rather than after the prologue.
        location = f"*{row.func}" if not row.offset else f"*((char *) {row.func} + {row.offset})"
        gdb = shutil.which("gdb") or "gdb"
        yield GdbRunner(gdb, location, str(self.programs.target), row.func)
