"""Frida 17's Interceptor: an inline hook that runs in the program (``frida_run.py``).

The anchor for the fast tier (issue 12): no trap and no tracer round trip per hit. Two rows,
the handlers Frida users write: ``onEnter`` in JavaScript, and in C through a CModule.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.peer import Outcome, Peer, Row, hits_from_fields
from bench.peer_optimized import nest_rows


@dataclass(frozen=True, slots=True)
class FridaRunner:
    mode: str
    target: str
    func: str

    def argv(self, calls: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "bench.frida_run",
            self.mode,
            self.target,
            self.func,
            str(calls),
        ]

    def outcome(self, stdout: str) -> Outcome:
        return hits_from_fields(stdout)


class FridaPeer(Peer):
    name = "frida"

    def rows(self) -> list[Row]:
        return [
            Row(
                peer=self.name,
                key="frida-js",
                label="Frida 17, JavaScript onEnter (in-process hook)",
                func="work_push",
                calls=200_000,
                quick_calls=2_000,
                variant="js",
            ),
            Row(
                peer=self.name,
                key="frida-cmodule",
                label="Frida 17, CModule onEnter (in-process hook)",
                func="work_push",
                calls=500_000,
                quick_calls=2_000,
                variant="cmodule",
            ),
            # Return probes (issue 20): Frida's onLeave, its own shadow stack, beside the
            # kernel's uretprobe and ours.
            Row(
                peer=self.name,
                key="frida-js-leave",
                label="Frida 17, JavaScript onLeave (in-process hook)",
                func="work_push",
                calls=200_000,
                quick_calls=2_000,
                variant="js-leave",
            ),
            Row(
                peer=self.name,
                key="frida-cmodule-leave",
                label="Frida 17, CModule onLeave (in-process hook)",
                func="work_push",
                calls=500_000,
                quick_calls=2_000,
                variant="cmodule-leave",
            ),
            *nest_rows(
                self.name,
                "frida-cmodule-leave",
                "Frida 17, CModule onLeave",
                "cmodule-leave",
                (100_000, 10_000),
            ),
        ]

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("frida") is None:
            return "the frida wheel is not installed (pip install -e '.[bench]')"
        return None

    def version(self) -> str:
        import frida

        return f"frida {frida.__version__}"

    @contextmanager
    def session(self, row: Row) -> Iterator[FridaRunner]:
        yield FridaRunner(row.variant, str(self.programs.target), row.func)
