"""The pages our probes are on, kept out of the kernel's uprobes: they are made writable.

Another tool that places a uprobe on a file (bpftrace, ``perf probe``, a tracefs uprobe, our
own ``--backend uprobes``) has the kernel write its int3 into every process that maps the
file, over whatever that process holds at the offset. Over a jump of ours, the kernel then
steps the file's first instruction out of line and resumes after it, in the middle of our
jump's displacement (SIGILL, SIGSEGV, a silently wrong register); when the uprobe goes, the
kernel writes the file's first byte back in front of our jump's other four (``41 0b 37 b0 ff``
at ``malloc``). Over an int3 of ours, the kernel takes the hits (it finds its own uprobe at
the address), and when the uprobe goes it writes the file's byte over our int3: our probe is
gone without a word. Nothing tells either side: the kernel keeps no list of other patchers
of user code.

The kernel installs uprobes only in mappings that are not writable (``valid_vma`` in
kernel/events/uprobes.c, on registration and on every mmap or split of a mapping). So before
the first int3 of ours goes into a page of a file's mapping, the program makes that page
``PROT_WRITE`` as well (an injected ``mprotect``, ``cover``, once per page); a uprobe
registered from then on skips the page in this process, and one registered before it already
has its int3 in the code, which the planner and the optimizer see and refuse (plan.py,
jumpopt.py, and the jump's five bytes read again once its pages are covered). At a clean end,
once every byte of ours is back, the pages get their protection back (``uncover``): mapped
from their file again where their bytes are the file's, so that the kernel installs in them
any uprobe registered meanwhile.

The price: while a probe of ours is on a page, another tool's uprobes on that page do not
fire in this process, and the page is writable and executable. A program that may not make
such a page (``MemoryDenyWriteExecute``, ``PR_SET_MDWE``, an LSM) keeps its int3s unshielded
and gets no jump: a uprobe over an int3 takes our hits, but harms nothing. A tool killed with
probes in place leaves their pages writable, which keeps protecting the jumps it left
(docs/decisions.md, "Our probes are kept out of the kernel's uprobes").

Rejected: copying the page into an anonymous mapping (no file, so no uprobe), which takes the
page out of /proc/PID/maps' file mapping for every symbolizer; and watching for a foreign int3
after the fact, which comes after the program has already run into it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Final

from kprobes.errors import TargetError
from kprobes.linux.syscalls import NR_CLOSE, NR_MMAP, NR_MPROTECT, NR_OPENAT
from kprobes.process.engine.tracee import Tracee
from kprobes.process.inject import calls
from kprobes.symbols.maps import Mapping, read_maps

PAGE: Final = 0x1000
PROT_READ: Final = 1
PROT_WRITE: Final = 2
PROT_EXEC: Final = 4

_AT_FDCWD: Final = (1 << 64) - 100
_MAP_PRIVATE: Final = 0x02
_MAP_FIXED: Final = 0x10

Call = Callable[..., int]  # an injected syscall: (nr, *args) → raw rax


def pages_of(addr: int, length: int) -> list[int]:
    """The pages [addr, addr+length) touches."""
    first, last = addr & ~(PAGE - 1), (addr + length - 1) & ~(PAGE - 1)
    return list(range(first, last + PAGE, PAGE))


def prot_of(perms: str) -> int:
    """The PROT_* bits of a /proc/PID/maps ``perms`` field ("r-xp")."""
    return (
        (PROT_READ if perms[0] == "r" else 0)
        | (PROT_WRITE if perms[1] == "w" else 0)
        | (PROT_EXEC if perms[2] == "x" else 0)
    )


def _remap(
    pid: int, m: Mapping, run: list[int], prot: int, call: Call, space: Tracee, sp: int
) -> bool:
    """Map the pages ``run`` (consecutive, in ``m``) from their file again, if their bytes
    are the file's, int3s aside: True if they were."""
    start, size = run[0], len(run) * PAGE
    offset = m.offset + (start - m.start)
    try:
        with open(f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}", "rb") as f:
            f.seek(offset)
            want = f.read(size)
        now = space.read(start, size)
    except (OSError, TargetError):
        return False
    if len(want) != size or any(a != b and b != 0xCC for a, b in zip(want, now, strict=True)):
        return False  # someone else's bytes (a live patch): they stay
    if m.is_deleted:
        return False
    path = calls.scratch_below(sp, len(m.path) + 1)
    space.write(path, m.path.encode() + b"\0")
    fd = call(NR_OPENAT, _AT_FDCWD, path, os.O_RDONLY | os.O_CLOEXEC)
    if fd < 0:
        return False
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
        if st.st_ino != m.inode or f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}" != m.dev:
            return False  # another file by that name now
        return call(NR_MMAP, start, size, prot, _MAP_PRIVATE | _MAP_FIXED, fd, offset) == start
    except OSError:
        return False
    finally:
        call(NR_CLOSE, fd)


def _runs(pages: Iterable[int]) -> list[list[int]]:
    """``pages`` in runs of consecutive pages."""
    runs: list[list[int]] = []
    for page in sorted(pages):
        if runs and runs[-1][-1] + PAGE == page:
            runs[-1].append(page)
        else:
            runs.append([page])
    return runs


def _mapping_at(maps: Iterable[Mapping], addr: int) -> Mapping | None:
    for m in maps:
        if m.start <= addr < m.end:
            return m
    return None


class Shield:
    """The pages of each address space (by pid) made writable, with the protection they had,
    and the reason a program refused it (asked once: it holds for the whole session)."""

    def __init__(self) -> None:
        self._pages: dict[int, dict[int, tuple[int, int]]] = {}  # page → (prot, inode)
        self._refused: dict[int, str] = {}

    def is_covered(self, pid: int, addr: int, length: int) -> bool:
        pages = self._pages.get(pid, {})
        return all(page in pages for page in pages_of(addr, length))

    def refusal(self, pid: int) -> str | None:
        """Why ``pid`` may not have writable code (its first ``mprotect`` failed), or None."""
        return self._refused.get(pid)

    def cover(self, pid: int, addr: int, length: int, call: Call) -> str | None:
        """Make the pages of [addr, addr+length) in process ``pid`` writable through
        ``call``, the program's own ``mprotect``. None when done; else why they cannot be."""
        if pid in self._refused:
            return self._refused[pid]
        pages = self._pages.setdefault(pid, {})
        needed = [page for page in pages_of(addr, length) if page not in pages]
        if not needed:
            return None
        maps = read_maps(pid)
        for page in needed:
            m = _mapping_at(maps, page)
            if m is None:
                return f"the code at {page:#x} is not mapped"
            prot = prot_of(m.perms)
            # A shared mapping ("r-xs", a JIT's memfd) takes no uprobe: nothing to keep off.
            if m.is_file_backed and m.perms[3] == "p" and not prot & PROT_WRITE:
                result = call(NR_MPROTECT, page, PAGE, prot | PROT_WRITE)
                if result < 0:
                    self._refused[pid] = (
                        f"the program may not make its code writable ({os.strerror(-result)}: "
                        "MemoryDenyWriteExecute?), which keeps other tools' kernel uprobes "
                        "off a jump"
                    )
                    return self._refused[pid]
            pages[page] = (prot, m.inode)  # an anonymous page (JIT code) has no uprobes
        return None

    def covered(self, pid: int) -> list[int]:
        return list(self._pages.get(pid, {}))

    def uncover(self, pid: int, pages: Iterable[int], call: Call, space: Tracee, sp: int) -> None:
        """Give ``pages`` of ``pid``, on which nothing of ours is left, the protection they
        had, through ``call`` in ``space`` (a held thread whose stack pointer is ``sp``).

        Pages whose bytes are the file's (int3s aside: a uprobe the kernel put in before the
        page was covered comes back) are mapped again from their file, each run of
        consecutive ones at once (``_remap``): the kernel installs in them every uprobe
        registered while they were covered. Another page gets its protection back by
        ``mprotect``, and a uprobe registered meanwhile stays out of it. Either way the file's
        mapping stays in pieces (a new mapping holds a ``struct file`` of its own, which the
        kernel does not merge with the old one's). A page whose mapping changed since
        (unmapped, mapped again) is left as it is; a failure leaves the page writable, which
        harms nothing."""
        covered = self._pages.get(pid, {})
        maps = read_maps(pid)
        back: dict[tuple[Mapping, int], list[int]] = {}
        for page in pages:
            found = covered.pop(page, None)
            m = _mapping_at(maps, page)
            if found is None or m is None or not m.is_file_backed or found[1] != m.inode:
                continue
            prot = found[0]
            if not prot & PROT_WRITE and prot_of(m.perms) == prot | PROT_WRITE:
                back.setdefault((m, prot), []).append(page)
        for (m, prot), some in back.items():
            for run in _runs(some):
                if not _remap(pid, m, run, prot, call, space, sp):
                    call(NR_MPROTECT, run[0], len(run) * PAGE, prot)

    def forget(self, pid: int | None = None) -> None:
        """The address space was replaced (exec) or released: nothing of ours is in it."""
        if pid is None:
            self._pages.clear()
            self._refused.clear()
        else:
            self._pages.pop(pid, None)
            self._refused.pop(pid, None)
