"""One traced thread group and its address space.

A probed program is usually one tracee. Fork adds more: a followed child is a tracee with its
own copy of the memory (and of our breakpoints), a vfork or posix_spawn child shares the
parent's memory until it execs, and an unfollowed child is traced only long enough to take
our breakpoints out of its copy before it is released.
"""

from __future__ import annotations

import enum
import errno
import os

from kprobes.errors import TargetError
from kprobes.linux import procfs
from kprobes.process.threads import Thread, ThreadState


class TraceeKind(enum.Enum):
    MAIN = "main"
    FORK = "fork"  # followed child: own memory, probes fire there too
    VFORK = "vfork"  # shares the parent's memory until exec or exit
    RELEASE = "release"  # unfollowed fork child: clean its copy, then detach


class Tracee:
    def __init__(self, pid: int, kind: TraceeKind) -> None:
        self.pid = pid
        self.kind = kind
        self.threads: dict[int, Thread] = {}
        self.mem_fd = -1
        self.exit_code: int | None = None
        # (stack slot, real return address) of the frames the forking thread had hooked:
        # a forked child's copy of the stack holds our trampoline there.
        self.inherited_returns: list[tuple[int, int]] = []
        self.open_memory()

    def open_memory(self) -> None:
        self.close_memory()
        try:
            self.mem_fd = procfs.open_mem(self.pid)
        except OSError as exc:
            raise TargetError(f"cannot open the memory of process {self.pid}: {exc}") from exc

    def close_memory(self) -> None:
        if self.mem_fd >= 0:
            os.close(self.mem_fd)
            self.mem_fd = -1

    @property
    def has_own_memory(self) -> bool:
        return self.kind is not TraceeKind.VFORK

    def add_thread(self, tid: int, state: ThreadState) -> Thread:
        thread = Thread(tid, self, state)
        self.threads[tid] = thread
        return thread

    # -- memory ------------------------------------------------------------------------

    def read(self, addr: int, size: int) -> bytes:
        try:
            data = os.pread(self.mem_fd, size, addr)
        except OSError as exc:
            raise TargetError(
                f"cannot read {size} bytes at {addr:#x} in process {self.pid}: {exc.strerror}",
                errno=exc.errno or errno.EFAULT,
            ) from exc
        if len(data) != size:
            raise TargetError(
                f"cannot read {size} bytes at {addr:#x} in process {self.pid}: short read",
                errno=errno.EFAULT,
            )
        return data

    def read_some(self, addr: int, size: int) -> bytes:
        """Up to ``size`` bytes; fewer where the readable memory ends."""
        out = b""
        while len(out) < size:
            cur = addr + len(out)
            want = min(size - len(out), 0x1000 - (cur & 0xFFF))
            try:
                chunk = os.pread(self.mem_fd, want, cur)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        return out

    def write(self, addr: int, data: bytes) -> None:
        try:
            written = os.pwrite(self.mem_fd, data, addr)
        except OSError as exc:
            raise TargetError(
                f"cannot write {len(data)} bytes at {addr:#x} in process {self.pid}: "
                f"{exc.strerror}",
                errno=exc.errno or errno.EFAULT,
            ) from exc
        if written != len(data):
            raise TargetError(
                f"cannot write {len(data)} bytes at {addr:#x} in process {self.pid}: short write",
                errno=errno.EFAULT,
            )

    def read_string(self, addr: int, max_len: int = 4096) -> bytes:
        out = bytearray()
        while len(out) < max_len:
            want = min(256, max_len - len(out), 4096 - ((addr + len(out)) & 0xFFF))
            chunk = self.read(addr + len(out), want)
            nul = chunk.find(b"\0")
            if nul >= 0:
                out += chunk[:nul]
                return bytes(out)
            out += chunk
        return bytes(out)

    def __repr__(self) -> str:
        return f"<Tracee {self.pid} {self.kind.value} threads={sorted(self.threads)}>"
