"""The tracefs control files: where tracefs is, how to write to it, and what the kernel said.

Three rules of the kernel's control files shape this module:

* They refuse ``lseek``, so Python's buffered ``open(path, "a")`` (which seeks to the end) fails
  with EINVAL on ``uprobe_events``. Every write here is one ``os.write`` on a descriptor opened
  ``O_WRONLY | O_APPEND``.
* Opening ``kprobe_events`` or ``uprobe_events`` with ``O_TRUNC`` deletes every dynamic event of
  every tool on the system. Nothing here ever truncates them; events are removed one by one
  with ``-:GROUP/EVENT``.
* A refused probe definition fails the write with a bare errno (EINVAL for most grammar
  errors); the explanation goes to ``error_log``, three lines per entry: a timestamp and
  message, the command, and a caret under the offending column. ``TraceFs.append_line``
  reads that entry back and raises ``TraceFsError`` carrying it. The log can only be cleared
  whole, so it is cleared only when every entry in it was caused by this session.

tracefs is looked for at ``/sys/kernel/tracing`` and then at ``/sys/kernel/debug/tracing``; if
neither is mounted it is mounted at the first (debugfs likewise at ``/sys/kernel/debug``, for
the kprobes files of Appendix A).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
import re
from collections.abc import Iterator
from typing import Final

from kprobes.errors import TargetError, TraceFsError
from kprobes.spec.fetchargs import valid_types
from kprobes.values import dataclass

TRACEFS_MOUNTS: Final = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
DEBUGFS_MOUNT: Final = "/sys/kernel/debug"
_COMMAND_PREFIX: Final = "  Command: "
_ENTRY_HEAD = re.compile(r"^\[\s*(?P<ts>[\d.]+)\]\s+(?P<source>[^:]+):\s+error:\s+(?P<msg>.*)$")


@dataclass(frozen=True, slots=True)
class ErrorLogEntry:
    """One entry of tracefs ``error_log``: what the kernel refused, and where."""

    timestamp: float
    source: str  # "trace_kprobe", "trace_uprobe", ...
    message: str  # "Unknown type is specified"
    command: str  # the line as the kernel saw it
    column: int  # 0-based position of the caret in ``command``

    def __str__(self) -> str:
        """The entry as the kernel writes it (``parse_error_log`` reads it back)."""
        return (
            f"[{self.timestamp:12.6f}] {self.source}: error: {self.message}\n"
            f"{_COMMAND_PREFIX}{self.command}\n{' ' * (len(_COMMAND_PREFIX) + self.column)}^"
        )


def parse_error_log(text: str) -> list[ErrorLogEntry]:
    """Every entry of an ``error_log`` text, oldest first."""
    entries: list[ErrorLogEntry] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        head = _ENTRY_HEAD.match(lines[i])
        if head is None or i + 1 >= len(lines) or not lines[i + 1].startswith(_COMMAND_PREFIX):
            i += 1
            continue
        command = lines[i + 1][len(_COMMAND_PREFIX) :]
        column = 0
        if i + 2 < len(lines) and lines[i + 2].strip() == "^":
            column = max(0, lines[i + 2].index("^") - len(_COMMAND_PREFIX))
            i += 1
        entries.append(
            ErrorLogEntry(
                timestamp=float(head["ts"]),
                source=head["source"].strip(),
                message=head["msg"].strip(),
                command=command,
                column=column,
            )
        )
        i += 2
    return entries


def _mount(source: str, target: str, fstype: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), 0, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise TargetError(
            f"{what} needs root: tracefs and debugfs are root-only (run as root)",
            errno=_errno.EPERM,
        )


def find_tracefs(*, mount: bool = True) -> str:
    """The directory where tracefs is mounted, mounting it at /sys/kernel/tracing if needed."""
    for root in TRACEFS_MOUNTS:
        if os.path.exists(os.path.join(root, "README")):
            return root
    if mount:
        try:
            _mount("nodev", TRACEFS_MOUNTS[0], "tracefs")
        except OSError as exc:
            raise TargetError(
                f"tracefs is not mounted and mounting it on {TRACEFS_MOUNTS[0]} failed: "
                f"{exc.strerror} (is this kernel built with CONFIG_TRACING?)",
                errno=exc.errno,
            ) from exc
        if os.path.exists(os.path.join(TRACEFS_MOUNTS[0], "README")):
            return TRACEFS_MOUNTS[0]
    raise TargetError("tracefs is not available on this kernel", errno=_errno.ENOENT)


def find_debugfs(*, mount: bool = True) -> str | None:
    """/sys/kernel/debug with debugfs mounted on it (mounted if needed); None if impossible."""
    if os.path.ismount(DEBUGFS_MOUNT) and os.listdir(DEBUGFS_MOUNT):
        return DEBUGFS_MOUNT
    if mount and os.path.isdir(DEBUGFS_MOUNT):
        try:
            _mount("nodev", DEBUGFS_MOUNT, "debugfs")
        except OSError:
            return None
        return DEBUGFS_MOUNT
    return None


def write_file(path: str, text: str, *, append: bool = True) -> None:
    """One ``os.write`` of ``text``; raises the OSError unchanged (callers translate)."""
    flags = os.O_WRONLY | (os.O_APPEND if append else 0)
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


class TraceFs:
    """One mounted tracefs: reads, appends, and probe definitions with their error_log."""

    def __init__(self, root: str) -> None:
        self.root = root

    @classmethod
    def open(cls) -> TraceFs:
        require_root("tracing through tracefs")
        return cls(find_tracefs())

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def exists(self, *parts: str) -> bool:
        return os.path.exists(self.path(*parts))

    def read(self, *parts: str) -> str:
        path = self.path(*parts)
        try:
            return read_file(path)
        except OSError as exc:
            raise TraceFsError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc

    def write(self, relpath: str, text: str) -> None:
        """Append ``text`` to a control file; failures become TraceFsError."""
        path = self.path(relpath)
        try:
            write_file(path, text)
        except OSError as exc:
            raise TraceFsError(
                f"writing {text.strip()!r} to {path} failed: {exc.strerror}", errno=exc.errno
            ) from exc

    def iter_lines(self, relpath: str) -> Iterator[str]:
        for line in self.read(relpath).splitlines():
            if line and not line.startswith("#"):
                yield line

    # -- probe definitions and the error log -------------------------------------------------

    def append_line(self, events_file: str, line: str, *, owner: str) -> None:
        """Write one definition (or ``-:`` removal) to ``kprobe_events``/``uprobe_events``.

        On refusal raise TraceFsError with the kernel's error_log entry for ``line``: its
        message, the command and the column. ``owner`` (our group name) decides whether the
        log may be cleared afterwards: only when every entry in it is ours.
        """
        path = self.path(events_file)
        try:
            write_file(path, line + "\n")
        except OSError as exc:
            entry = self._take_error(line, owner)
            if entry is None:
                raise TraceFsError(
                    f"the kernel refused {line!r} in {events_file}: {exc.strerror}",
                    errno=exc.errno,
                ) from exc
            hint = ""
            if entry.message == "Unknown type is specified":  # ours accepted it: say theirs
                hint = f"; {valid_types(is_uprobe=events_file == 'uprobe_events')}"
            raise TraceFsError(
                f"{events_file}: {entry.message} (column {entry.column}, at "
                f"{entry.command[entry.column :].split(' ')[0]!r} in {entry.command!r}){hint}",
                errno=exc.errno,
                log_line=str(entry),
            ) from exc

    def error_log(self) -> list[ErrorLogEntry]:
        if not self.exists("error_log"):
            return []
        return parse_error_log(self.read("error_log"))

    def _take_error(self, line: str, owner: str) -> ErrorLogEntry | None:
        entries = self.error_log()
        mine = None
        for entry in reversed(entries):
            if entry.command.strip() == line.strip():
                mine = entry
                break
        if entries and all(owner in e.command for e in entries):
            self.clear_error_log()
        return mine

    def clear_error_log(self) -> None:
        """Empty error_log (the kernel clears it on an O_TRUNC open; it cannot drop one entry)."""
        try:
            fd = os.open(self.path("error_log"), os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
            os.close(fd)
        except OSError:
            pass
