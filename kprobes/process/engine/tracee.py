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
import struct

from kprobes.errors import TargetError
from kprobes.linux import procfs, ptrace
from kprobes.process.engine.threads import Thread, ThreadState

_WORD = struct.Struct("<Q")


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
        # Its own among the address spaces of the program's image (0: the main one; each
        # followed fork child a new one): the fast tier's records mix it into thread names.
        self.number = 0
        self.open_memory()

    def open_memory(self) -> None:
        self.close_memory()
        try:
            self.mem_fd = procfs.open_mem(self.pid)
        except OSError as exc:
            raise TargetError(
                f"cannot open the memory of process {self.pid}: {exc}", errno=exc.errno
            ) from exc

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
            raise self._failure("read", size, addr, exc) from exc
        if len(data) != size:
            raise self._failure("read", size, addr, None)
        return data

    def read_word(self, addr: int) -> int:
        """The 64-bit little-endian word at ``addr`` (a return address on every kretprobe hit).

        One pread of /proc/PID/mem: measured cheaper than PTRACE_PEEKDATA or
        process_vm_readv for a single word (docs/decisions.md).
        """
        try:
            data = os.pread(self.mem_fd, 8, addr)
        except OSError as exc:
            raise self._failure("read", 8, addr, exc) from exc
        if len(data) != 8:
            raise self._failure("read", 8, addr, None)
        return int(_WORD.unpack(data)[0])

    def write_word(self, addr: int, value: int) -> None:
        """Write a 64-bit little-endian word at ``addr`` (one pwrite, as ``read_word``)."""
        try:
            written = os.pwrite(self.mem_fd, _WORD.pack(value), addr)
        except OSError as exc:
            raise self._failure("write", 8, addr, exc) from exc
        if written != 8:
            raise self._failure("write", 8, addr, None)

    def _failure(self, verb: str, size: int, addr: int, exc: OSError | None) -> TargetError:
        why = exc.strerror if exc is not None else f"short {verb}"
        code = (exc.errno if exc is not None else None) or errno.EFAULT
        return TargetError(
            f"cannot {verb} {size} bytes at {addr:#x} in process {self.pid}: {why}", errno=code
        )

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
            raise self._failure("write", len(data), addr, exc) from exc
        if written != len(data):
            raise self._failure("write", len(data), addr, None)

    def read_as_program(self, addr: int, size: int) -> bytes:
        """``size`` bytes at ``addr`` as the program itself could read them (protections
        obeyed: what the kernel's fetch-args read); TargetError where it could not."""
        try:
            data = ptrace.process_vm_readv(self.pid, addr, size)
        except OSError as exc:
            raise self._failure("read", size, addr, exc) from exc
        if len(data) != size:
            raise self._failure("read", size, addr, None)
        return data

    def read_string(self, addr: int, max_len: int = 4096, *, as_program: bool = False) -> bytes:
        read = self.read_as_program if as_program else self.read
        out = bytearray()
        while len(out) < max_len:
            want = min(256, max_len - len(out), 4096 - ((addr + len(out)) & 0xFFF))
            chunk = read(addr + len(out), want)
            nul = chunk.find(b"\0")
            if nul >= 0:
                out += chunk[:nul]
                return bytes(out)
            out += chunk
        return bytes(out)

    def __repr__(self) -> str:
        return f"<Tracee {self.pid} {self.kind.value} threads={sorted(self.threads)}>"
