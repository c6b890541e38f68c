"""What a probe with an asynchronous handler needs on both tiers: ``FastProbe``.

A probe of the API with an ``async_handler`` (or one of the command line's) is *equipped*
once: its fetch-args parsed and compiled (``ArgFetcher``), with what the fast tier's
captures need to resolve (``@symbol``, file offsets) and, for a return probe with an entry
action, the entry's own spec. The reader (reader.py) turns its records into events with
it; at a trap, trapevents.py makes the same event from the live thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.model import EntryData, Event, UserStack
from kprobes.process.fetch.evaluate import ArgFetcher, Memory
from kprobes.process.fetch.fast import Resolver, data_resolver, file_resolver
from kprobes.spec import SymbolLocation, parse
from kprobes.values import dataclass

if TYPE_CHECKING:
    from kprobes.process.fast.batch import BatchOutput
    from kprobes.spec import ProbeSpec
    from kprobes.symbols.resolve import SymbolResolver


@dataclass(slots=True)
class FastProbe:
    """What a probe with an asynchronous handler needs on both tiers (kept by
    ``Recording``, by probe: the core's ``Kprobe`` carries nothing of the process target)."""

    spec: ProbeSpec
    fetcher: ArgFetcher
    with_regs: bool
    memory: Memory  # the live program's, for the trap tier
    resolvers: Resolver  # the spec's @symbol and file offsets, for the captures
    pid: int  # the process the events are of
    group: str = "kprobes"  # the events' names (``Event.group``/``Event.event``)
    event: str = ""
    # Prints the events of the probe's records a batch at a time, where the probe is alone
    # at its site (batch.py); None: every event goes to the handler.
    batch: BatchOutput | None = None
    # The user stack of each event, this many frames at most (None: no stack): walked in
    # the detour on the fast tier (frametables.py), by ``trap_stack`` at a trap.
    stack_depth: int | None = None
    trap_stack: Callable[[Any], UserStack] | None = None
    # Hits counted by stack in the program, no record each (stackcounts.py): each stack's
    # new hits as one event and their count; at a trap, the handler still gets the event.
    count_sink: Callable[[Event, int], None] | None = None
    # A return probe's entry action (``Kretprobe(entry_args=...)``): an entry spec of those
    # fetch-args, evaluated at the entry (a record of its own on the fast tier).
    entry: EntryAction | None = None

    def __post_init__(self) -> None:
        if not self.event:
            self.event = self.spec.effective_event


def equip(
    kp: Kprobe | Kretprobe,
    symbols: Callable[[], SymbolResolver],
    memory: Memory,
    *,
    pid: int,
    event: str = "",
) -> FastProbe:
    """Prepare a probe of the API with an ``async_handler``: its ``args`` parsed (a
    SpecError names the column) and how its fetch-args are evaluated on both tiers. Its
    events are named ``kprobes/EVENT``: ``event``, else the kernel's default for the place
    (``p_work_0``)."""
    where = kp.symbol or f"{kp.addr or 0:#x}"
    if kp.symbol and kp.offset:
        where += f"+{kp.offset:#x}"
    kind = "r" if isinstance(kp, Kretprobe) else "p"
    spec = parse(" ".join((f"{kind}:kprobes/{event}" if event else kind, where, *kp.args)))
    resolve_data = data_resolver(symbols)
    loc = spec.location
    path = loc.module if isinstance(loc, SymbolLocation) and loc.module else "/proc/self"
    file_addr = file_resolver(symbols, path)
    fetcher = ArgFetcher(spec, resolve_data, file_addr)
    entry = None
    if isinstance(kp, Kretprobe) and kp.entry_args:
        at_entry = parse(" ".join(("p", where, *kp.entry_args)))
        entry = EntryAction(at_entry, ArgFetcher(at_entry, resolve_data, file_addr))
    return FastProbe(
        spec, fetcher, kp.with_regs, memory, (resolve_data, file_addr), pid, entry=entry
    )


@dataclass(frozen=True, slots=True)
class EntryAction:
    """A return probe's entry action: fetch-args read at each call's entry, handed to its
    return's event as ``Event.data`` (on the fast tier, a record the entry writes: the
    return's record names it by its ticket, ``ENTRY_DATA``)."""

    spec: ProbeSpec
    fetcher: ArgFetcher

    def data(self, regs: Any, memory: Memory) -> EntryData:
        return EntryData(self.fetcher.fetch(regs, memory))
