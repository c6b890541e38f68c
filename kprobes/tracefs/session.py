"""One tracing session's footprint in tracefs, and its removal on every way out.

A session owns exactly two kinds of things in tracefs, both named ``kprobes_<pid>`` (with a
``_<n>`` suffix for the second and later sessions of one process):

* an event **group**: every probe line it writes is ``p:kprobes_<pid>/<event> ...``, so its
  events never collide with another tool's and can be found again by name;
* a private **instance** (``instances/kprobes_<pid>``), a ring buffer of its own in which the
  group's events are enabled. The global buffer, its ``tracing_on`` and every other tool's
  instance are left alone; enabling an event only in our instance arms the kernel's probe
  while leaving the event disabled everywhere else.

Removal runs in the reverse order of creation: close the readers, disable the events (by
removing the instance, which disables what is enabled in it), then delete each event of the
group with ``-:GROUP/EVENT`` (the kernel refuses to delete an enabled event with EBUSY).

It runs from ``close()``, from the ``with`` block, from the ``atexit`` hook, and on SIGTERM
and SIGHUP, which are turned into ``SystemExit`` in the main thread while a session is open
(one registry for every target: ``lifetime.py``), so the interpreter unwinds through the
first two. SIGKILL cannot be caught: a later session removes what a killed one left behind
(``remove_stale``), recognising it by the pid in the name being dead.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import itertools
import os
import re
from typing import Final

from kprobes.errors import TraceFsError
from kprobes.tracefs.control import TraceFs, read_file
from kprobes.tracefs.lines import line_names, removal_line

PREFIX: Final = "kprobes"
_NAME = re.compile(rf"^{PREFIX}_(?P<pid>\d+)(?:_\d+)?$")
_EVENT_FILES: Final = ("kprobe_events", "uprobe_events")
_counter = itertools.count(1)


def session_name(pid: int | None = None) -> str:
    """``kprobes_<pid>`` for this process's first session, ``kprobes_<pid>_<n>`` after."""
    pid = os.getpid() if pid is None else pid
    n = next(_counter)
    return f"{PREFIX}_{pid}" if n == 1 else f"{PREFIX}_{pid}_{n}"


def owner_pid(name: str) -> int | None:
    """The pid a session name was made for; None if the name is not a session's."""
    m = _NAME.match(name)
    return int(m["pid"]) if m else None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def iter_group_events(fs: TraceFs, group: str) -> list[tuple[str, str]]:
    """(events file, event name) of every probe event of ``group``."""
    found = []
    for events_file in _EVENT_FILES:
        if not fs.exists(events_file):
            continue
        for line in fs.iter_lines(events_file):
            names = line_names(line)
            if names is not None and names[0] == group:
                found.append((events_file, names[1]))
    return found


def remove_instance(fs: TraceFs, instance: str) -> None:
    path = fs.path("instances", instance)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TraceFsError(
            f"cannot remove the tracefs instance {path}: {exc.strerror}", errno=exc.errno
        ) from exc


def remove_group(fs: TraceFs, group: str) -> list[str]:
    """Delete every event of ``group``; return the ones the kernel kept (and why)."""
    kept = []
    for events_file, event in iter_group_events(fs, group):
        try:
            fs.append_line(events_file, removal_line(group, event), owner=group)
        except TraceFsError as exc:
            if exc.errno != _errno.ENOENT:
                kept.append(f"{group}/{event}: {exc.message}")
    return kept


def remove_stale(fs: TraceFs) -> list[str]:
    """Remove the instances and groups of sessions whose process is dead; return their names.

    Only names of our own pattern whose pid no longer exists are touched: a live session, even
    of another kprobes process, is left alone.
    """
    removed = []
    instances = fs.path("instances")
    names = set(os.listdir(instances)) if os.path.isdir(instances) else set()
    groups = set(os.listdir(fs.path("events"))) if fs.exists("events") else set()
    for name in sorted(names | groups):
        pid = owner_pid(name)
        if pid is None or pid == os.getpid() or _is_alive(pid):
            continue
        with contextlib.suppress(TraceFsError):
            if name in names:
                remove_instance(fs, name)
            if not remove_group(fs, name):
                removed.append(name)
    return removed


def _stats_lost(text: str) -> int:
    """``overrun`` + ``dropped events`` of one ``per_cpu/cpuN/stats`` text."""
    lost = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("overrun", "dropped events") and value.strip().isdigit():
            lost += int(value)
    return lost


def _stats_field(text: str, name: str) -> int:
    """The number after ``name:`` in one ``per_cpu/cpuN/stats`` text (0 if absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name and value.strip().isdigit():
            return int(value)
    return 0


class Session:
    """A group and a private instance, created together and removed together."""

    def __init__(self, fs: TraceFs, *, group: str | None = None, buffer_kb: int = 2048) -> None:
        self.fs = fs
        self.stale_removed = remove_stale(fs)
        self.name = session_name()
        self.group = group or self.name
        # The group must be ours alone: closing deletes every event in it.
        if group is not None and fs.exists("events", group):
            raise TraceFsError(
                f"the event group {group!r} already exists in tracefs (another tool's events, "
                "or a session's that was killed): choose another group name",
                errno=_errno.EEXIST,
            )
        self.instance_dir = fs.path("instances", self.name)
        self._lost_at_close = 0
        # Step 1: the instance, tuned for us: monotonic clock, wake-ups on any data.
        try:
            os.mkdir(self.instance_dir)
        except OSError as exc:
            raise TraceFsError(
                f"cannot create the tracefs instance {self.instance_dir}: {exc.strerror}",
                errno=exc.errno,
            ) from exc
        self.is_open = True
        try:
            self._tune(buffer_kb)
        except BaseException:
            self.close()
            raise

    def _tune(self, buffer_kb: int) -> None:
        clocks = self.read("trace_clock")
        if "mono" in clocks.replace("[", " ").replace("]", " ").split():
            self.write("trace_clock", "mono")
        if self.exists("buffer_percent"):
            self.write("buffer_percent", "0")
        # A full buffer drops the newest events instead of overwriting the oldest, as perf's
        # does: what came first (a followed command's exec record) is never lost, and every
        # event lost is counted in the CPU's ``dropped events`` (``lost_events``).
        if self.exists("options", "overwrite"):
            self.write("options/overwrite", "0")
        self.write("buffer_size_kb", str(buffer_kb))

    # -- the instance's files ------------------------------------------------------------------

    def rel(self, *parts: str) -> str:
        return os.path.join("instances", self.name, *parts)

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.rel(*parts))

    def read(self, *parts: str) -> str:
        return self.fs.read(self.rel(*parts))

    def write(self, relpath: str, text: str) -> None:
        self.fs.write(self.rel(relpath), text)

    def set_event_enabled(self, event: str, value: bool) -> None:
        self.write(f"events/{self.group}/{event}/enable", "1" if value else "0")

    def lost_events(self) -> int:
        """Events the instance's buffer could not keep, every CPU together: the ``overrun``
        (overwritten before they were read) and ``dropped events`` (refused, when the
        buffer does not overwrite) of each ``per_cpu/cpuN/stats``. As perf reports lost
        samples, a count the page headers of ``trace_pipe_raw`` give only in part (a page
        says that events were lost before it, not always how many). After ``close()``,
        the count read just before the instance went."""
        if not self.is_open:
            return self._lost_at_close
        lost = 0
        per_cpu = os.path.join(self.instance_dir, "per_cpu")
        with contextlib.suppress(OSError):
            for cpu in os.listdir(per_cpu):
                with contextlib.suppress(OSError):
                    lost += _stats_lost(read_file(os.path.join(per_cpu, cpu, "stats")))
        return lost

    def unread_events(self) -> int:
        """Events the instance's buffer holds, not read yet (``entries`` of every CPU's
        stats): what a command that ends now leaves unread."""
        if not self.is_open:
            return 0
        entries = 0
        per_cpu = os.path.join(self.instance_dir, "per_cpu")
        with contextlib.suppress(OSError):
            for cpu in os.listdir(per_cpu):
                with contextlib.suppress(OSError):
                    text = read_file(os.path.join(per_cpu, cpu, "stats"))
                    entries += _stats_field(text, "entries")
        return entries

    def trace_clock(self) -> str:
        text = self.read("trace_clock")
        m = re.search(r"\[(\w+)\]", text)
        return m.group(1) if m else "local"

    # -- removal -------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the instance (disabling our events), then every event of the group."""
        if not self.is_open:
            return
        self._lost_at_close = self.lost_events()
        self.is_open = False
        problems = []
        try:
            remove_instance(self.fs, self.name)
        except TraceFsError as exc:
            problems.append(exc.message)
        problems += remove_group(self.fs, self.group)
        if problems:
            raise TraceFsError("; ".join(problems), errno=_errno.EBUSY)
