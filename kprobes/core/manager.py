"""Register, unregister, enable and disable probes: the generic half of kernel/kprobes.c.

The manager owns the probe table and the global ``enabled`` knob and knows nothing of x86 or
ptrace. Everything machine-specific goes through ``ArchHooks``, shaped like the kernel's
``arch_*`` hooks: resolve and check a location, prepare and remove the per-address state, arm
and disarm. Registration is a straight pipeline undone in reverse on failure; a batch rolls
back the members already registered, as ``register_kprobes()`` does.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from kprobes.core.probes import Kprobe, Location, ProbeFlags
from kprobes.core.table import ProbeSite, ProbeTable
from kprobes.errors import ProbeRejected


class ArchHooks(Protocol):
    """What the manager needs from a target (the kernel's arch_* hooks)."""

    def resolve(self, probe: Kprobe) -> Location:
        """Find the address ``probe`` names (symbol+offset or addr)."""
        ...

    def check(self, probe: Kprobe, location: Location) -> None:
        """Raise ProbeRejected if a probe may not go there (boundary, blacklist)."""
        ...

    def prepare(self, site: ProbeSite) -> None:
        """Decide and build how the instruction at ``site`` runs out of line (site.ainsn)."""
        ...

    def remove(self, site: ProbeSite) -> None:
        """Release what ``prepare`` allocated."""
        ...

    def arm(self, site: ProbeSite) -> None: ...

    def disarm(self, site: ProbeSite) -> None: ...

    def batch(self) -> AbstractContextManager[None]:
        """Hold the target still (every thread stopped) across a group of changes."""
        ...


class ProbeManager:
    def __init__(self, hooks: ArchHooks) -> None:
        self.hooks = hooks
        self.table = ProbeTable()
        self._enabled = True
        self._requested_addr: dict[int, int | None] = {}  # id(probe) → addr the user gave

    # -- registration ------------------------------------------------------------------

    def register(self, probe: Kprobe) -> None:
        with self.hooks.batch():
            self._register(probe)

    def register_many(self, probes: Sequence[Kprobe]) -> None:
        with self.hooks.batch():
            done: list[Kprobe] = []
            try:
                for probe in probes:
                    self._register(probe)
                    done.append(probe)
            except BaseException:
                for probe in reversed(done):
                    self._unregister(probe)
                raise

    def unregister(self, probe: Kprobe) -> None:
        with self.hooks.batch():
            self._unregister(probe)

    def unregister_many(self, probes: Iterable[Kprobe]) -> None:
        with self.hooks.batch():
            for probe in probes:
                self._unregister(probe)

    def _register(self, probe: Kprobe) -> None:
        if probe.is_registered:
            raise ProbeRejected(f"{probe!r} is already registered", errno=errno.EINVAL)
        requested = self._requested_addr.get(id(probe), probe.addr)
        if probe.symbol is not None and requested is not None:
            raise ProbeRejected(
                "give either symbol or addr, not both (register_kprobe returns -EINVAL)",
                errno=errno.EINVAL,
            )
        if probe.symbol is None and requested is None:
            raise ProbeRejected("a probe needs a symbol or an addr", errno=errno.EINVAL)
        if probe.offset < 0:
            raise ProbeRejected(f"negative offset {probe.offset}", errno=errno.EINVAL)
        probe.addr = requested

        # Step 1: resolve the location.  Step 2: check it may be probed.
        try:
            location = self.hooks.resolve(probe)
            self.hooks.check(probe, location)
        except BaseException:
            probe.addr = requested
            raise

        # Step 3: join the site at that address, or prepare a new one.
        site = self.table.get(location.addr)
        if site is None:
            site = ProbeSite(self.table, location.addr, location)
            site.probes.append(probe)
            try:
                self.hooks.prepare(site)
            except BaseException:
                probe.addr = requested
                raise
            self.table.add(site)
        else:
            had_post = site.has_post_handler
            site.probes.append(probe)
            if site.has_post_handler != had_post:
                try:
                    self.hooks.prepare(site)
                except BaseException:
                    site.probes.remove(probe)
                    probe.addr = requested
                    raise

        # Step 4: publish and arm.
        self._requested_addr[id(probe)] = requested
        probe.addr = location.addr
        probe.location = location
        probe.site = site
        probe.flags &= ~ProbeFlags.GONE
        probe.nmissed = 0
        site.refresh()
        self._sync_arming(site)

    def _unregister(self, probe: Kprobe) -> None:
        site = probe.site
        if site is None:
            # The kernel clears addr of a probe it does not know, and reports nothing.
            probe.addr = self._requested_addr.pop(id(probe), None)
            return
        had_post = site.has_post_handler
        site.probes.remove(probe)
        probe.site = None
        probe.addr = self._requested_addr.pop(id(probe), None)
        if probe.symbol is not None:
            probe.addr = None
        if not site.probes:
            if site.is_armed:
                self.hooks.disarm(site)
            self.hooks.remove(site)
            self.table.remove(site)
            return
        if site.has_post_handler != had_post:
            self.hooks.prepare(site)
        site.refresh()
        self._sync_arming(site)

    # -- enable / disable ----------------------------------------------------------------

    def enable(self, probe: Kprobe) -> None:
        self._require_registered(probe)
        with self.hooks.batch():
            probe.flags &= ~ProbeFlags.DISABLED
            assert probe.site is not None
            probe.site.refresh()
            self._sync_arming(probe.site)

    def disable(self, probe: Kprobe) -> None:
        self._require_registered(probe)
        with self.hooks.batch():
            probe.flags |= ProbeFlags.DISABLED
            assert probe.site is not None
            probe.site.refresh()
            self._sync_arming(probe.site)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, value: bool) -> None:
        """The debugfs ``enabled`` knob: arm or disarm everything, keeping each probe's state."""
        with self.hooks.batch():
            self._enabled = bool(value)
            for site in self.table:
                self._sync_arming(site)

    def mark_gone(self) -> None:
        """The code is gone (exec, exit): nothing is armed any more, probes stay registered."""
        for site in self.table:
            site.is_armed = False
            for probe in site.probes:
                probe.flags |= ProbeFlags.GONE

    def iter_probes(self) -> Iterator[Kprobe]:
        for site in self.table:
            yield from site.probes

    def _require_registered(self, probe: Kprobe) -> None:
        if probe.site is None:
            raise ProbeRejected(f"{probe!r} is not registered", errno=errno.EINVAL)

    def _sync_arming(self, site: ProbeSite) -> None:
        gone = any(p.is_gone for p in site.probes)
        want = self._enabled and site.is_enabled and not gone
        if want and not site.is_armed:
            self.hooks.arm(site)
            site.is_armed = True
        elif not want and site.is_armed:
            self.hooks.disarm(site)
            site.is_armed = False
