"""The kernel's ring buffer as ``trace_pipe_raw`` hands it out: whole pages, decoded here.

Reading ``trace_pipe`` gives text that the kernel formatted and we would parse back: slow,
lossy (strings with spaces, truncated values) and tied to the print format. The per-CPU
``trace_pipe_raw`` files give the buffer's own pages instead (kernel/trace/ring_buffer.c),
and each read consumes one page::

    page    := u64 timestamp | local_t commit | data[commit]     (layout from header_page)
    commit  := bytes of data used; bit 31 = events were lost before this page,
               bit 30 = their count is stored as a long right after the data
    record  := u32 (type_len:5, time_delta:27) [array...]
               type_len 1..28   data of type_len * 4 bytes follows
               type_len 0       u32 length (data + 4), then the data
               type_len 29      padding: array[0] bytes to skip; time_delta 0 = end of page
               type_len 30      TIME_EXTEND: delta = array[0] << 27 | time_delta
               type_len 31      TIME_STAMP: the absolute time, encoded the same way

A record's time is the page's timestamp plus the deltas of every earlier data and extend
record (padding adds nothing, as in ``rb_update_read_stamp``). The data of a record starts
with the event's common fields (``common_type`` first) and is decoded by ``eventformat``.

The files are opened non-blocking: a read returns a page (possibly partly filled, when the
writer is still on it), EAGAIN when the CPU's buffer is empty, or 0 at a stop. ``poll(2)``
wakes on any data once the instance's ``buffer_percent`` is 0, which the session sets.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections.abc import Iterator
from typing import Final

from kprobes.values import dataclass

PADDING: Final = 29
TIME_EXTEND: Final = 30
TIME_STAMP: Final = 31
MISSED_EVENTS: Final = 1 << 31
MISSED_STORED: Final = 1 << 30
COMMIT_MASK: Final = (1 << 30) - 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TS_MSB: Final = 0xF << 59


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Where the page header's fields are (``events/header_page``)."""

    timestamp_offset: int = 0
    commit_offset: int = 8
    commit_size: int = 8
    data_offset: int = 16
    data_size: int = 4080

    @property
    def page_size(self) -> int:
        return self.data_offset + self.data_size

    @classmethod
    def parse(cls, text: str) -> PageLayout:
        fields = {
            m["name"]: (int(m["offset"]), int(m["size"]))
            for m in re.finditer(
                r"field:\s*[\w ]+?\s(?P<name>\w+);\s*offset:(?P<offset>\d+);\s*size:(?P<size>\d+);",
                text,
            )
        }
        try:
            return cls(
                timestamp_offset=fields["timestamp"][0],
                commit_offset=fields["commit"][0],
                commit_size=fields["commit"][1],
                data_offset=fields["data"][0],
                data_size=fields["data"][1],
            )
        except KeyError as exc:
            raise ValueError(f"header_page lacks the field {exc.args[0]!r}") from None


DEFAULT_LAYOUT: Final = PageLayout()  # the header every kernel since 2.6.31 has


@dataclass(frozen=True, slots=True)
class Record:
    """One data record of a page: its time and where its bytes are."""

    timestamp: int  # nanoseconds of the trace clock
    start: int  # offset of the record's data in the page
    end: int


@dataclass(frozen=True, slots=True)
class PageScan:
    records: list[tuple[int, int, int]]  # (timestamp, start, end), in page order
    lost: int  # events lost before this page (-1: some, count unknown)


def scan_page(page: bytes, layout: PageLayout = DEFAULT_LAYOUT) -> PageScan:
    """Every data record of one page as (timestamp ns, data start, data end)."""
    u32 = _U32.unpack_from
    ts = _U64.unpack_from(page, layout.timestamp_offset)[0]
    fmt = "<Q" if layout.commit_size == 8 else "<I"
    commit = struct.unpack_from(fmt, page, layout.commit_offset)[0]
    size = commit & COMMIT_MASK
    lost = 0
    if commit & MISSED_EVENTS:
        lost = -1
        if commit & MISSED_STORED and layout.data_offset + size + 8 <= len(page):
            lost = _U64.unpack_from(page, layout.data_offset + size)[0]
    pos = layout.data_offset
    end = min(pos + size, len(page))
    records: list[tuple[int, int, int]] = []
    append = records.append
    while pos + 4 <= end:
        header = u32(page, pos)[0]
        type_len = header & 0x1F
        delta = header >> 5
        if type_len == 0:
            length = u32(page, pos + 4)[0]
            ts += delta
            if length < 4:
                break  # corrupt; never produced by the kernel
            append((ts, pos + 8, pos + 4 + length))
            pos += 4 + length
        elif type_len <= 28:
            ts += delta
            append((ts, pos + 4, pos + 4 + type_len * 4))
            pos += 4 + type_len * 4
        elif type_len == PADDING:
            if delta == 0:
                break  # the rest of the page is padding
            pos += 4 + u32(page, pos + 4)[0]
        elif type_len == TIME_EXTEND:
            ts += (u32(page, pos + 4)[0] << 27) | delta
            pos += 8
        else:  # TIME_STAMP
            absolute = (u32(page, pos + 4)[0] << 27) | delta
            ts = absolute | (ts & _TS_MSB)
            pos += 8
    return PageScan(records, lost)


def iter_records(page: bytes, layout: PageLayout = DEFAULT_LAYOUT) -> Iterator[Record]:
    for ts, start, end in scan_page(page, layout).records:
        yield Record(ts, start, end)


class CpuBuffers:
    """The per-CPU ``trace_pipe_raw`` files of one tracefs instance, opened non-blocking."""

    def __init__(self, instance_dir: str, layout: PageLayout) -> None:
        self.layout = layout
        self.fds: dict[int, int] = {}
        per_cpu = os.path.join(instance_dir, "per_cpu")
        cpus = sorted(int(n[3:]) for n in os.listdir(per_cpu) if re.fullmatch(r"cpu\d+", n))
        try:
            for cpu in cpus:
                path = os.path.join(per_cpu, f"cpu{cpu}", "trace_pipe_raw")
                self.fds[cpu] = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def read_pages(self, max_pages: int = 256) -> list[tuple[int, bytes]]:
        """Every page available now on each CPU (at most ``max_pages`` per CPU), as (cpu, page)."""
        size = self.layout.page_size
        pages = []
        for cpu, fd in self.fds.items():
            for _ in range(max_pages):
                try:
                    page = os.read(fd, size)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == 16:  # EBUSY: a splice reader holds the page; try later
                        break
                    raise
                if not page:
                    break
                pages.append((cpu, page))
        return pages

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
