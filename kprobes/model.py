"""Frozen values shared by the targets and the command line.

The annotations here are objects, not text (no ``from __future__ import annotations``):
``typing.NamedTuple`` turns each text annotation of ``Event`` and ``EventArg`` into a
``ForwardRef``, which compiles it, and the first ``compile()`` of a process builds the
compiler's tables: 9 M instructions, about 3 ms of every command's start.
"""

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from kprobes.arch.x86_64.regs import Regs
from kprobes.values import dataclass


@dataclass(frozen=True, slots=True)
class ProbeListing:
    """One line of Appendix A's ``/sys/kernel/debug/kprobes/list``, for one probe."""

    addr: int
    kind: str  # "k", "r", "j"
    where: str  # symbol+offset
    module: str  # basename of the file the probe is in ("" if unknown)
    is_gone: bool
    is_disabled: bool
    plan: str  # how the probed instruction runs out of line: emulate, boost, step, singlestep
    is_pending: bool = False  # waiting for its library to be mapped (addr 0)
    why_not_optimized: str = ""  # a probe that asked for a jump and kept its int3: why

    @property
    def is_optimized(self) -> bool:
        """``[OPTIMIZED]``: a jump instead of a breakpoint (the kernel's optprobes)."""
        return self.plan == "OPTIMIZED"

    @property
    def is_ftrace(self) -> bool:
        """``[FTRACE]``: a kernel probe on a function entry, riding on ftrace."""
        return self.plan == "FTRACE"

    def __str__(self) -> str:
        parts = [f"{self.addr:016x}", self.kind, self.where]
        if self.module:
            parts.append(f"[{self.module}]")
        if self.is_gone:
            parts.append("[GONE]")
        elif self.is_pending:
            parts.append("[PENDING]")
        if self.is_disabled:
            parts.append("[DISABLED]")
        if self.plan:
            parts.append(f"[{self.plan}]")
        return "  ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {
            "addr": self.addr,
            "kind": self.kind,
            "where": self.where,
            "module": self.module,
            "is_gone": self.is_gone,
            "is_disabled": self.is_disabled,
            "plan": self.plan,
            "is_pending": self.is_pending,
            "why_not_optimized": self.why_not_optimized,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> "ProbeListing":
        return cls(
            addr=int(str(data["addr"])),
            kind=str(data["kind"]),
            where=str(data["where"]),
            module=str(data["module"]),
            is_gone=bool(data["is_gone"]),
            is_disabled=bool(data["is_disabled"]),
            plan=str(data["plan"]),
            is_pending=bool(data.get("is_pending", False)),
            why_not_optimized=str(data.get("why_not_optimized", "")),
        )


@dataclass(frozen=True, slots=True)
class BlacklistEntry:
    """An address range where probes are refused, and why (debugfs ``kprobes/blacklist``)."""

    start: int
    end: int
    reason: str

    def __contains__(self, addr: object) -> bool:
        return isinstance(addr, int) and self.start <= addr < self.end

    def __str__(self) -> str:
        return f"0x{self.start:016x}-0x{self.end:016x}\t{self.reason}"


# A fetched value as the evaluator hands it over: an integer (u/s/x/char/bitfield types), a
# string (string, ustring, symbol, symstr, $comm), None when the fetch faulted (printed as the
# kernel's "(fault)"), or a tuple of those for the array types ``TYPE[N]``.
ArgValue = int | str | None | tuple["ArgValue", ...]


class EventArg(NamedTuple):
    """One fetched argument of an event: its name, its spec type (``u32``, ``string``, ...)."""

    name: str
    type: str
    value: ArgValue


class EntryData(Mapping[str, "ArgValue"]):
    """``event.data`` of a return event whose probe declares an entry action
    (``Kretprobe(entry_args=...)``): what those fetch-args read at the call's entry, by
    name, read-only: the counterpart of the C API's ``ri->data``, which an entry handler
    fills by hand. ``args`` keeps their types, as ``Event.args`` does."""

    __slots__ = ("args",)

    def __init__(self, args: tuple[EventArg, ...]) -> None:
        self.args = args

    def __getitem__(self, name: str) -> ArgValue:
        for a in self.args:
            if a.name == name:
                return a.value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (a.name for a in self.args)

    def __len__(self) -> int:
        return len(self.args)

    def __hash__(self) -> int:
        return hash(self.args)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EntryData):
            return self.args == other.args
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self) -> str:
        return f"EntryData({dict(self)!r})"


@dataclass(frozen=True, slots=True)
class StackFrame:
    """One frame of a user stack, innermost first: where it is, named as the kernel's
    ``%pS`` names an address (``func+0xOFF/0xSIZE``), ``[module]`` for a library."""

    addr: int  # the thread's ip for the first frame, then return addresses
    func: str = ""  # "" when no symbol covers the address
    offset: int = 0  # from the function's start
    size: int = 0  # the function's size (0: unknown)
    module: str = ""  # a library's file name; "" in the program's own file (or unknown)

    @property
    def text(self) -> str:
        """``func+0xOFF/0xSIZE [module]``; ``0xADDR [module]`` without a symbol."""
        where = (
            f"{self.func}+{self.offset:#x}/{max(self.size, 1):#x}"
            if self.func
            else (f"{self.addr:#x}")
        )
        return f"{where} [{self.module}]" if self.module else where

    @property
    def name(self) -> str:
        """The frame in a flame graph or a folded line: the function, else ``[module]``,
        else the hex address."""
        return self.func or (f"[{self.module}]" if self.module else f"{self.addr:#x}")


@dataclass(frozen=True, slots=True)
class UserStack:
    """The user stack of a hit, innermost first; ``stop`` says why the walk ended before
    the outermost frame (``"no unwind info"``, ...), "" when it reached it."""

    frames: tuple[StackFrame, ...]
    stop: str = ""

    @property
    def marker(self) -> str:
        """The frame printed after the last one when the walk stopped short: ``[stop]``."""
        return f"[{self.stop}]" if self.stop else ""


class Event(NamedTuple):
    """One probe hit, after the fact: the same value for every target (Process, Kernel,
    Uprobes) and every tier (a trap, a jump-optimized record, the kernel's ring buffer).

    Every handler that sees a hit after the fact receives one: ``async_handler(probe,
    event)`` on every target, and the kernel targets' other handlers (their probes are
    read-only). A synchronous handler (``pre_handler(probe, regs)`` on ``Process``) gets the
    live, writable ``Regs`` instead. ``kprobes.Hit`` is another name of this class.

    ``timestamp`` is in seconds, from the same clock for every event of one session
    (CLOCK_MONOTONIC for the Process target, the trace clock for the kernel's). ``location``
    is ``sym+off/size`` of ``ip``; for a return event, ``ip`` is where the function returns to
    (the caller) and ``func`` names the function that returned, as in the kernel's
    ``(caller+off/size <- func)``.

    ``Event`` and ``EventArg`` are named tuples, not frozen dataclasses like the other values:
    the kernel targets build hundreds of thousands of them per second, and a frozen
    dataclass sets each field through ``object.__setattr__`` (docs/decisions.md has the
    figures). They read, compare, hash, match and print as the dataclasses did; being tuples,
    they also unpack and compare equal to a plain tuple of the same fields.
    """

    group: str
    event: str
    pid: int
    tid: int
    comm: str
    cpu: int
    timestamp: float
    ip: int
    location: str
    args: tuple[EventArg, ...] = ()
    is_return: bool = False
    func: str = ""
    func_ip: int = 0
    entry_timestamp: float = 0.0  # return events: when the call was entered (0.0 if unknown)
    # A read-only copy of the registers at the hit, for a Process probe that asked for them
    # (``Kprobe(async_handler=..., with_regs=True)``); None otherwise.
    regs: Regs | None = None
    # The thread's user stack at the hit, when the session asked for stacks (``trace -U``,
    # ``stackcount``); None otherwise.
    stack: UserStack | None = None
    # A return event's entry action's values (``Kretprobe(entry_args=...)``: ``ri.data``);
    # None without one, or when its entry's record was lost (a full ring).
    data: EntryData | None = None

    @property
    def name(self) -> str:
        """``GROUP/EVENT``."""
        return f"{self.group}/{self.event}"

    def arg(self, name: str) -> ArgValue:
        for a in self.args:
            if a.name == name:
                return a.value
        raise KeyError(name)
