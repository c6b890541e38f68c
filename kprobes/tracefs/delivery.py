"""Delivering what the kernel recorded: its counts, and the events of our instance.

Events come back asynchronously: ``poll()`` reads every CPU's ``trace_pipe_raw``, decodes the
records with the builders compiled at registration (``records.py``), merges the CPUs by
timestamp and hands each ``Event`` to its probe's handler, then to the sink. Reading a page
consumes it, so no signal's exception may come between the read and the decoded events being
kept: those signals are held for that moment, and the events wait in ``_undelivered`` until
each is handed over (an exception from a handler, or Ctrl-C's, leaves the rest for the next
``poll()``: the ending's reading delivers them). ``run()`` polls
until ``stop()``, the end of a ``pid=`` target's process, or a timeout. Hit and miss counts
are the kernel's (``kprobe_profile``/``uprobe_profile``), copied into the probes by
``update_counts()``.

``Delivery`` is a part of ``TraceTarget`` (target.py), kept apart as a mechanism of its own.
"""

from __future__ import annotations

import builtins
import contextlib
import select
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kprobes.core.probes import TRAP_HANDLER_EXCEPTION, ProbeFlags
from kprobes.core.retprobes import Kretprobe, KretprobeInstance, Task
from kprobes.errors import ProbeError
from kprobes.model import Event
from kprobes.tracefs.lines import profile_counts
from kprobes.tracefs.points import AnyProbe, Registration, entry_of
from kprobes.tracefs.records import Builder, Lookups, Watcher, WhoEntry, decode_pages

if TYPE_CHECKING:
    from kprobes.tracefs.control import TraceFs
    from kprobes.tracefs.entryclock import EntryClocks
    from kprobes.tracefs.ringbuffer import CpuBuffers, PageLayout
    from kprobes.tracefs.session import Session
    from kprobes.tracefs.tasks import Tasks
    from kprobes.tracefs.userstacks import Pairing

_POLL_SLICE = 0.25  # longest sleep in run(): a missed wake-up costs at most this
# The signals whose Python handlers may raise (the command line's SIGINT, SIGTERM, SIGHUP and
# its re-check timer): held while pages are read and decoded.
_HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM})


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold the signals that may raise: one that comes is handled once the block is left."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Delivery:
    """Counts and events, for ``TraceTarget``."""

    events_file: str
    profile_file: str
    fs: TraceFs
    session: Session
    tasks: Tasks
    sink: Callable[[Event], None] | None
    lost: int
    _by_id: dict[int, Registration]
    _by_probe: dict[int, Registration]
    _places: dict[int, str]
    _buffers: CpuBuffers
    _layout: PageLayout
    _builders: dict[int, Builder]
    _watchers: dict[int, Watcher]
    _clocks: EntryClocks
    _stopping: bool
    _pending: BaseException | None
    _undelivered: deque[Event]
    _pidfds: builtins.list[int]
    _exited: bool
    pages_per_read: int
    # Gives the kernel's user stacks to their events (userstacks.py); None: none recorded.
    attach_stacks: Pairing | None

    if TYPE_CHECKING:

        @property
        def group(self) -> str: ...
        def _accepts(self, tgid: int) -> bool: ...
        def _describe(self, addr: int, tid: int) -> str: ...
        def _describe_return(self, addr: int, tid: int, func_ip: int, event: str) -> str: ...
        def _symbolize(self, addr: int) -> str: ...
        def iter_probes(self) -> builtins.list[AnyProbe]: ...

    # -- counts --------------------------------------------------------------------------------

    def _profile_counts(self) -> dict[str, tuple[int, int]]:
        """event name → (hits, misses) of our group's events."""
        for _ in range(3):  # another tool may add or remove an event between the two reads
            defs = list(self.fs.iter_lines(self.events_file))
            rows = list(self.fs.iter_lines(self.profile_file))
            counts = profile_counts(defs, rows, self.group)
            if counts is not None:
                return counts
        return {}

    def update_counts(self) -> None:
        """Copy the kernel's hit and miss counts into each probe's ``nhit``/``nmissed``."""
        if not self._by_probe or not self.session.is_open:
            return
        counts = self._profile_counts()
        for reg in self._by_probe.values():
            hits, misses = counts.get(reg.event, (0, 0))
            probe = reg.probe
            probe.nhit, probe.nmissed = hits, misses
            if isinstance(probe, Kretprobe):
                probe.kp.nhit = hits

    # -- events ----------------------------------------------------------------------------------

    def _make_lookups(self) -> Lookups:
        """The caches and slow paths the builders use; they hold this target only weakly
        (a builder lives in a registration of the target: no reference cycle)."""
        me = weakref.ref(self)

        def who_miss(tid: int) -> WhoEntry:
            target = me()
            assert target is not None, "a builder outlived its target"
            return target.tasks.who(tid, target._accepts)

        def place_miss(ip: int, tid: int, func_ip: int, event: str) -> str:
            target = me()
            assert target is not None, "a builder outlived its target"
            return target._place_miss(ip, tid, func_ip, event)

        def symbolize(addr: int) -> str:
            target = me()
            assert target is not None, "a builder outlived its target"
            return target._symbolize(addr)

        return Lookups(self.tasks.known, who_miss, self._places, place_miss, symbolize)

    def _place_miss(self, ip: int, tid: int, func_ip: int, event: str) -> str:
        """``sym+off/size`` of a return address, the first time it is met (the return
        event ``event`` of the function at ``func_ip`` came back to it)."""
        where = self._describe_return(ip, tid, func_ip, event)
        if len(self._places) < 65536:
            self._places[ip] = where
        return where

    def read_events(self) -> builtins.list[Event]:
        """Every event recorded so far, decoded, oldest first; consumes them (no handlers)."""
        return self.decode_pages(self.read_pages())

    def read_pages(self) -> builtins.list[tuple[int, bytes]]:
        """The ring-buffer pages recorded so far (at most ``pages_per_read`` per CPU), as
        (cpu, page), undecoded; consumes them."""
        return self._buffers.read_pages(self.pages_per_read)

    def decode_pages(
        self, pages: Sequence[tuple[int, bytes]], *, final: bool = True
    ) -> builtins.list[Event]:
        """The events of ``pages`` from ``read_pages()``, oldest first. With user stacks and
        not ``final``, the events that may still get their stack in the next read wait for
        it (userstacks.py: ``Pairing``).

        ``read_events()`` is ``decode_pages(read_pages())``; the benchmark times the halves
        apart, and pages kept aside can be decoded later (by this target: it knows the
        events' formats).
        """
        stacks = self.attach_stacks
        if not pages and (stacks is None or not stacks.is_holding):
            return []
        events, lost = decode_pages(pages, self._layout, self._builders, self._watchers)
        self.lost += lost
        if stacks is not None:  # before any event is dropped or held back
            events = stacks(events, final=final)
        if self.tasks.unsettled:
            events = self.tasks.settle(events, self._accepts)
        if self._clocks:
            events = self._clocks.pair(events)
        return events

    def _dispatch(self, event: Event, reg: Registration) -> None:
        probe = reg.probe
        try:
            if isinstance(probe, Kretprobe):
                if probe.handler is not None:
                    ri = KretprobeInstance(probe)
                    ri.task = Task(event.pid, event.tid)
                    ri.ret_addr = event.ip
                    probe.handler(ri, event)
            else:
                if probe.async_handler is not None:
                    probe.async_handler(probe, event)
                if probe.pre_handler is not None:
                    probe.pre_handler(probe, event)
                if probe.post_handler is not None:
                    probe.post_handler(probe, event, 0)
            if self.sink is not None:
                self.sink(event)
        except Exception as exc:
            failure: Exception = exc
            kp = entry_of(probe)
            if kp.fault_handler is not None:
                try:
                    if kp.fault_handler(kp, event, TRAP_HANDLER_EXCEPTION):
                        return
                except Exception as inner:
                    failure = inner
            if self._pending is None:
                self._pending = failure

    def poll(self, *, final: bool = False, read: bool = True) -> int:
        """Deliver every event recorded so far to the handlers; return how many. Only a
        ``final`` poll (the end of a run) delivers an event whose user stack may still be
        on its way (userstacks.py); with ``read`` False it reads no more pages (only what
        was held back is delivered: ``stop()``)."""
        regs = {reg.event: reg for reg in self._by_id.values()}  # as of the decoding
        undelivered = self._undelivered
        with _signals_held():  # the pages read are consumed: their events must be kept
            pages = self.read_pages() if read else []
            undelivered.extend(self.decode_pages(pages, final=final))
        delivered = 0
        while undelivered:
            event = undelivered.popleft()
            reg = regs.get(event.event)
            if reg is not None:  # a backlog's probe may have gone since
                self._dispatch(event, reg)
                delivered += 1
        pending, self._pending = self._pending, None
        if pending is not None:
            raise pending
        return delivered

    @property
    def undelivered(self) -> int:
        """Events read from the kernel but not handed over yet (left by an exception)."""
        return len(self._undelivered)

    def stop(self) -> None:
        """Make ``run()`` return after the current batch (callable from a handler)."""
        self._stopping = True

    def _extra_fds(self) -> builtins.list[int]:
        return list(self._pidfds)

    def _is_finished(self) -> bool:
        """With ``pid=`` (``pids=``): whether the process (every one) has exited (the
        probes are then ``GONE``)."""
        if not self._pidfds:
            return self._exited
        if not self._exited:
            poller = select.poll()
            for fd in self._pidfds:
                poller.register(fd, select.POLLIN)
            if len(poller.poll(0)) == len(self._pidfds):
                self._exited = True
                for probe in self.iter_probes():
                    entry_of(probe).flags |= ProbeFlags.GONE
        return self._exited

    @property
    def is_alive(self) -> bool:
        """For a ``pid=`` target, whether the process still runs (else always True)."""
        return not self._is_finished()

    def run(self, timeout: float | None = None) -> bool:
        """Deliver events until ``stop()``, the end of the target, or ``timeout`` seconds.

        Returns True when the target finished (the ``pid=`` process exited) or ``stop()`` was
        called, False when the time ran out.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        for fd in (*self._buffers.fds.values(), *self._extra_fds()):
            poller.register(fd, select.POLLIN)
        self._stopping = False
        try:
            while True:
                self.poll()
                if self._stopping:  # after this batch: what it held back, and no more
                    self.poll(final=True, read=False)
                    return True
                if self._is_finished():
                    self.poll(final=True)
                    return True
                wait = _POLL_SLICE
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return False
                poller.poll(wait * 1000)
        finally:
            with contextlib.suppress(ProbeError):
                self.update_counts()
