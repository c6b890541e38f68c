"""What the Kernel and Uprobes targets share: registering probe events and delivering them.

A probe registered here becomes one tracefs event of the session's group, enabled in the
session's private instance. The mechanism (breakpoints, out-of-line steps, optimization) is the
kernel's; what remains is bookkeeping, done as a straight line and undone in reverse:

    Step 0  refuse an option the kernel's probes cannot honour (``options.py``)
    Step 1  resolve the place (the subclass: kallsyms, or ELF symbols and file offsets)
    Step 2  check it (the subclass: the blacklist) and its fetch-args (the kernel's README)
    Step 3  name the event and compose the line (``lines.probe_line``, the only composer)
    Step 4  write the line; the kernel may refuse it (``TraceFsError`` with error_log)
    Step 5  read the event's format and compile its record decoder
    Step 6  enable it in our instance, unless the probe is registered disabled

Events come back asynchronously (``delivery.py``): ``poll()`` reads every CPU's
``trace_pipe_raw``, decodes the records (``records.py``, with a builder compiled at Step 5),
merges the CPUs by timestamp and hands each ``Event`` to the probe's handler (the kernel's
probes are read-only, as the document says of optimized probes: a handler sees the fetched
values, never live registers):

    Kprobe      async_handler(kp, event), as on every target; pre_handler(kp, event),
                then post_handler(kp, event, 0), called the same way (these probes are
                read-only: no handler here sees live registers)
    Kretprobe   handler(ri, event); ri.task is the thread, ri.ret_addr where it returned to

and to ``sink(event)`` if one was given. A handler that raises is offered to the probe's
``fault_handler(kp, event, TRAP_HANDLER_EXCEPTION)``; if nothing handles it, the batch is
finished and the first such exception is raised out of ``poll()``/``run()``.

Hit and miss counts are the kernel's (``kprobe_profile``/``uprobe_profile``), copied into
``probe.nhit``/``probe.nmissed`` by ``update_counts()`` (``delivery.py``), which ``run()`` and
unregistration call (``lines.profile_counts`` says how rows are matched to our events).
"""

from __future__ import annotations

import builtins
import contextlib
import errno as _errno
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kprobes import lifetime
from kprobes.core.probes import Kprobe, ProbeFlags, args_given
from kprobes.core.retprobes import Jprobe, Kretprobe
from kprobes.core.table import ProbeSite, ProbeTable
from kprobes.errors import ProbeError, ProbeRejected, SpecError, TargetError, TraceFsError
from kprobes.model import Event
from kprobes.spec import (
    Command,
    Location,
    ProbeArg,
    ProbeSpec,
    parse,
    render_arg,
)
from kprobes.tracefs.control import TraceFs
from kprobes.tracefs.delivery import Delivery
from kprobes.tracefs.entryclock import EntryClocks
from kprobes.tracefs.eventformat import EventFormat
from kprobes.tracefs.lines import (
    EVENT_NAME,
    Features,
    event_name_for,
    probe_line,
    removal_line,
)
from kprobes.tracefs.options import check_options
from kprobes.tracefs.points import AnyProbe, ProbePoint, Registration, entry_of, is_comm
from kprobes.tracefs.records import (
    Builder,
    EventPlan,
    Watcher,
    compile_builder,
)
from kprobes.tracefs.ringbuffer import CpuBuffers, PageLayout
from kprobes.tracefs.session import Session
from kprobes.tracefs.tasks import Tasks

Sink = Callable[[Event], None]
_POLL_SLICE = 0.25  # longest sleep in run(): a missed wake-up costs at most this


class TraceTarget(Delivery):
    """The common part of ``Kernel`` and ``Uprobes``; not used directly."""

    events_file = ""  # "kprobe_events" or "uprobe_events"
    profile_file = ""
    is_kernel = False

    def __init__(
        self,
        *,
        group: str | None = None,
        buffer_kb: int = 2048,
        sink: Sink | None = None,
        pid: int | None = None,
        pids: Sequence[int] = (),
    ) -> None:
        self._owner_pid = os.getpid()
        # The processes whose events are kept (``pid=``, or several: ``pids=``), the first
        # the one whose files name the probes' places (Uprobes).
        self.pids: tuple[int, ...] = tuple(pids) or (() if pid is None else (pid,))
        self.pid = self.pids[0] if self.pids else None
        self._pidfds: builtins.list[int] = []
        self._exited = False
        for one in self.pids:
            try:
                self._pidfds.append(os.pidfd_open(one))
            except OSError as exc:
                self._close_pidfd()
                raise TargetError(f"no process {one}: {exc.strerror}", errno=exc.errno) from exc
        try:
            self.fs = TraceFs.open()
            self._check_available()
            self.features = Features.from_readme(self.fs.read("README"))
            self.session = Session(self.fs, group=group, buffer_kb=buffer_kb)
        except BaseException:
            self._close_pidfd()
            raise
        lifetime.remember(self)
        try:
            layout = PageLayout.parse(self.session.read("events", "header_page"))
            self._buffers = CpuBuffers(self.session.instance_dir, layout)
        except BaseException:
            self.session.close()
            lifetime.forget(self)
            self._close_pidfd()
            raise
        self._layout = layout
        self.sink = sink
        self.lost = 0  # events the kernel dropped (buffer full); -1 added when uncounted
        self._table = ProbeTable()
        self._by_id: dict[int, Registration] = {}
        self._by_probe: dict[int, Registration] = {}
        self.tasks = Tasks(self.fs)
        self._places: dict[int, str] = {}
        # Pages read per CPU at each ``poll()``: a batch is delivered whole, so this bounds
        # how long a ``run(timeout)`` may overrun when the reader lags (the command line
        # makes it small: cli/backends.py).
        self.pages_per_read = 256
        # Records of other events enabled in our instance (common_type → handler(page, start)).
        self._watchers: dict[int, Watcher] = {}
        self._builders: dict[int, Builder] = {}  # common_type → builder, for decode_pages
        self._lookups = self._make_lookups()
        self._clocks = EntryClocks()  # of return probes placed with entry_times
        self.attach_stacks = None
        self._undelivered: deque[Event] = deque()  # read, not yet handed over (delivery.py)
        self._stopping = False
        self._pending: BaseException | None = None
        try:
            for one in self.pids:
                self._watchers.update(self.tasks.follow(self.session, one))
        except BaseException:
            self.close()
            raise

    def _close_pidfd(self) -> None:
        fds, self._pidfds = self._pidfds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- subclass hooks ----------------------------------------------------------------------

    def _check_available(self) -> None:
        raise NotImplementedError

    def _resolve(self, probe: Kprobe, *, is_return: bool) -> ProbePoint:
        raise NotImplementedError

    def _check(self, probe: Kprobe, point: ProbePoint) -> None:
        """Refuse a place before the kernel does (the Kernel target: the blacklist)."""

    def _describe(self, addr: int, tid: int) -> str:
        return f"{addr:#x}"

    def _describe_return(self, addr: int, tid: int, func_ip: int, event: str) -> str:
        """``_describe`` for a return address; the return event says more (uprobes.py)."""
        return self._describe(addr, tid)

    def _symbolize(self, addr: int) -> str:
        return f"{addr:#x}"

    def _probe_for_location(self, location: Location, is_return: bool) -> AnyProbe:
        """The probe object for a spec's location (without handlers)."""
        raise NotImplementedError

    def function_names(self, pattern: str) -> builtins.list[tuple[str, ...]]:
        """Places (``[MOD:]NAME``) of the functions matching ``[MOD:]GLOB``, for globs such
        as ``count 'vfs_*'``: one tuple per function, its names at one address (aliases),
        the row's name first (symbols/aliases.py); each name once."""
        raise NotImplementedError

    def _render_args(self, probe: Kprobe, args: Sequence[ProbeArg]) -> tuple[str, ...]:
        """A spec's fetch-args as the words of the line (a target may translate some)."""
        return tuple(render_arg(arg) for arg in args)

    def _accepts(self, tgid: int) -> bool:
        """Whether events of process ``tgid`` (0: unknown, the thread is gone) are wanted.

        With ``pid=`` every thread of the process is known (listed at start, or announced by
        task_newtask): an unknown task that is gone already was a child process.
        """
        return self.pid is None or tgid in self.pids

    def _maxactive(self, rp: Kretprobe) -> int:
        return 0

    # -- names -------------------------------------------------------------------------------

    @property
    def group(self) -> str:
        return self.session.group

    @property
    def instance(self) -> str:
        """The private tracefs instance's name (``instances/<name>``)."""
        return self.session.name

    def get_event_name(self, probe: AnyProbe) -> str | None:
        reg = self._by_probe.get(id(probe))
        return reg.event if reg is not None else None

    def iter_probes(self) -> builtins.list[AnyProbe]:
        return [reg.probe for reg in self._by_probe.values() if not reg.is_hidden]

    # -- registration ------------------------------------------------------------------------

    def register_kprobe(self, kp: Kprobe, args: Sequence[str] = (), *, event: str = "") -> None:
        """Register ``kp`` with fetch-args in the kernel's syntax (``"fd=%di:s32"``), given
        here or as the probe's ``args``, as an event named ``event`` (else the kernel's
        default)."""
        with args_given([(kp, args)]):
            self._register(kp, kp.args, event)

    def register_kprobes(
        self, kps: Sequence[Kprobe], args: Mapping[Kprobe, Sequence[str]] | None = None
    ) -> None:
        """Register every probe or none: a failure unregisters the ones already done."""
        self._register_many(kps, args)

    def unregister_kprobe(self, kp: Kprobe) -> None:
        self._unregister_many([kp])

    def unregister_kprobes(self, kps: Sequence[Kprobe]) -> None:
        self._unregister_many(kps)

    def enable_kprobe(self, kp: Kprobe) -> None:
        self._set_enabled(kp, True)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self._set_enabled(kp, False)

    def register_kretprobe(
        self, rp: Kretprobe, args: Sequence[str] = (), *, event: str = ""
    ) -> None:
        """Register a return probe; fetch-args may use ``$retval``."""
        self._register(rp, tuple(args), event)

    def register_kretprobes(
        self, rps: Sequence[Kretprobe], args: Mapping[Kretprobe, Sequence[str]] | None = None
    ) -> None:
        self._register_many(rps, args)

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        self._unregister_many([rp])

    def unregister_kretprobes(self, rps: Sequence[Kretprobe]) -> None:
        self._unregister_many(rps)

    def enable_kretprobe(self, rp: Kretprobe) -> None:
        self._set_enabled(rp, True)

    def disable_kretprobe(self, rp: Kretprobe) -> None:
        self._set_enabled(rp, False)

    def register_jprobe(self, jp: Jprobe) -> None:
        """Refused (``UnsupportedOption``): a jprobe's entry runs in the probed thread."""
        self.register_jprobes([jp])

    def register_jprobes(self, jps: Sequence[Jprobe]) -> None:
        for jp in jps:
            check_options(type(self).__name__, jp, is_kernel=self.is_kernel)

    def add(self, text: str, handler: Callable[..., Any] | None = None) -> AnyProbe:
        """Register a probe written as a definition line (``"r:vfs_read ret=$retval"``).

        The line is parsed by ``kprobes.spec`` (a ``SpecError`` names the column). The group
        is the session's (naming another one is refused); the event name is the line's, or
        the kernel's default. ``handler`` becomes the Kprobe's ``pre_handler(kp, event)`` or
        the Kretprobe's ``handler(ri, event)``. Returns the probe object.
        """
        spec = parse(text)
        if spec.group is not None and spec.group != self.group:
            raise SpecError(
                f"the event group is this session's ({self.group}), not {spec.group!r}",
                column=text.index(spec.group),
                text=text,
            )
        return self.place_spec(spec, handler)

    def place_spec(
        self,
        spec: ProbeSpec,
        handler: Callable[..., Any] | None = None,
        *,
        entry_times: bool = False,
        disabled: bool = False,
    ) -> AnyProbe:
        """Register the probe ``spec`` describes (its group is ignored: the session's is used).

        ``entry_times=True`` on a return probe also records each call's entry, so that its
        return events carry ``entry_timestamp`` (as the Process target's do): a second,
        hidden event at the function's entry, paired with the returns per thread, newest
        first, as calls nest. ``disabled=True`` registers it disabled (its entry clock too):
        probes placed together are then enabled one right after the other.
        """
        if spec.location is None:
            raise SpecError("a delete command places no probe", column=0, text=str(spec))
        probe = self._probe_for_location(spec.location, spec.is_return)
        if isinstance(probe, Kretprobe):
            probe.handler = handler
            probe.maxactive = spec.maxactive
        else:
            probe.pre_handler = handler
        if disabled:
            entry_of(probe).flags |= ProbeFlags.DISABLED
        args = self._render_args(entry_of(probe), spec.args)
        self._register(probe, args, spec.event or "", default=spec.effective_event)
        if entry_times and isinstance(probe, Kretprobe):
            try:
                self._add_entry_clock(probe)
            except BaseException:
                with contextlib.suppress(ProbeError):
                    self._unregister(probe)
                raise
        return probe

    def _add_entry_clock(self, rp: Kretprobe) -> None:
        ret = self._by_probe[id(rp)]
        entry = Kprobe(symbol=rp.kp.symbol, offset=rp.kp.offset, addr=rp.kp.addr)
        entry.flags |= rp.kp.flags & ProbeFlags.DISABLED
        self._register(entry, (), f"{ret.event}__entry"[:64], hidden=True)
        ret.clock = entry
        self._clocks.add(self._by_probe[id(entry)].event, ret.event)

    def _register_many(
        self, probes: Sequence[AnyProbe], args: Mapping[Any, Sequence[str]] | None
    ) -> None:
        for probe in probes:  # all of them before any is written
            check_options(type(self).__name__, probe, is_kernel=self.is_kernel)
        words = {id(p): tuple((args or {}).get(p, ())) for p in probes}
        kps = [(p, words[id(p)]) for p in probes if isinstance(p, Kprobe)]
        done: list[AnyProbe] = []
        with args_given(kps):
            try:
                for probe in probes:
                    given = probe.args if isinstance(probe, Kprobe) else words[id(probe)]
                    self._register(probe, given, "")
                    done.append(probe)
            except BaseException:
                for probe in reversed(done):
                    with contextlib.suppress(ProbeError):
                        self._unregister(probe)
                raise

    def _register(
        self,
        probe: AnyProbe,
        args: tuple[str, ...],
        event: str,
        *,
        default: str = "",
        hidden: bool = False,
    ) -> None:
        """Steps 0 to 6 of the module docstring, in a straight line; a failure after Step 4
        deletes the line written, and the probe is then not registered."""
        if not self.session.is_open:
            raise TraceFsError("this session is closed", errno=_errno.ESHUTDOWN)
        kp = entry_of(probe)
        if kp.is_registered or id(probe) in self._by_probe:
            raise ProbeRejected(f"{probe!r} is already registered", errno=_errno.EINVAL)
        is_return = isinstance(probe, Kretprobe)
        # Step 0: nothing the kernel cannot do.
        check_options(type(self).__name__, probe, is_kernel=self.is_kernel)
        # Step 1: where.
        point = self._resolve(kp, is_return=is_return)
        # Step 2: may it go there, and does this kernel know its fetch-args?
        self._check(kp, point)
        for arg in args:
            why = self.features.check_arg(arg, is_return=is_return, is_kernel=self.is_kernel)
            if why is not None:
                raise ProbeRejected(f"fetch-arg {arg!r}: {why}", errno=_errno.EINVAL)
        # Step 3: the event's name and line.
        event = self._event_name(event, default, point, is_return)
        maxactive = self._maxactive(probe) if isinstance(probe, Kretprobe) else 0
        command = Command.RETPROBE if is_return else Command.PROBE
        line = probe_line(command, self.group, event, point.place, args, maxactive=maxactive)
        reg = Registration(probe, event, line, point)
        reg.is_hidden = hidden
        # Step 4: the kernel's turn.
        self.fs.append_line(self.events_file, line, owner=self.group)
        try:
            # Step 5: the record layout.
            self._compile_decoder(reg, args, is_return)
            # Step 6: armed in our instance.
            if not kp.is_disabled:
                self.session.set_event_enabled(event, True)
                reg.is_enabled = True
        except BaseException:
            with contextlib.suppress(ProbeError):
                self.fs.append_line(
                    self.events_file, removal_line(self.group, event), owner=self.group
                )
            raise
        self._add_to_tables(reg)

    def _event_name(self, event: str, default: str, point: ProbePoint, is_return: bool) -> str:
        """Step 3's name: the one asked for, else ``default`` if free, else one made from the
        place; a name asked for that is no C identifier or is taken is refused."""
        taken = {reg.event for reg in self._by_probe.values()}
        if event:
            if not EVENT_NAME.match(event) or event in taken:
                raise ProbeRejected(
                    f"event name {event!r} is not a C identifier or is already used",
                    errno=_errno.EEXIST if event in taken else _errno.EINVAL,
                )
            return event
        if default and EVENT_NAME.match(default) and default not in taken:
            return default
        return event_name_for("r" if is_return else "p", point.display, taken)

    def _compile_decoder(self, reg: Registration, args: tuple[str, ...], is_return: bool) -> None:
        """Step 5: ``reg``'s event as the kernel defined it (its format file), and the builder
        that turns its records into ``Event`` values."""
        point = reg.point
        fmt = EventFormat.parse(
            self.fs.read("events", self.group, reg.event, "format"), group=self.group
        )
        reg.id = fmt.id
        reg.arg_names = tuple(f.name for f in fmt.arg_fields)
        reg.arg_types = fmt.arg_types
        reg.comm_index = next((i for i, a in enumerate(args) if is_comm(a)), -1)
        plan = EventPlan(
            group=self.group,
            event=reg.event,
            location="" if is_return else point.describe,
            is_return=is_return,
            func=point.symbol if is_return else "",
            arg_names=reg.arg_names,
            arg_types=reg.arg_types,
            comm_index=reg.comm_index,
        )
        reg.build = compile_builder(fmt, plan, self._lookups)

    def _add_to_tables(self, reg: Registration) -> None:
        """A registered probe's bookkeeping: its site, its counts from zero, and the tables
        that find it by probe and its records by event id."""
        probe, point, build = reg.probe, reg.point, reg.build
        assert build is not None  # compiled at Step 5
        kp = entry_of(probe)
        site = ProbeSite(self._table, point.addr, point)
        site.probes.append(kp)
        site.ainsn = reg
        kp.site = site
        kp.addr = point.addr
        kp.location = point
        kp.nhit = kp.nmissed = 0
        kp.flags &= ~ProbeFlags.GONE
        if isinstance(probe, Kretprobe):
            probe.nhit = probe.nmissed = 0
        self._by_id[reg.id] = reg
        self._by_probe[id(probe)] = reg
        self._builders[reg.id] = build

    def _unregister_many(self, probes: Iterable[AnyProbe]) -> None:
        probes = list(probes)
        with contextlib.suppress(ProbeError):
            self.update_counts()
        first: ProbeError | None = None
        for probe in probes:
            try:
                self._unregister(probe)
            except ProbeError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _unregister(self, probe: AnyProbe) -> None:
        reg = self._by_probe.get(id(probe))
        if reg is None:
            raise ProbeRejected(f"{probe!r} is not registered here", errno=_errno.ENOENT)
        if reg.clock is not None:
            clock, reg.clock = reg.clock, None
            self._unregister(clock)
            self._clocks.remove(reg.event)
        # In reverse: disable in our instance, then delete the definition.
        if reg.is_enabled and self.session.is_open:
            self.session.set_event_enabled(reg.event, False)
            reg.is_enabled = False
        del self._by_probe[id(probe)]
        self._by_id.pop(reg.id, None)
        self._builders.pop(reg.id, None)
        kp = entry_of(probe)
        kp.site = None
        if self.session.is_open:
            self.fs.append_line(
                self.events_file, removal_line(self.group, reg.event), owner=self.group
            )

    def _set_enabled(self, probe: AnyProbe, value: bool) -> None:
        reg = self._by_probe.get(id(probe))
        kp = entry_of(probe)
        if reg is not None and reg.clock is not None:
            self._set_enabled(reg.clock, value)
        if reg is None:
            # Not registered: only the flag, which registration reads.
            kp.flags = kp.flags & ~ProbeFlags.DISABLED if value else kp.flags | ProbeFlags.DISABLED
            return
        if reg.is_enabled != value:
            self.session.set_event_enabled(reg.event, value)
            reg.is_enabled = value
        kp.flags = kp.flags & ~ProbeFlags.DISABLED if value else kp.flags | ProbeFlags.DISABLED

    # -- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every event and the instance; idempotent, and run on every way out."""
        if not self.session.is_open:
            return
        with contextlib.suppress(ProbeError):
            self.update_counts()
        self._buffers.close()
        try:
            self.session.close()
        finally:
            for reg in self._by_probe.values():
                entry_of(reg.probe).site = None
            self._by_probe.clear()
            self._by_id.clear()
            self._builders.clear()
            lifetime.forget(self)
            self._close_pidfd()
            self._after_close()

    def _after_close(self) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A target dropped without close(): remove its events now rather than at exit (not
        # in a forked child, which shares the parent's session but does not own it).
        with contextlib.suppress(Exception):
            if hasattr(self, "_buffers") and os.getpid() == self._owner_pid:
                self.close()
