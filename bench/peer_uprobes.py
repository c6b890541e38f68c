"""The kernel's own uprobes, driven through tracefs: the in-kernel figure a ptrace tool faces.

A session writes ``p:kpbench/EVENT PATH:0xOFFSET`` (an entry probe) or ``r:kpbench/EVENT ...``
(a uretprobe) to ``uprobe_events`` (the offset in the file, from the ELF), enables each event in
a private tracefs instance of its own (so the global buffer and other tools are untouched: the
hits are recorded, as a user of the event would have them), and on every way out disables it,
removes the instance and removes the event, in reverse order. One row puts both kinds on one
function: the kernel's "kr".

Entry hits are the growth of the event's line in ``uprobe_profile`` over one run. That line is
no count of returns: the kernel counts a uretprobe's hits in its entry handler, where the
return is hooked. A uretprobe's hits are therefore the records written to its instance's ring
buffer (``entries`` + ``overrun`` + ``dropped events`` over the CPUs' ``stats``; nothing ever
reads the instance), which is what a user of the event gets, one per return.

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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.elf import find_site
from bench.peer import Outcome, Peer, Row, RunError, target_argv
from bench.peer_optimized import nest_rows

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


_RECORD_STATS = ("entries", "overrun", "dropped events")


def buffer_records(instance: Path) -> int:
    """Every record written to ``instance``'s ring buffer so far, over all CPUs."""
    total = 0
    for stats in (instance / "per_cpu").glob("cpu*/stats"):
        for line in stats.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in _RECORD_STATS:
                total += int(value)
    return total


@dataclass(frozen=True, slots=True)
class Event:
    """One uprobe event of a session: ``kind`` is ``p`` (entry) or ``r`` (return)."""

    kind: str
    name: str
    instance: Path

    def count(self, target: str) -> int:
        """Entries for ``p`` (``uprobe_profile``), returns for ``r`` (records in its instance)."""
        if self.kind == "r":
            return buffer_records(self.instance)
        return profile_hits(target, self.name)


@dataclass(slots=True)
class UprobeRunner:
    target: str
    func: str
    events: tuple[Event, ...]
    threads: int = 1
    calls: int = field(default=0)
    last: dict[str, int] = field(default_factory=dict)

    def argv(self, calls: int) -> list[str]:
        self.calls = calls
        self.last = {e.name: e.count(self.target) for e in self.events}
        return target_argv(self.target, self.func, calls, self.threads)

    def outcome(self, stdout: str) -> Outcome:
        """Each event must count every call: the hits are the first count that is not N (or N)."""
        counts = {e.kind: e.count(self.target) - self.last[e.name] for e in self.events}
        hits = next((c for c in counts.values() if c != self.calls), self.calls)
        if len(counts) == 1:
            return Outcome(hits=hits)
        return Outcome(hits=hits, info={"entries": str(counts["p"]), "returns": str(counts["r"])})


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
                variant="p",
            ),
            Row(
                peer=self.name,
                key="uprobes-push-4t",
                label="kernel uprobe via tracefs, push site, 4 threads (CPU time)",
                func="work_push",
                calls=2_000_000,
                quick_calls=20_000,
                variant="p",
                threads=4,
            ),
            Row(
                peer=self.name,
                key="uprobes-lea",
                label="kernel uprobe via tracefs, lea site (single-stepped)",
                func="work_lea",
                calls=100_000,
                quick_calls=2_000,
                variant="p",
            ),
            # The document's §6 r and kr, in the kernel (k is uprobes-push).
            Row(
                peer=self.name,
                key="uprobes-r-push",
                label="kernel uretprobe via tracefs, push site",
                func="work_push",
                calls=2_000_000,
                quick_calls=20_000,
                variant="r",
            ),
            *nest_rows(
                self.name, "uprobes-r", "kernel uretprobe via tracefs", "r", (50_000, 5_000)
            ),
            Row(
                peer=self.name,
                key="uprobes-kr-push",
                label="kernel uprobe + uretprobe via tracefs, push site",
                func="work_push",
                calls=2_000_000,
                quick_calls=20_000,
                variant="pr",
            ),
        ]

    def unavailable(self) -> str | None:
        return mount_tracefs()

    @contextmanager
    def session(self, row: Row) -> Iterator[UprobeRunner]:
        target = os.path.realpath(self.programs.target)
        site = find_site(self.programs.target, row.func, row.offset)
        where = f"{row.func}_{row.offset}" if row.offset else row.func
        pid = os.getpid()
        events = tuple(
            Event(
                kind=kind,
                name=f"{where}_{pid}" if kind == "p" else f"{where}_ret_{pid}",
                instance=TRACEFS / "instances" / f"{GROUP}_{pid}{'' if kind == 'p' else '_ret'}",
            )
            for kind in row.variant or "p"
        )
        with ExitStack() as undo:
            for event in events:
                # Step 1: the event, then its instance, then enable: undone in reverse.
                spec = f"{event.kind}:{GROUP}/{event.name} {target}:{site.file_offset:#x}\n"
                _write(TRACEFS / "uprobe_events", spec)
                undo.callback(_remove_event, event.name)
                event.instance.mkdir(exist_ok=True)
                undo.callback(_remove_instance, event.instance)
                enable = event.instance / "events" / GROUP / event.name / "enable"
                _write(enable, "1")
                undo.callback(_write, enable, "0")
            yield UprobeRunner(target, row.func, events, row.threads)


def _remove_instance(instance: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        instance.rmdir()


def _remove_event(name: str) -> None:
    try:
        _write(TRACEFS / "uprobe_events", f"-:{GROUP}/{name}\n")
    except TraceFsError as e:
        if not isinstance(e.__cause__, OSError) or e.__cause__.errno != errno.ENOENT:
            raise
