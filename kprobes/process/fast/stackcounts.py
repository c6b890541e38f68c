"""Stacks counted in the program (``stackcount`` on the fast tier), read by the tool.

A site whose probes all count their hits by stack (``FastProbe.count_sink``) gets a
stack-count action (arch/x86_64/stackids.py) in place of a record action: each hit adds one
to the entry of its stack id in its shared area's table, and nothing goes into the ring.
``StackTally.take`` reads the tables after each full read of the rings (``RingReader``'s
``after_drain``: before a trap's event, at the end of a run, before an exec forgets the
areas) and hands each stack's new hits to its probes' ``count_sink`` as one event and a
count. A stack is named once, when its entry is first read (the frames' files may be gone
later: a ``dlclose``, the program's exit).

What the events of a count carry: the probe, its place and its stack; no thread, CPU, time
or arguments (the program counts hits, it keeps none of these: the event's ``tid`` is the
process's, its ``cpu`` -1, its time the read's). Hits a full table could not count are the
areas' ``OFF_STACKS_LOST`` words, reported with the ring's drops (``lost``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.stackids import iter_entries, read_lost
from kprobes.model import Event, UserStack
from kprobes.process.fast.reader import cut_stack, record_targets

if TYPE_CHECKING:
    from kprobes.arch.x86_64.stackwalk import WalkResult
    from kprobes.core.probes import Kprobe
    from kprobes.core.retprobes import Kretprobe
    from kprobes.process.fast.probe import FastProbe
    from kprobes.process.fast.reader import RecordSite, RingReader
    from kprobes.process.fast.state import SharedArea

# One area's entries read before: (the area, kept alive so that its id names it alone;
# each entry's count when last read and its stack, named at its first read).
_Seen = tuple["SharedArea", dict[int, tuple[int, UserStack]]]


class StackTally:
    """The stack ids' tables of one address space's areas, read into events and counts."""

    def __init__(
        self,
        areas: Callable[[], Iterable[SharedArea]],
        reader: RingReader,
        fast_of: Callable[[Kprobe | Kretprobe], FastProbe | None],
        name_stack: Callable[[int, WalkResult], UserStack],
    ) -> None:
        self._areas = areas
        self._reader = reader
        self._fast_of = fast_of
        self._name_stack = name_stack
        self._seen: dict[int, _Seen] = {}
        self.is_active = False  # some site counts by stack (set by its action's maker)

    def take(self) -> None:
        """Each stack's hits since the last read, to its probes' ``count_sink``."""
        if not self.is_active:
            return
        now = time.monotonic()
        for area in self._areas():
            layout = area.layout
            if not layout.stack_entries:
                continue
            seen = self._seen.setdefault(id(area), (area, {}))[1]
            view = area.view
            entries = iter_entries(
                view, layout.stacks_offset, layout.stack_entries, layout.stack_stride
            )
            for entry in entries:
                if entry.walk is None:
                    continue  # its addresses are being written: counted at a later read
                rs = self._reader.sites.get(entry.probe)
                if rs is None:
                    continue
                before, stack = seen.get(entry.index, (0, None))
                if entry.count <= before:
                    continue
                ip = rs.site.addr
                if stack is None:
                    stack = self._name_stack(ip, entry.walk)
                seen[entry.index] = (entry.count, stack)
                self._deliver(rs, stack, entry.count - before, now)

    def _deliver(self, rs: RecordSite, stack: UserStack, count: int, now: float) -> None:
        reader, ip = self._reader, rs.site.addr
        for target in record_targets(rs):
            fp = self._fast_of(target)
            if fp is None or fp.count_sink is None:
                continue
            event = Event(
                fp.group, fp.event, fp.pid, fp.pid, reader.comm(fp.pid), -1, now, ip,
                reader.symbolize(ip), stack=cut_stack(stack, fp.stack_depth),
            )  # fmt: skip
            fp.count_sink(event, count)

    def lost(self) -> int:
        """Hits not counted by stack since the areas were made: their tables were full."""
        if not self.is_active:
            return 0
        return sum(read_lost(area.view, sa.OFF_STACKS_LOST) for area in self._areas())
