"""What a bare symbol names on the command line: the command's own file (README, "A probe
point names code in a file"; docs/decisions.md)."""

from __future__ import annotations

import os

from kprobes.spec import ProbeSpec, SymbolLocation
from kprobes.values import replace


def own_file(pid: int) -> str | None:
    """The file a bare symbol names: the executable the process runs now (for ``-c``, the
    command's first image, its ``#!`` interpreter for a script, as the kernel ran it)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    return exe if os.path.isfile(exe) else None  # " (deleted)": left to the process's symbols


def in_own_file(spec: ProbeSpec, exe: str | None) -> ProbeSpec:
    """``work`` as ``EXE:work``, keeping the spec's group and event names.

    A probe point names code in a file, as the kernel's uprobes (which hang on the inode)
    and ``--backend uprobes`` do: a bare symbol is the command's own executable, not whatever
    executable a process of the tree runs later (an exec of another program is not probed
    by it; an exec of the same file is).
    """
    loc = spec.location
    if exe is None or not isinstance(loc, SymbolLocation) or loc.module is not None:
        return spec
    return replace(
        spec,
        location=replace(loc, module=exe),
        group=spec.effective_group,
        event=spec.effective_event,
    )


def in_file(spec: ProbeSpec, path: str) -> ProbeSpec:
    """``work`` as ``PATH:work`` (``-x PATH``), the spec's names as the user gave them: its
    group stays unset (a kernel backend's session puts its events in a group of its own)."""
    loc = spec.location
    if not isinstance(loc, SymbolLocation) or loc.module is not None:
        return spec
    return replace(spec, location=replace(loc, module=path), event=spec.effective_event)
