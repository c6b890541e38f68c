"""What a process has mapped: /proc/PID/maps as values, grouped into loaded ELF modules.

A module's load bias is what turns a symbol's link-time address into a runtime address. It is
computed from one file-backed mapping and the PT_LOAD segment that holds the mapping's file
offset, both rounded down to the page as mmap() placed them. Reading the bias from the
dynamic loader's ``r_debug`` list would need ptrace and would miss objects mapped by other
means; maps needs nothing but read access and covers every mapping the kernel knows.

The file behind a mapping is opened through ``/proc/PID/root`` first, so a process in another
mount namespace (a container) resolves against its own files rather than ours with the same
name. A mapping whose file was deleted (a library upgraded under a running program) is read
through ``/proc/PID/map_files``, which still reaches the mapped inode.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Final

from kprobes.errors import TargetError
from kprobes.symbols.elf import ElfImage
from kprobes.values import dataclass, field

_DELETED: Final = " (deleted)"
_PAGE_MASK: Final = ~0xFFF


@dataclass(frozen=True, slots=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str  # "r-xp"
    offset: int  # file offset of ``start``
    dev: str  # "fe:00", major:minor in hex
    inode: int
    path: str  # "" when anonymous; "[heap]", "[vdso]", "... (deleted)" kept as shown

    @property
    def is_file_backed(self) -> bool:
        return self.path.startswith("/") and self.inode != 0

    @property
    def is_deleted(self) -> bool:
        return self.path.endswith(_DELETED)

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end


@dataclass(frozen=True, slots=True)
class Module:
    """One ELF object mapped into a process, with the bias it was loaded at."""

    path: str  # as shown in maps
    bias: int  # runtime address = bias + link-time address (0 for ET_EXEC)
    start: int  # lowest address of its mappings
    end: int  # highest address of its mappings (exclusive)
    mappings: tuple[Mapping, ...]
    image: ElfImage = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        """The file's basename, without a " (deleted)" mark."""
        return os.path.basename(self.path.removesuffix(_DELETED))

    def contains(self, addr: int) -> bool:
        """Whether ``addr`` lies in one of this module's mappings (not merely between them)."""
        return self.start <= addr < self.end and any(m.contains(addr) for m in self.mappings)

    def to_runtime(self, vaddr: int) -> int:
        return self.bias + vaddr

    def to_vaddr(self, addr: int) -> int:
        return addr - self.bias


def _parse_line(line: str) -> Mapping:
    # "start-end perms offset dev inode      path"; the path may itself contain spaces.
    fields = line.split(maxsplit=5)
    start, _, end = fields[0].partition("-")
    return Mapping(
        start=int(start, 16),
        end=int(end, 16),
        perms=fields[1],
        offset=int(fields[2], 16),
        dev=fields[3],
        inode=int(fields[4]),
        path=fields[5].rstrip("\n") if len(fields) > 5 else "",
    )


def read_maps(pid: int) -> list[Mapping]:
    """Every mapping of process ``pid``, in address order."""
    try:
        with open(f"/proc/{pid}/maps") as stream:
            text = stream.read()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise TargetError(f"no process {pid}") from exc
    except OSError as exc:
        raise TargetError(
            f"cannot read the mappings of process {pid}: {exc.strerror}", errno=exc.errno
        ) from exc
    try:
        return [_parse_line(line) for line in text.splitlines() if line]
    except (IndexError, ValueError) as exc:
        raise TargetError(f"unexpected line in /proc/{pid}/maps: {exc}") from exc


def _candidate_files(pid: int, first: Mapping) -> Iterator[str]:
    """The paths through which the file behind ``first`` may be opened, best first."""
    if not first.is_deleted:
        yield f"/proc/{pid}/root{first.path}"
        yield first.path
    yield f"/proc/{pid}/map_files/{first.start:x}-{first.end:x}"


def _open_image(pid: int, first: Mapping) -> ElfImage | None:
    for candidate in _candidate_files(pid, first):
        if not os.path.exists(candidate):
            continue
        try:
            return ElfImage.open(candidate)
        except TargetError as exc:
            if exc.errno == errno.ENOEXEC:
                return None  # read fine, but not x86-64 ELF: another path would say the same
    return None


def _bias(image: ElfImage, mappings: tuple[Mapping, ...]) -> int | None:
    """The load bias, from the lowest mapping that falls in a PT_LOAD segment."""
    if not image.is_dyn:
        return 0
    for mapping in mappings:
        seg = image.segment_for_offset(mapping.offset)
        if seg is None:
            continue
        return mapping.start - (
            (seg.vaddr & _PAGE_MASK) + (mapping.offset - (seg.offset & _PAGE_MASK))
        )
    return None


def _group(maps: list[Mapping]) -> Iterator[tuple[Mapping, ...]]:
    """Group file-backed mappings into loaded objects, in order of their lowest address.

    A file is one object per load: a second mapping at file offset 0 of a path already seen
    starts a new object (the same library loaded twice by dlmopen(), or a program that maps
    its own binary for reading).
    """
    groups: list[list[Mapping]] = []
    current: dict[str, int] = {}  # path -> index in groups
    for mapping in maps:
        if not mapping.is_file_backed:
            continue
        index = current.get(mapping.path)
        if index is not None and mapping.offset == 0 and groups[index][0].offset == 0:
            index = None
        if index is None:
            current[mapping.path] = len(groups)
            groups.append([mapping])
        else:
            groups[index].append(mapping)
    for group in groups:
        yield tuple(group)


def iter_modules(pid: int, maps: list[Mapping] | None = None) -> Iterator[Module]:
    """Every mapped ELF object of process ``pid``; files that are not ELF are skipped."""
    if maps is None:
        maps = read_maps(pid)
    for mappings in _group(maps):
        image = _open_image(pid, mappings[0])
        if image is None:
            continue
        bias = _bias(image, mappings)
        if bias is None:
            continue
        yield Module(
            path=mappings[0].path,
            bias=bias,
            start=min(m.start for m in mappings),
            end=max(m.end for m in mappings),
            mappings=mappings,
            image=image,
        )
