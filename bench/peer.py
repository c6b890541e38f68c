"""What a peer is: rows to measure, and for each row a runner that builds a command line.

A peer (the C floor, python-ptrace, GDB, the kernel's uprobes, our kprobes) offers one or more
rows: a probe site in the target program plus a way of probing it. For each row the harness opens
the peer's ``session`` (where the uprobes peer registers its event, and removes it on every way
out), then runs the runner's command R times per placement and asks the runner how many hits
the tool saw. Commands are plain argv lists: the harness alone decides pinning (it prefixes
``taskset -c 0``), timeouts and parsing of the target's own ``ns_per_call=`` line.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from bench.build import Programs

_FIELD = re.compile(r"([a-z_]+)=(.*)")


class RunError(Exception):
    """One run of a cell failed: the tool exited badly, timed out, or printed no result."""


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the result table: a peer probing one site of the target one way."""

    peer: str  # the name --only selects
    key: str  # unique, stable: used in the JSON and for ratios
    label: str
    func: str
    offset: int = 0
    calls: int = 10_000  # default N: a run of the slower placement takes ~0.5-2 s
    quick_calls: int = 500
    max_runs: int | None = None  # slow peers run fewer times than --runs
    variant: str = ""  # peer-specific: the floor's mode, our post handler, ...
    ours: bool = False
    threads: int = 1  # >1: the target's threads=T mode (per call of a thread's CPU time)
    hits_per_call: int = 1  # the nest rows: each call of work_nestD is D calls of the site

    @property
    def site(self) -> str:
        return f"{self.func}+{self.offset}" if self.offset else self.func


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the tool reported for one run, besides the target's own timing."""

    hits: int
    info: dict[str, str] = field(default_factory=dict)


class Runner(Protocol):
    def argv(self, calls: int) -> list[str]:
        """The command that runs the target for ``calls`` calls under the tool."""
        ...

    def outcome(self, stdout: str) -> Outcome:
        """Read the tool's hit count (from its output or elsewhere) after one run."""
        ...


class Peer(ABC):
    name: ClassVar[str]

    def __init__(self, programs: Programs) -> None:
        self.programs = programs

    @abstractmethod
    def rows(self) -> list[Row]: ...

    def unavailable(self) -> str | None:
        """Why this peer cannot run on this machine, or None."""
        return None

    @abstractmethod
    @contextmanager
    def session(self, row: Row) -> Iterator[Runner]: ...

    def version(self) -> str:
        return ""


def target_argv(target: str, func: str, calls: int, threads: int = 1) -> list[str]:
    """The bench target's command line: ``calls`` calls of ``func``, from ``threads`` threads
    (then timed per call of a thread's CPU time, not of the wall clock: bench/target.c)."""
    argv = [target, func, str(calls)]
    return argv if threads == 1 else [*argv, f"threads={threads}"]


def parse_fields(stdout: str) -> dict[str, str]:
    """The ``key=value`` lines a tool printed (the target's own timing line excluded)."""
    fields: dict[str, str] = {}
    for line in stdout.splitlines():
        m = _FIELD.fullmatch(line.strip())
        if m and m.group(1) != "ns_per_call":
            fields[m.group(1)] = m.group(2)
    return fields


def hits_from_fields(stdout: str) -> Outcome:
    """The common case: the tool printed ``hits=<n>`` (and maybe other fields) on its own lines."""
    fields = parse_fields(stdout)
    if "hits" not in fields:
        raise RunError("the tool printed no hits= line")
    try:
        hits = int(fields.pop("hits"))
    except ValueError as e:
        raise RunError(f"bad hits= line: {e}") from e
    return Outcome(hits=hits, info=fields)
