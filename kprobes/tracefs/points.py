"""What the tracefs targets know of each probe: where it goes, and its event.

``ProbePoint`` is a resolved place (the subclass's ``_resolve``); ``Registration`` is the
target's private state for one probe (the kernel's ``ainsn``: core never reads it), from the
event line written to the compiled record builder.
"""

from __future__ import annotations

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.spec import Location
from kprobes.tracefs.records import Builder
from kprobes.values import dataclass

AnyProbe = Kprobe | Kretprobe


@dataclass(frozen=True, slots=True)
class ProbePoint:
    """Where a probe goes, as the target resolved it (the ``Location`` of core)."""

    addr: int  # kernel address, or the runtime (pid) or link-time (path) address of a uprobe
    display: str  # "vfs_read+0x10"
    module_name: str
    place: Location  # the PLACE word of the probe line
    symbol: str  # function name ("" if unknown)
    offset: int  # from the function's start
    func_size: int  # 0 if unknown

    @property
    def describe(self) -> str:
        """``sym+0xoff/0xsize``: how the kernel prints this address (``%pS``)."""
        if not self.symbol:
            return f"{self.addr:#x}"
        return f"{self.symbol}+{self.offset:#x}/{self.func_size:#x}"


class Registration:
    """One probe's event: the target's private state for it (``site.ainsn``)."""

    __slots__ = (
        "arg_names",
        "arg_types",
        "build",
        "clock",
        "comm_index",
        "event",
        "id",
        "is_enabled",
        "is_hidden",
        "line",
        "point",
        "probe",
    )

    def __init__(self, probe: AnyProbe, event: str, line: str, point: ProbePoint) -> None:
        self.probe = probe
        self.event = event
        self.line = line
        self.point = point
        self.id = -1
        self.build: Builder | None = None
        self.arg_names: tuple[str, ...] = ()
        self.arg_types: tuple[str, ...] = ()
        self.comm_index = -1
        self.is_enabled = False
        self.is_hidden = False  # an entry clock: not listed, never delivered
        self.clock: Kprobe | None = None  # a return probe's hidden entry probe


def entry_of(probe: AnyProbe) -> Kprobe:
    return probe.kp if isinstance(probe, Kretprobe) else probe


def is_comm(arg: str) -> bool:
    fetch = arg.split("=", 1)[1] if "=" in arg.split(":", 1)[0] else arg
    return fetch.split(":", 1)[0] in ("$comm", "$COMM")
