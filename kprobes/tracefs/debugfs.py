"""The kernel's own kprobes controls: Appendix A's debugfs files and Appendix B's sysctl.

    /sys/kernel/debug/kprobes/list       every kprobe on the system, with its state
    /sys/kernel/debug/kprobes/enabled    the global arm/disarm knob
    /sys/kernel/debug/kprobes/blacklist  address ranges the kernel refuses to probe
    /proc/sys/debug/kprobes-optimization jump optimization on or off (CONFIG_OPTPROBES)

These are the kernel's, not this session's: ``list()`` shows every tool's probes, and the two
knobs act on every kprobe of the system, as the document says of them. ``KprobesKnobs``
remembers the value each knob had before this session first changed it, so that closing the
session puts it back (a session killed by SIGKILL cannot, and the next one does not guess).

The list's lines, as ``kernel/kprobes.c:report_probe`` prints them::

    ffffffff812b9a20  k  vfs_read+0x0    [FTRACE]
    ffffffffc0a01010  r  foo_open+0x0  foo_mod [DISABLED]
    ffffffff812b9a34  k  vfs_read+0x14    [OPTIMIZED]

The state marks are printed back to back; a probe that is ``[GONE]`` is never also shown
``[DISABLED]``. They map onto ``ProbeListing``: ``is_gone``, ``is_disabled``, and ``plan``
"OPTIMIZED" (a jump instead of int3) or "FTRACE" (riding on the function's ftrace call site),
"" for a plain int3 probe.
"""

from __future__ import annotations

import builtins
import errno as _errno
import os
import re
from typing import Final

from kprobes.errors import TargetError
from kprobes.model import BlacklistEntry, ProbeListing
from kprobes.tracefs.control import find_debugfs, read_file, require_root, write_file

OPTIMIZATION_SYSCTL: Final = "/proc/sys/debug/kprobes-optimization"
_LIST_LINE = re.compile(
    r"^(?P<addr>[0-9a-fA-F]+)\s+(?P<kind>[krj])\s+(?P<where>\S+)\s*(?P<rest>.*)$"
)
_BLACKLIST_LINE = re.compile(r"^0x(?P<start>[0-9a-f]+)-0x(?P<end>[0-9a-f]+)\s+(?P<sym>.*)$")


def parse_list(text: str) -> list[ProbeListing]:
    """Entries of ``kprobes/list``, in the kernel's order."""
    out = []
    for line in text.splitlines():
        m = _LIST_LINE.match(line.strip())
        if m is None:
            continue
        rest = m["rest"]
        marks = set(re.findall(r"\[([A-Z]+)\]", rest))
        module = re.sub(r"\[[A-Z]+\]", "", rest).strip()
        plan = "OPTIMIZED" if "OPTIMIZED" in marks else "FTRACE" if "FTRACE" in marks else ""
        out.append(
            ProbeListing(
                addr=int(m["addr"], 16),
                kind=m["kind"],
                where=m["where"],
                module=module.strip("[]"),
                is_gone="GONE" in marks,
                is_disabled="DISABLED" in marks,
                plan=plan,
            )
        )
    return out


def parse_blacklist(text: str) -> list[BlacklistEntry]:
    out = []
    for line in text.splitlines():
        m = _BLACKLIST_LINE.match(line.strip())
        if m is not None:
            out.append(BlacklistEntry(int(m["start"], 16), int(m["end"], 16), m["sym"].strip()))
    return out


class KprobesKnobs:
    """The debugfs ``kprobes/`` directory and the optimization sysctl of one kernel."""

    def __init__(self) -> None:
        require_root("reading the kernel's kprobes (debugfs kprobes/)")
        debugfs = find_debugfs()
        directory = os.path.join(debugfs, "kprobes") if debugfs else ""
        if not directory or not os.path.isdir(directory):
            raise TargetError(
                "debugfs has no kprobes/ directory (debugfs not mountable, or a kernel "
                "without CONFIG_KPROBES)",
                errno=_errno.ENOENT,
            )
        self.directory = directory
        self._saved: dict[str, str] = {}

    def _read(self, path: str) -> str:
        try:
            return read_file(path)
        except OSError as exc:
            raise TargetError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc

    def _set(self, path: str, value: str) -> None:
        self._saved.setdefault(path, self._read(path).strip())
        try:
            write_file(path, value + "\n", append=False)
        except OSError as exc:
            raise TargetError(
                f"cannot write {value!r} to {path}: {exc.strerror}", errno=exc.errno
            ) from exc

    def list(self) -> builtins.list[ProbeListing]:
        return parse_list(self._read(os.path.join(self.directory, "list")))

    def blacklist(self) -> builtins.list[BlacklistEntry]:
        return parse_blacklist(self._read(os.path.join(self.directory, "blacklist")))

    @property
    def enabled(self) -> bool:
        return self._read(os.path.join(self.directory, "enabled")).strip() == "1"

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._set(os.path.join(self.directory, "enabled"), "1" if value else "0")

    @property
    def has_optimization(self) -> bool:
        return os.path.exists(OPTIMIZATION_SYSCTL)

    @property
    def optimization(self) -> bool:
        if not self.has_optimization:
            raise TargetError(
                f"{OPTIMIZATION_SYSCTL} is missing: this kernel has no CONFIG_OPTPROBES",
                errno=_errno.ENOENT,
            )
        return self._read(OPTIMIZATION_SYSCTL).strip() == "1"

    @optimization.setter
    def optimization(self, value: bool) -> None:
        if not self.has_optimization:
            raise TargetError(
                f"{OPTIMIZATION_SYSCTL} is missing: this kernel has no CONFIG_OPTPROBES",
                errno=_errno.ENOENT,
            )
        self._set(OPTIMIZATION_SYSCTL, "1" if value else "0")

    def restore(self) -> None:
        """Put back every knob this session changed, as it was before the first change."""
        saved, self._saved = self._saved, {}
        for path, value in saved.items():
            try:
                write_file(path, value + "\n", append=False)
            except OSError:
                continue
