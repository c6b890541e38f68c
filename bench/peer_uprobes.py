"""The kernel's own uprobes, driven through tracefs: the in-kernel figure a ptrace tool faces.

A session writes ``p:kpbench/EVENT PATH:0xOFFSET`` to ``uprobe_events`` (the offset in the file,
from the ELF), enables the event in a private tracefs instance (so the global buffer and other
tools are untouched: the hits are recorded, as a user of the event would have them), and on every
way out disables it, removes the instance and removes the event. Hits are the growth of the
event's line in ``uprobe_profile`` over one run.

The event name carries our pid (``uprobe_profile`` shows event names without their group, so a
name must be unique on the machine) and the target runs directly, with no tool process: pinning
only decides where the program runs.

tracefs control files refuse ``lseek``, and opening ``uprobe_events`` with ``O_TRUNC`` clears every
tool's events: every write here is ``O_WRONLY | O_APPEND``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.elf import find_site
from bench.peer import Outcome, Peer, Row, RunError

TRACEFS = Path("/sys/kernel/tracing")
GROUP = "kpbench"


class TraceFsError(Exception):
    """The kernel refused a tracefs write; the message carries its error_log line."""


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, text.encode())
    except OSError as e:
        raise TraceFsError(f"{path.name} <- {text.strip()!r}: {e.strerror}{_last_error()}") from e
    finally:
        os.close(fd)


def _last_error() -> str:
    try:
        lines = (TRACEFS / "error_log").read_text().strip().splitlines()
    except OSError:
        return ""
    return f" ({lines[-2].strip()} {lines[-1].strip()})" if len(lines) >= 2 else ""


def mount_tracefs() -> str | None:
    """Mount tracefs if it is absent; the reason it is unusable, or None."""
    if (TRACEFS / "uprobe_events").exists():
        return None
    result = subprocess.run(
        ["mount", "-t", "tracefs", "nodev", str(TRACEFS)],
        capture_output=True,
        text=True,
        check=False,
    )
    if (TRACEFS / "uprobe_events").exists():
        return None
    return f"no {TRACEFS}/uprobe_events ({result.stderr.strip() or 'needs root'})"


def profile_hits(path: str, event: str) -> int:
    """The hit count of ``event`` on ``path`` in ``uprobe_profile`` (lines: PATH EVENT HITS)."""
    for line in (TRACEFS / "uprobe_profile").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-2] == event and " ".join(parts[:-2]) == path:
            return int(parts[-1])
    raise RunError(f"{GROUP}/{event} is not in uprobe_profile")


@dataclass(slots=True)
class UprobeRunner:
    target: str
    func: str
    event: str
    last: int = field(default=0)

    def argv(self, calls: int) -> list[str]:
        self.last = profile_hits(self.target, self.event)
        return [self.target, self.func, str(calls)]

    def outcome(self, stdout: str) -> Outcome:
        now = profile_hits(self.target, self.event)
        hits, self.last = now - self.last, now
        return Outcome(hits=hits)


class UprobesPeer(Peer):
    name = "uprobes"

    def rows(self) -> list[Row]:
        return [
            Row(
                peer=self.name,
                key="uprobes-push",
                label="kernel uprobe via tracefs, push site (emulated)",
                func="work_push",
                calls=2_000_000,
                quick_calls=20_000,
            ),
            Row(
                peer=self.name,
                key="uprobes-lea",
                label="kernel uprobe via tracefs, lea site (single-stepped)",
                func="work_lea",
                calls=100_000,
                quick_calls=2_000,
            ),
        ]

    def unavailable(self) -> str | None:
        return mount_tracefs()

    @contextmanager
    def session(self, row: Row) -> Iterator[UprobeRunner]:
        target = os.path.realpath(self.programs.target)
        site = find_site(self.programs.target, row.func, row.offset)
        event = (
            f"{row.func}_{row.offset}_{os.getpid()}" if row.offset else f"{row.func}_{os.getpid()}"
        )
        instance = TRACEFS / "instances" / f"{GROUP}_{os.getpid()}"
        enable = instance / "events" / GROUP / event / "enable"
        # Step 1: the event, then the instance, then enable: undone in reverse below.
        _write(TRACEFS / "uprobe_events", f"p:{GROUP}/{event} {target}:{site.file_offset:#x}\n")
        try:
            instance.mkdir(exist_ok=True)
            try:
                _write(enable, "1")
                try:
                    yield UprobeRunner(target, row.func, event)
                finally:
                    _write(enable, "0")
            finally:
                with contextlib.suppress(FileNotFoundError):
                    instance.rmdir()
        finally:
            try:
                _write(TRACEFS / "uprobe_events", f"-:{GROUP}/{event}\n")
            except TraceFsError as e:
                if not isinstance(e.__cause__, OSError) or e.__cause__.errno != errno.ENOENT:
                    raise
