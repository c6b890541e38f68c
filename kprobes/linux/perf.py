"""Counting perf events: the kernel counts a trace event's hits, and nobody reads a record.

``count`` on the kernel's backends needs only how many times each probe was hit. Enabled
through ftrace, each hit writes a record into the instance's ring that the tool then reads
and decodes, in Python, to add one: that costs the program more than the probe itself (the
reader competes with it for the CPUs). A perf event in counting mode on the same trace event
(``perf_event_open(PERF_TYPE_TRACEPOINT, config=the event's id)``, no sample period, no ring)
makes the kernel add one to a counter instead, which ``read()`` returns: what ``perf stat -e
probe:work`` does. With a pid, the kernel's uprobe is placed only in that process's memory
(``uprobe_perf_filter``): other processes that run the file do not even trap.

One counter counts one task, or one CPU for every task (``pid=-1``: what the command line
uses). Rejected: counters on a process with ``inherit`` (its threads and children): on this
kernel (6.18) they lost hits of short-lived children now and then (0 to 200 of 3,859 mallocs
of a wrapper script's tree, where the events counted every one), most likely as the uprobe's
per-process filter made the kernel take the breakpoint out of a process it had not yet
counted as one of the event's (``UPROBE_HANDLER_REMOVE``).
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Final

from kprobes.errors import TraceFsError

_NR_PERF_EVENT_OPEN: Final = 298  # x86-64
PERF_TYPE_TRACEPOINT: Final = 2
_ATTR_SIZE: Final = 64  # PERF_ATTR_SIZE_VER0: type .. config1
_FD_CLOEXEC: Final = 1 << 3  # PERF_FLAG_FD_CLOEXEC
_IOC_DISABLE: Final = 0x2401  # PERF_EVENT_IOC_DISABLE

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_ioctl = _libc.ioctl


class Counter:
    """One counting perf event on a trace event (``id`` in its ``events/GROUP/NAME/id``)."""

    def __init__(
        self,
        event_id: int,
        *,
        pid: int = -1,
        cpu: int = -1,
    ) -> None:
        flags = 0
        # type, size, config, sample_period, sample_type, read_format, flags, wakeup_events,
        # bp_type, config1
        attr = ctypes.create_string_buffer(
            struct.pack(
                "<IIQQQQQIIQ", PERF_TYPE_TRACEPOINT, _ATTR_SIZE, event_id, 0, 0, 0, flags, 0, 0, 0
            )
        )
        fd = _syscall(
            ctypes.c_long(_NR_PERF_EVENT_OPEN),
            attr,
            ctypes.c_int(pid),
            ctypes.c_int(cpu),
            ctypes.c_int(-1),
            ctypes.c_ulong(_FD_CLOEXEC),
        )
        if fd < 0:
            err = ctypes.get_errno()
            who = f"process {pid}" if pid >= 0 else f"CPU {cpu}"
            raise TraceFsError(
                f"cannot count trace event {event_id} in {who}: {os.strerror(err)}", errno=err
            )
        self.fd = int(fd)

    def read(self) -> int:
        """The hits so far."""
        return int.from_bytes(os.read(self.fd, 8), "little")

    def disable(self) -> None:
        """Count no more (cheap: the event stays registered until ``close``)."""
        if _ioctl(self.fd, _IOC_DISABLE, 0) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def close(self) -> None:
        """Gone; the last counter of an event costs the kernel an RCU grace period (tens of
        ms) as it unregisters the event's probe, under a lock every such close takes."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
