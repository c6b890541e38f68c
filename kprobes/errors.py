"""One exception tree for the whole package, split by what the caller can do about it.

    ProbeError                      root; ``.errno`` is what the kernel would return
    ├── SpecError                   the probe text is malformed; ``.column`` (0-based),
    │                               ``.hint`` what would be valid there (or "")
    ├── ProbeRejected               this probe cannot be placed; ``.errno`` says why
    │   ├── SymbolNotFound          ENOENT: the symbol is in none of the places searched
    │   │   └── NotMapped           ENOENT: its library is not mapped yet (may be, later)
    │   ├── NotABoundary            EILSEQ: the address is inside an instruction
    │   ├── Blacklisted             EINVAL: our own pages, or an address the user blacklisted
    │   ├── NotRelocatable          EINVAL/ERANGE/EOPNOTSUPP: the instruction cannot run out of line
    │   └── UnsupportedOption       EINVAL: this target cannot honour an option the probe asks for
    ├── TargetError                 the process is gone, not traceable, not ELF, ...
    ├── TraceFsError                the kernel refused a tracefs write (with its error_log line)
    ├── RecordFileError             a record file is not one, or is damaged from ``.offset`` on
    └── InternalError               a bug in kprobes: an impossible state was reached

Library code raises these and never prints; the CLI catches ``ProbeError`` in one place.
Lower layers translate their own failures (``OSError`` from a syscall, ``ELFError`` from
pyelftools) at the boundary with ``raise ... from``.
"""

from __future__ import annotations

import errno as _errno


class ProbeError(Exception):
    """Root of every error kprobes raises on purpose."""

    default_errno = _errno.EINVAL

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.errno = self.default_errno if errno is None else errno

    def __str__(self) -> str:
        return self.message


class SpecError(ProbeError):
    """Malformed probe text; ``column`` is the 0-based position of the fault.

    ``message`` is the kernel's own ``error_log`` wording where the kernel has one (so that
    it compares equal to what the kernel says of the same line); ``hint``, when there is
    one, says what would be valid instead, and is shown after it.
    """

    def __init__(self, message: str, *, column: int = 0, text: str = "", hint: str = "") -> None:
        super().__init__(message, errno=_errno.EINVAL)
        self.column = column
        self.text = text
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class ProbeRejected(ProbeError):
    """The probe cannot be registered; ``errno`` mirrors register_kprobe()'s return."""


class SymbolNotFound(ProbeRejected):
    default_errno = _errno.ENOENT


class NotMapped(SymbolNotFound):
    """The probe names a library the process has not mapped (yet): a target that follows
    the program may keep such a probe pending until the library is loaded."""


class NotABoundary(ProbeRejected):
    default_errno = _errno.EILSEQ


class Blacklisted(ProbeRejected):
    default_errno = _errno.EINVAL


class NotRelocatable(ProbeRejected):
    """The probed instruction cannot be executed out of line (or not within reach)."""

    default_errno = _errno.EINVAL


class UnsupportedOption(ProbeRejected):
    """The probe asks for something this target cannot do (``optimize=True`` of the kernel's
    uprobes, an ``entry_handler`` of a tracefs return probe): refused before anything is
    placed, never ignored. ``target`` and ``option`` name both; the message says why."""

    default_errno = _errno.EINVAL

    def __init__(self, target: str, option: str, kind: str, why: str) -> None:
        super().__init__(f"{target} cannot honour {option} on a {kind}: {why}")
        self.target = target
        self.option = option.split("=", 1)[0]
        self.kind = kind


class TargetError(ProbeError):
    """The target process (or file) is gone, not traceable, or not what was expected."""

    default_errno = _errno.ESRCH


class TraceFsError(ProbeError):
    """The kernel refused a tracefs operation; ``log_line`` is its error_log entry."""

    def __init__(self, message: str, *, errno: int | None = None, log_line: str = "") -> None:
        super().__init__(message, errno=errno)
        self.log_line = log_line


class RecordFileError(ProbeError):
    """A record file (``kprobes record``) is not one, or is damaged from ``offset`` on."""

    default_errno = _errno.EBADMSG

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


class InternalError(ProbeError):
    """An impossible state was reached: a bug in kprobes, never the user's fault."""

    default_errno = _errno.EFAULT
