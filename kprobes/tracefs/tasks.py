"""Who a recorded thread is: its name (comm) and its process (thread group).

A trace record carries only ``common_pid``, the thread id. The kernel's text output takes the
name from its saved-cmdlines table, which it fills as tasks are scheduled while events are
enabled. We ask /proc first (``/proc/TID/comm``): the table keeps the name of a thread long
gone until another thread with its id is scheduled with events recorded, and read at a new
thread's first event it can still name the one before (a ticker shown as "tree", a program that
had its pid earlier on a busy machine). The table names the threads that are gone. The process
id is not in the record at all: /proc/TID/status has it while the thread lives, so it is looked
up once per thread and cached.

A thread that has already exited cannot be looked up. Where that matters (``Uprobes(pid=)``
keeps one process's events and drops its children's), ``new_task_watcher`` reads the
``task/task_newtask`` records enabled in the same instance: each says which task created
which, and whether as a thread (CLONE_THREAD) or as a new process, in the order it happened.

The decoder asks ``who(tid)`` once per thread and keeps the answer (``known``): the process
and name events show, or False for a thread whose events the target drops. A thread that is
gone and not yet announced may be announced further on in the same batch, by a record on
another CPU's page: its events are made with the pid UNSETTLED and ``settle`` decides them
once the batch is decoded.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable
from typing import Final

from kprobes.errors import ProbeError, TargetError
from kprobes.model import Event
from kprobes.tracefs.control import TraceFs
from kprobes.tracefs.eventformat import EventFormat
from kprobes.tracefs.records import Watcher, WhoEntry
from kprobes.tracefs.session import Session

UNKNOWN_COMM: Final = "<...>"  # what the kernel prints for a thread it has no name for
CLONE_THREAD: Final = 0x00010000
UNSETTLED: Final = -1  # the pid of an event whose thread is decided after its batch
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")


class Tasks:
    """Thread id → comm and thread id → process id, cached for one session."""

    def __init__(self, fs: TraceFs) -> None:
        self.fs = fs
        self.comms: dict[int, str] = {}
        self.tgids: dict[int, int] = {}
        self.known: dict[int, WhoEntry] = {}  # the decoder's cache of who()
        self.unsettled: set[int] = set()
        self.is_announced = False  # task_newtask records are read (new_task_watcher)

    def comm(self, tid: int) -> str:
        comm = self.comms.get(tid)
        if comm is None:
            try:
                with open(f"/proc/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:  # gone: the kernel's table may remember it
                with contextlib.suppress(ProbeError):
                    for line in self.fs.read("saved_cmdlines").splitlines():
                        pid, _, name = line.partition(" ")
                        if pid.isdigit() and int(pid) == tid:
                            comm = name
                comm = comm or UNKNOWN_COMM
            self.comms[tid] = comm
        return comm

    def tgid(self, tid: int) -> int:
        """The process of thread ``tid``; 0 if it is gone and was never announced."""
        tgid = self.tgids.get(tid)
        if tgid is None:
            tgid = 0
            try:
                with open(f"/proc/{tid}/status") as f:
                    for line in f:
                        if line.startswith("Tgid:"):
                            tgid = int(line.split()[1])
                            break
            except (OSError, ValueError):
                tgid = 0
            self.tgids[tid] = tgid
        return tgid

    def who(self, tid: int, accepts: Callable[[int], bool]) -> WhoEntry:
        """(pid, comm) of thread ``tid`` for its events, or False if ``accepts(tgid)`` refuses
        its process; remembered in ``known``, except while it is unsettled."""
        tgid = self.tgid(tid)  # 0 when the thread is gone already
        if tgid == 0 and self.is_announced:
            # Gone, and not announced yet: a task_newtask record further on in this batch
            # may still say whose it was.
            self.unsettled.add(tid)
            return (UNSETTLED, self.comm(tid))
        who: WhoEntry = (tgid or tid, self.comm(tid)) if accepts(tgid) else False
        self.known[tid] = who
        return who

    def settle(self, events: list[Event], accepts: Callable[[int], bool]) -> list[Event]:
        """``events`` with the unsettled ones decided, now that the batch's announcements are
        read: given their process, or dropped."""
        pids = {}
        for tid in self.unsettled:
            tgid = self.tgids.get(tid, 0)  # announced by now, or 0
            who: WhoEntry = (tgid or tid, self.comm(tid)) if accepts(tgid) else False
            self.known[tid] = who
            pids[tid] = who[0] if who else None
        self.unsettled.clear()
        settled = []
        for event in events:
            if event.pid == UNSETTLED:
                pid = pids.get(event.tid)
                if pid is None:
                    continue
                event = event._replace(pid=pid)
            settled.append(event)
        return settled

    def follow(self, session: Session, pid: int) -> dict[int, Watcher]:
        """Make ``session`` record only process ``pid``'s tasks, and the tasks they create.

        ``event-fork`` adds every task a recorded task creates, threads and child processes
        alike, and a task that has exited can no longer be looked up in /proc. So the
        instance also records ``task/task_newtask`` (only for those same tasks): its
        ``clone_flags`` say whether the new task is a thread of ours (CLONE_THREAD) or a new
        process, whose events are then dropped. Returns the watcher of those records, by
        their event id.
        """
        try:
            tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
        except OSError as exc:
            raise TargetError(f"process {pid} is gone: {exc.strerror}", errno=exc.errno) from exc
        for tid in tids:
            self.tgids[int(tid)] = pid
        watchers: dict[int, Watcher] = {}
        if session.exists("events", "task", "task_newtask", "format"):
            fmt = EventFormat.parse(session.read("events", "task", "task_newtask", "format"))
            watchers[fmt.id] = self.new_task_watcher(fmt)
            session.write("events/task/task_newtask/enable", "1")
        if session.exists("options", "event-fork"):
            session.write("options/event-fork", "1")
        session.write("set_event_pid", " ".join(tids))
        return watchers

    def new_task_watcher(self, fmt: EventFormat) -> Callable[[bytes, int], None]:
        """A record handler for ``task_newtask`` (format ``fmt``) that learns new tasks."""
        child_at = fmt.field("pid").offset
        flags_at = fmt.field("clone_flags").offset
        parent_at = fmt.field("common_pid").offset
        tgids, known = self.tgids, self.known
        self.is_announced = True

        def on_new_task(page: bytes, start: int) -> None:
            child = _I32.unpack_from(page, start + child_at)[0]
            flags = _U64.unpack_from(page, start + flags_at)[0]
            parent = _I32.unpack_from(page, start + parent_at)[0]
            tgids[child] = self.tgid(parent) if flags & CLONE_THREAD else child
            known.pop(child, None)  # a thread id used again: what we knew of it is stale

        return on_new_task
