"""The probe table: one site per probed address, aggregating every probe placed there.

The kernel turns a second kprobe at an address into an "aggregate" kprobe whose handlers call
each child's. Here every address always has a ``ProbeSite`` holding one or more probes, so
the hit path never distinguishes the two cases. The site keeps the tuple of probes whose
handlers must run, rebuilt when membership or enablement changes, so a hit walks a tuple
and tests nothing else.

Handler exceptions: the probe's fault handler is offered the exception (trapnr -1). If it
does not handle it, the first such exception is parked in ``ProbeTable.pending_error``; the
target finishes the hit (the program must not be left half-way through an instruction) and
then raises it out of ``run()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kprobes.core.probes import TRAP_HANDLER_EXCEPTION, Kprobe, Location


class ProbeSite:
    """Every probe registered at one address, and the target's state for that address."""

    __slots__ = ("active", "addr", "ainsn", "is_armed", "location", "posts", "probes", "table")

    def __init__(self, table: ProbeTable, addr: int, location: Location) -> None:
        self.table = table
        self.addr = addr
        self.location = location
        self.probes: list[Kprobe] = []
        self.active: tuple[Kprobe, ...] = ()  # enabled probes, in registration order
        self.posts: tuple[Kprobe, ...] = ()  # enabled probes with a post handler
        self.ainsn: Any = None  # the target's per-address state; core never reads it
        self.is_armed = False

    @property
    def has_post_handler(self) -> bool:
        """Any registered probe here has a post handler (decides boost versus step)."""
        return any(p.post_handler is not None for p in self.probes)

    @property
    def is_enabled(self) -> bool:
        return bool(self.active)

    def refresh(self) -> None:
        self.active = tuple(p for p in self.probes if not p.is_disabled)
        self.posts = tuple(p for p in self.active if p.post_handler is not None)

    def run_pre(self, regs: Any) -> bool:
        """Run the pre handlers; True if one of them redirected execution."""
        redirected = False
        for p in self.active:
            p.nhit += 1
            handler = p.pre_handler
            if handler is None and p.async_handler is not None:
                handler = self.table.run_async
            if handler is not None:
                try:
                    if handler(p, regs):
                        redirected = True
                except Exception as exc:
                    self._fault(p, regs, exc)
        return redirected

    def run_post(self, regs: Any) -> None:
        for p in self.posts:
            handler = p.post_handler
            assert handler is not None
            try:
                handler(p, regs, 0)
            except Exception as exc:
                self._fault(p, regs, exc)

    def run_fault(self, regs: Any, trapnr: int) -> bool:
        """The out-of-line copy faulted: True if some fault handler handled it."""
        handled = False
        for p in self.active:
            handler = p.fault_handler
            if handler is not None:
                try:
                    if handler(p, regs, trapnr):
                        handled = True
                except Exception as exc:
                    self.table.park(exc)
        return handled

    def miss(self) -> None:
        for p in self.active:
            p.nmissed += 1

    def _fault(self, probe: Kprobe, regs: Any, exc: Exception) -> None:
        handler = probe.fault_handler
        if handler is not None:
            try:
                if handler(probe, regs, TRAP_HANDLER_EXCEPTION):
                    return
            except Exception as inner:
                self.table.park(inner)
                return
        self.table.park(exc)


class ProbeTable:
    """Address → site. ``sites`` is read directly on the hit path."""

    def __init__(self) -> None:
        self.sites: dict[int, ProbeSite] = {}
        self.pending_error: BaseException | None = None
        # How the target runs a probe's async_handler at a trap (the process target: the
        # same event its records make, built from the live thread); None: not at a trap.
        self.run_async: Callable[[Kprobe, Any], None] | None = None

    def get(self, addr: int) -> ProbeSite | None:
        return self.sites.get(addr)

    def add(self, site: ProbeSite) -> None:
        self.sites[site.addr] = site

    def remove(self, site: ProbeSite) -> None:
        del self.sites[site.addr]

    def park(self, exc: BaseException) -> None:
        if self.pending_error is None:
            self.pending_error = exc

    def take_error(self) -> BaseException | None:
        exc, self.pending_error = self.pending_error, None
        return exc

    def __iter__(self) -> Iterator[ProbeSite]:
        return iter(list(self.sites.values()))

    def __len__(self) -> int:
        return len(self.sites)
