"""Who a recorded thread is (``tasks.py``): asked once per thread by the decoder, and decided
after the batch for a thread that is gone before anything said whose it was."""

from __future__ import annotations

import os
import struct
from typing import Any, cast

from kprobes.model import Event
from kprobes.tracefs.control import TraceFs
from kprobes.tracefs.eventformat import EventFormat
from kprobes.tracefs.tasks import UNSETTLED, Tasks

NEWTASK_FORMAT = """name: task_newtask
ID: 77
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:pid_t pid;\toffset:8;\tsize:4;\tsigned:1;
\tfield:char comm[16];\toffset:12;\tsize:16;\tsigned:0;
\tfield:unsigned long clone_flags;\toffset:32;\tsize:8;\tsigned:0;
\tfield:short oom_score_adj;\toffset:40;\tsize:2;\tsigned:1;

print fmt: "pid=%d comm=%s clone_flags=%lx oom_score_adj=%hd", REC->pid, REC->comm, \
REC->clone_flags, REC->oom_score_adj
"""
GONE = 2**22 + 12345  # above pid_max's default: no such thread
CLONE_THREAD = 0x00010000


class NoCmdlines:
    def read(self, *parts: str) -> str:
        return ""


def tasks() -> Tasks:
    return Tasks(cast(TraceFs, NoCmdlines()))


def event(tid: int, pid: int) -> Event:
    return Event("g", "e", pid, tid, "c", 0, 0.0, 0, "here")


def only(pid: int) -> Any:
    return lambda tgid: tgid == pid


def test_a_live_thread_is_asked_once_and_remembered() -> None:
    t = tasks()
    me = os.getpid()
    assert t.who(me, only(me)) == (me, t.comm(me))
    assert t.known[me] == (me, t.comm(me))
    assert t.who(me, only(me + 1)) is False  # another target's policy: dropped


def test_without_announcements_a_gone_thread_is_decided_at_once() -> None:
    t = tasks()
    assert t.who(GONE, lambda tgid: True) == (GONE, "<...>")
    assert t.who(GONE, only(1)) is False and not t.unsettled


def test_a_gone_thread_waits_for_the_batchs_announcements() -> None:
    t = tasks()
    watcher = t.new_task_watcher(EventFormat.parse(NEWTASK_FORMAT))
    parent = os.getpid()
    assert t.who(GONE, only(parent)) == (UNSETTLED, "<...>")
    assert t.who(GONE + 1, only(parent)) == (UNSETTLED, "<...>")
    assert GONE not in t.known and t.unsettled == {GONE, GONE + 1}
    # Further on in the batch: our process made GONE as a thread (and nothing about GONE+1).
    record = struct.pack("<HBBii16s4xQh", 77, 0, 0, parent, GONE, b"t", CLONE_THREAD, 0)
    watcher(b"\0" * 8 + record, 8)
    events = [event(GONE, UNSETTLED), event(parent, parent), event(GONE + 1, UNSETTLED)]
    assert t.settle(events, only(parent)) == [event(GONE, parent), event(parent, parent)]
    assert t.known[GONE] == (parent, "<...>") and t.known[GONE + 1] is False
    assert not t.unsettled


def test_an_announcement_forgets_what_was_known_of_the_thread_id() -> None:
    t = tasks()
    watcher = t.new_task_watcher(EventFormat.parse(NEWTASK_FORMAT))
    t.known[GONE] = (1, "old")
    record = struct.pack("<HBBii16s4xQh", 77, 0, 0, 1, GONE, b"t", 0, 0)  # a new process
    watcher(record, 0)
    assert GONE not in t.known and t.tgids[GONE] == GONE
