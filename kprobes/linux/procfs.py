"""Readers for /proc: tasks, status fields, auxv, and the process memory file.

Memory goes through ``/proc/PID/mem`` with ``pread``/``pwrite``: one syscall for any size, and
writes succeed on read-only text pages (the kernel forces them, as it does for PTRACE_POKE),
so the code we patch can stay mapped without write permission.
"""

from __future__ import annotations

import os
import struct
from typing import Final

AT_ENTRY: Final = 9
YAMA_PTRACE_SCOPE: Final = "/proc/sys/kernel/yama/ptrace_scope"


def list_tasks(pid: int) -> list[int]:
    return sorted(int(name) for name in os.listdir(f"/proc/{pid}/task"))


def read_status(pid: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def caught_signals(pid: int) -> int:
    """SigCgt: the signals the process has a handler for (bit n-1 = signal n); 0 if it is
    gone."""
    try:
        return int(read_status(pid).get("SigCgt", "0"), 16)
    except (OSError, ValueError):
        return 0


def task_state(pid: int, tid: int) -> str:
    """The one-letter state of a task ('t' is a tracing stop), '' if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rindex(")") + 2]


def task_cpu(pid: int, tid: int) -> int:
    """The CPU the task last ran on (field 39 of its stat), -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return -1
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[36]) if len(fields) > 36 else -1


def deliverable_signals(pid: int, tid: int) -> int:
    """Signals queued for the thread itself and not blocked by it (a mask, bit n-1 = signal n).

    A trap raised by the thread's own instruction (int3, a single-step, a fault) is queued
    here until the thread dequeues it; 0 when the thread is gone.
    """
    try:
        with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    pending = blocked = 0
    for line in data.splitlines():
        if line.startswith(b"SigPnd:"):
            pending = int(line[7:], 16)
        elif line.startswith(b"SigBlk:"):
            blocked = int(line[7:], 16)
            break
    return pending & ~blocked


def tgid_of(tid: int) -> int:
    try:
        return int(read_status(tid).get("Tgid", "0"))
    except OSError:
        return 0


def read_auxv(pid: int) -> dict[int, int]:
    with open(f"/proc/{pid}/auxv", "rb") as f:
        data = f.read()
    out: dict[int, int] = {}
    for key, value in struct.iter_unpack("<QQ", data):
        if key == 0:
            break
        out[key] = value
    return out


def exe_path(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/exe")


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def ptrace_scope() -> int | None:
    """``kernel.yama.ptrace_scope`` (0 to 3), or None on a kernel without Yama."""
    try:
        with open(YAMA_PTRACE_SCOPE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def open_mem(pid: int) -> int:
    return os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)


def mem_read(fd: int, addr: int, size: int) -> bytes:
    return os.pread(fd, size, addr)


def mem_write(fd: int, addr: int, data: bytes) -> int:
    return os.pwrite(fd, data, addr)
