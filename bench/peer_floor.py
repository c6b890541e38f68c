"""The C ptrace floor (``floor.c``): what any ptrace tracer pays per hit before its own code.

Two rows on the ``push %rbp`` site: one stop per hit (the push emulated by the tracer) and two
stops per hit (the classic restore / single-step / re-insert loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.elf import find_site
from bench.peer import Outcome, Peer, Row, hits_from_fields


@dataclass(frozen=True, slots=True)
class FloorRunner:
    floor: str
    mode: str
    map_offset: int
    target: str
    func: str

    def argv(self, calls: int) -> list[str]:
        return [self.floor, self.mode, f"{self.map_offset:x}", self.target, self.func, str(calls)]

    def outcome(self, stdout: str) -> Outcome:
        return hits_from_fields(stdout)


class FloorPeer(Peer):
    name = "floor"

    def rows(self) -> list[Row]:
        return [
            Row(
                peer=self.name,
                key="floor-one",
                label="C ptrace floor, one stop (emulated push)",
                func="work_push",
                calls=20_000,
                quick_calls=2_000,
                variant="one",
            ),
            Row(
                peer=self.name,
                key="floor-two",
                label="C ptrace floor, two stops (int3 + single-step)",
                func="work_push",
                calls=10_000,
                quick_calls=1_000,
                variant="two",
            ),
        ]

    @contextmanager
    def session(self, row: Row) -> Iterator[FloorRunner]:
        site = find_site(self.programs.target, row.func, row.offset)
        yield FloorRunner(
            floor=str(self.programs.floor),
            mode=row.variant,
            map_offset=site.map_offset,
            target=str(self.programs.target),
            func=row.func,
        )
