"""Return probes and jprobes: the probe objects and the kretprobe instance pool.

A ``Kretprobe`` is, as in the kernel, a kprobe at the function's entry (its ``kp``, listed
with type ``r``) plus a pool of ``maxactive`` pre-allocated instances. Each call that takes an
instance keeps it until the function returns (or is found abandoned by ``longjmp`` or an
exception); a call that finds the pool empty is counted in ``nmissed`` and not hooked.

The pool and the probe objects are generic. How the return address is captured, where the
trampoline is and how a thread's live instances are matched to a return belong to the target
(``process/engine/trampoline.py`` for the Process target).

A ``Jprobe`` is a kprobe at a function's entry whose handler is called with the function's
arguments; it is registered through an entry kprobe (type ``j``) like the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kprobes.core.probes import Kprobe, Location, ProbeFlags
from kprobes.values import dataclass

# handler(ri, regs) and entry_handler(ri, regs); a true entry_handler result cancels the hook.
RetHandler = Callable[["KretprobeInstance", Any], "bool | int | None"]

DEFAULT_MAXACTIVE_MIN = 10
MAXACTIVE_LIMIT = 4096  # the kernel's KRETPROBE_MAXACTIVE_MAX for kprobe_events


@dataclass(frozen=True, slots=True)
class Task:
    """The thread an instance belongs to (the kernel's ``ri->task``)."""

    pid: int
    tid: int


class KretprobeInstance:
    """One in-flight call of a return-probed function (``struct kretprobe_instance``)."""

    __slots__ = ("data", "probe", "record", "ret_addr", "stack", "task")

    def __init__(self, probe: Kretprobe) -> None:
        self.probe = probe
        self.ret_addr = 0  # where the function really returns to
        self.stack = 0  # address of the return-address slot on the thread's stack
        self.task: Task = Task(0, 0)
        self.data = bytearray(probe.data_size)
        self.record = 0  # the target's own: where it keeps a copy of the call (0: nowhere)

    def __repr__(self) -> str:
        return (
            f"<KretprobeInstance {self.probe.display} tid={self.task.tid} "
            f"ret={self.ret_addr:#x} stack={self.stack:#x}>"
        )


class EntryProbed:
    """A probe type built on a kprobe at a function's entry (the kernel's ``rp->kp``,
    ``jp->kp``): that kprobe carries where the probe is and its state."""

    kind = "k"

    def __init__(self, symbol: str | None, offset: int, addr: int | None, disabled: bool) -> None:
        self.kp = Kprobe(symbol=symbol, offset=offset, addr=addr, disabled=disabled)
        self.kp.kind = self.kind
        self.kp.owner = self

    @property
    def symbol(self) -> str | None:
        return self.kp.symbol

    @property
    def offset(self) -> int:
        return self.kp.offset

    @property
    def addr(self) -> int | None:
        return self.kp.addr

    @property
    def flags(self) -> ProbeFlags:
        return self.kp.flags

    @property
    def location(self) -> Location | None:
        return self.kp.location

    @property
    def is_registered(self) -> bool:
        return self.kp.is_registered

    @property
    def is_disabled(self) -> bool:
        return self.kp.is_disabled

    @property
    def is_gone(self) -> bool:
        return self.kp.is_gone

    @property
    def display(self) -> str:
        if self.kp.location is not None:
            return self.kp.location.display
        return self.kp.symbol or hex(self.kp.addr or 0)


class Kretprobe(EntryProbed):
    """A return probe: ``Kretprobe(symbol="libc:malloc", handler=h, entry_handler=e)``.

    ``handler(ri, regs)`` runs when the function returns (``regs.return_value`` is its
    result); ``entry_handler(ri, regs)`` runs at its entry and returning true cancels the
    return hook for that call. ``ri.data`` is a ``bytearray(data_size)`` shared by the two.

    ``optimize=True`` with neither handler asks for the optimized tier: where the entry
    site takes a jump, neither the entry nor the return traps; the program counts the
    returns (``nhit``), the misses and the abandoned frames, and times each call into
    ``hist_slots`` (bcc's log2 slots, in ``duration_unit`` ns) and ``hist_total``,
    read when the user can see them, as an optimized kprobe's ``nhit`` is. ``maxactive``
    keeps its meaning there: the calls of this probe hooked at once, every thread's (0:
    no cap but the 16,384 entries of each thread's shadow stack, which every probe
    shares). A probe with a handler stays on traps.

    ``optimize=True`` with an ``async_handler`` (and no other handler) makes a *record* of
    each return, as an optimized kprobe does of each hit: the return trampoline writes the
    fetch-args ``args`` evaluated at the return (``"ret=$retval"``, ``%ax``, memory), with
    ``with_regs=True`` the registers at the return, and the tool hands
    ``async_handler(probe, event)`` a read-only return ``Event`` after the fact (``ip`` the
    caller, ``func``, ``entry_timestamp``). Where the entry site keeps its int3 the same
    event is made at the return's trap. ``$arg1``..``$arg6`` are the argument registers
    the entry kept for the return (memory read through them, or an argument on the stack,
    keeps the probe on traps); ``entry_handler`` and ``data_size`` do not go with an
    ``async_handler``. Its entry action is declared instead: ``entry_args`` are fetch-args
    read at the call's entry (``"len=+8($arg1):u32 name=+0(+16($arg1)):string"``: memory,
    strings, registers), which the return's event carries as ``event.data`` (``ri.data``'s
    counterpart, a read-only mapping by name); on the fast tier the entry writes them as a
    record of their own, paired exactly with the return's. An entry record lost to a full
    ring leaves that event's ``data`` None, counted in ``nmissed_data``.
    """

    kind = "r"

    def __init__(
        self,
        symbol: str | None = None,
        offset: int = 0,
        addr: int | None = None,
        handler: RetHandler | None = None,
        entry_handler: RetHandler | None = None,
        maxactive: int = 0,
        data_size: int = 0,
        disabled: bool = False,
        optimize: bool = False,
        async_handler: Callable[[Kretprobe, Any], Any] | None = None,
        args: str | Sequence[str] = (),
        with_regs: bool = False,
        entry_args: str | Sequence[str] = (),
    ) -> None:
        super().__init__(symbol, offset, addr, disabled)
        self.kp.optimize = optimize
        self.async_handler = async_handler  # the records of the returns (after the fact)
        self.args: tuple[str, ...] = (
            ((args,) if args else ()) if isinstance(args, str) else tuple(args)
        )
        self.with_regs = with_regs  # the async_handler's Event carries the registers
        # The entry action: fetch-args read at the entry, handed over as ``Event.data``.
        self.entry_args: tuple[str, ...] = (
            ((entry_args,) if entry_args else ())
            if isinstance(entry_args, str)
            else tuple(entry_args)
        )
        self.nmissed_data = 0  # return events whose entry's record was lost (a full ring)
        self.handler = handler
        self.entry_handler = entry_handler
        self.maxactive = maxactive
        self.data_size = data_size
        self.nmissed = 0  # entries that found no free instance
        self.nabandoned = 0  # instances dropped because their frame vanished (longjmp, throw)
        self.nhit = 0  # returns reported
        self.pool: InstancePool | None = None  # set while registered
        # What the program aggregates at each return (optimized): each call's duration in
        # units of ``duration_unit`` ns (1: ns; 1000: us), or, with ``value_bits`` 32 or 64,
        # the return value's low bits; bcc's log2 slots of it and its sum.
        self.duration_unit = 1
        self.value_bits = 0
        self.hist_slots: tuple[int, ...] = ()
        self.hist_total = 0
        # Linear buckets (low, high, step: bpftrace's lhist) in place of the log2 slots:
        # ``hist_slots`` are then theirs (below low, the buckets, high and above).
        self.linear: tuple[int, int, int] | None = None
        # The command line's: the handlers run only where the site keeps its trap; on the
        # optimized tier the program times the calls instead.
        self.handlers_on_traps_only = False

    @property
    def optimize(self) -> bool:
        """Asked for the fast tier: entry and return without a trap where the site allows."""
        return self.kp.optimize

    def why_on_traps(self) -> str | None:
        """Why this return probe runs on the trap tier whatever its site; None if it may run
        in the program (no handler that must run synchronously)."""
        if not self.kp.optimize:
            return ""
        if self.handlers_on_traps_only:
            return None
        if self.handler is not None:
            return "its handler runs synchronously at the return, at a trap"
        if self.entry_handler is not None or self.data_size:
            return "its entry_handler runs synchronously at the entry, at a trap"
        return None

    def note_hist(self, slots: tuple[int, ...], total: int) -> None:
        """What the program has aggregated so far (cumulative: the optimized tier's)."""
        self.hist_slots = slots
        self.hist_total = total

    def __repr__(self) -> str:
        state = "registered" if self.is_registered else "unregistered"
        return (
            f"<Kretprobe {self.display} {state} nhit={self.nhit} nmissed={self.nmissed} "
            f"nabandoned={self.nabandoned}>"
        )


def default_maxactive(nthreads: int) -> int:
    """The document's ``max(10, 2*NR_CPUS)``, with the program's threads for CPUs."""
    return max(DEFAULT_MAXACTIVE_MIN, 2 * max(1, nthreads))


class InstancePool:
    """``maxactive`` pre-allocated instances; ``get`` returns None when all are in flight."""

    __slots__ = ("free", "size")

    def __init__(self, probe: Kretprobe, size: int) -> None:
        self.size = size
        self.free = [KretprobeInstance(probe) for _ in range(size)]

    def get(self) -> KretprobeInstance | None:
        free = self.free
        return free.pop() if free else None

    def put(self, ri: KretprobeInstance) -> None:
        self.free.append(ri)

    @property
    def in_flight(self) -> int:
        return self.size - len(self.free)


# entry(*args) for a Jprobe: called with the probed function's arguments.
JprobeEntry = Callable[..., Any]


class Jprobe(EntryProbed):
    """A probe on a function's entry whose handler receives the function's arguments.

    ``Jprobe(symbol="work", entry=fn)``: ``fn(a, b, ...)`` is called with the arguments of
    each call, typed from DWARF or from ``fn``'s annotations; returning from ``fn`` is the
    document's ``jprobe_return()``. Registers and the top of the stack are restored after
    ``fn``, so a jprobe cannot disturb the call (the mirroring principle).
    """

    kind = "j"

    def __init__(
        self,
        symbol: str | None = None,
        offset: int = 0,
        addr: int | None = None,
        entry: JprobeEntry | None = None,
        disabled: bool = False,
    ) -> None:
        super().__init__(symbol, offset, addr, disabled)
        self.entry = entry
        self.plan: Any = None  # where each argument is, decided by the target at registration

    @property
    def nmissed(self) -> int:
        return self.kp.nmissed

    @property
    def nhit(self) -> int:
        return self.kp.nhit

    def __repr__(self) -> str:
        where = self.kp.location.display if self.kp.location else (self.symbol or "?")
        state = "registered" if self.is_registered else "unregistered"
        return f"<Jprobe {where} {state} nhit={self.nhit}>"
