"""Register, unregister, enable and disable probes: the generic half of kernel/kprobes.c.

The manager owns the probe table and the global ``enabled`` knob and knows nothing of x86 or
ptrace. Everything machine-specific goes through ``ArchHooks``, shaped like the kernel's
``arch_*`` hooks: resolve and check a location, prepare and remove the per-address state, arm
and disarm. Registration is a straight pipeline undone in reverse on failure; a batch rolls
back the members already registered, as ``register_kprobes()`` does.

Pending probes. A target that follows a program (``allow_pending``) accepts a probe on a
library the program has not mapped yet: the probe is registered with no site and waits in
``pending``. The target calls ``resolve_pending()`` when the program maps code and
``unmap()`` when code goes (dlclose, exec); a probe in unmapped code waits again, ``GONE``
until its library comes back. A probe given by address never comes back: the kernel's
``kprobe_gone()`` for code that was unloaded. Rejected: making every target poll for its
libraries; the target knows when the program maps code, the manager only decides what that
means for each probe.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from kprobes.core.probes import Kprobe, Location, ProbeFlags
from kprobes.core.table import ProbeSite, ProbeTable
from kprobes.errors import NotMapped, ProbeRejected


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

    def drop(self, site: ProbeSite) -> None:
        """The code under ``site`` was unmapped: forget its patch without writing anything."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """Hold the target still (every thread stopped) across a group of changes."""
        ...


class ProbeManager:
    def __init__(self, hooks: ArchHooks) -> None:
        self.hooks = hooks
        self.table = ProbeTable()
        self._enabled = True
        self._requested_addr: dict[int, int | None] = {}  # id(probe) → addr the user gave
        self.allow_pending = False  # a probe on a library not mapped yet waits for it
        self.pending: list[Kprobe] = []  # registered, no site: waiting for their library

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
        except NotMapped:
            probe.addr = requested
            if not self.allow_pending or probe.symbol is None:
                raise
            self._requested_addr[id(probe)] = requested
            probe.addr = None
            probe.flags |= ProbeFlags.PENDING
            probe.nmissed = 0
            self.pending.append(probe)
            return
        except BaseException:
            probe.addr = requested
            raise
        self._place(probe, location, requested)

    def _place(self, probe: Kprobe, location: Location, requested: int | None) -> None:
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
        if not probe.is_pending:
            probe.nmissed = 0
        probe.flags &= ~(ProbeFlags.GONE | ProbeFlags.PENDING)
        site.refresh()
        self._sync_arming(site)

    def _unregister(self, probe: Kprobe) -> None:
        site = probe.site
        if probe.is_pending:
            self.pending.remove(probe)
            probe.flags &= ~(ProbeFlags.PENDING | ProbeFlags.GONE)
            probe.addr = self._requested_addr.pop(id(probe), None)
            return
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
        if probe.is_pending:
            probe.flags &= ~ProbeFlags.DISABLED
            return
        with self.hooks.batch():
            probe.flags &= ~ProbeFlags.DISABLED
            assert probe.site is not None
            probe.site.refresh()
            self._sync_arming(probe.site)

    def disable(self, probe: Kprobe) -> None:
        self._require_registered(probe)
        if probe.is_pending:
            probe.flags |= ProbeFlags.DISABLED
            return
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

    def requested_addr(self, probe: Kprobe) -> int | None:
        """The address the user gave a registered probe (None if it was given by symbol)."""
        return self._requested_addr.get(id(probe))

    def iter_probes(self) -> Iterator[Kprobe]:
        for site in self.table:
            yield from site.probes
        yield from self.pending

    # -- code that comes and goes ---------------------------------------------------------

    def resolve_pending(self) -> list[tuple[Kprobe, ProbeRejected]]:
        """Place every pending probe whose library is mapped now. Returns the probes whose
        library is there but which cannot be placed in it, each with why; they keep waiting
        (another file of that name may come)."""
        failed: list[tuple[Kprobe, ProbeRejected]] = []
        waiting = [p for p in self.pending if p.symbol is not None]
        if not waiting:
            return failed
        with self.hooks.batch():
            for probe in waiting:
                try:
                    location = self.hooks.resolve(probe)
                    self.hooks.check(probe, location)
                except NotMapped:
                    continue
                except ProbeRejected as exc:
                    failed.append((probe, exc))
                    continue
                self.pending.remove(probe)
                try:
                    self._place(probe, location, self._requested_addr.get(id(probe)))
                except ProbeRejected as exc:
                    probe.site = None
                    probe.addr = None
                    probe.flags |= ProbeFlags.PENDING
                    self.pending.append(probe)
                    failed.append((probe, exc))
        return failed

    def unmap(self, is_unmapped: Callable[[ProbeSite], bool]) -> list[Kprobe]:
        """The code of some sites was unmapped (dlclose, exec): nothing of ours is there to
        undo. Their probes wait again, ``GONE``; those given by address for good. Returns
        the probes that left their sites."""
        moved: list[Kprobe] = []
        for site in [s for s in self.table if is_unmapped(s)]:
            self.hooks.drop(site)
            site.is_armed = False
            self.hooks.remove(site)
            self.table.remove(site)
            for probe in site.probes:
                probe.site = None
                probe.addr = None
                probe.flags |= ProbeFlags.GONE | ProbeFlags.PENDING
                self.pending.append(probe)
                moved.append(probe)
        return moved

    def _require_registered(self, probe: Kprobe) -> None:
        if probe.site is None and not probe.is_pending:
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
