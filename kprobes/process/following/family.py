"""Followed children that exec: a process of the family, with an image of its own.

A followed fork child shares its parent's image (the same code at the same addresses), so
the parent's probes and tracer serve it (tracee.py). Once it execs, nothing is shared any
more: its code, its libraries, its addresses are its own, as are the rescue, the out-of-line
pages and the trampoline it needs. So it becomes a ``Process`` of its own, a *member* of the
family of the process the user holds (the *root*), adopted at its exec event:

- the root's tracer lets go of the child's threads without detaching them (they stay traced
  by this tool: a ptrace relationship belongs to the tracing thread, not to a Tracer object),
  and the member's tracer takes them, stopped at the exec;
- at the exit of ``execve`` (pending.py's new image) the member gets its probes:
  ``on_new_process(member)`` registers what the user wants there. By default, a copy of each
  of the root's probes given by symbol, whose handlers are the root's: the counts and the
  handlers the user holds see every process of the tree, as the kernel's uprobes (one per
  file) would;
- the root's ``run()`` drives the members' stops (``Tracer._pump_family``), ``detach()``
  lets every member go first, and a member's own children are adopted into the same family.

Rejected: one tracer for every image (its probe table, breakpoints and slots are per
address space; keying them all by process would slow every hit of the common case, a
single image), and following children by attaching a new session from another thread (a
tracee's stops are reported to the thread that traces it: one loop must see them all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe, KretprobeInstance
from kprobes.errors import ProbeError
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.tracee import Tracee, TraceeKind
from kprobes.process.survival import cleanup

if TYPE_CHECKING:
    from kprobes.core.manager import ProbeManager
    from kprobes.process.engine.tracer import Tracer
    from kprobes.process.target import Process

NewProcessHook = Callable[["Process"], None]


class Family:
    """The members of a followed process tree, for ``Process`` (the root holds them)."""

    pid: int
    follow_forks: bool
    _tracer: Tracer
    _manager: ProbeManager

    if TYPE_CHECKING:

        def register_kprobes(self, kps: list[Kprobe]) -> None: ...
        def register_kretprobes(self, rps: list[Kretprobe]) -> None: ...
        def unregister_kprobes(self, kps: list[Kprobe]) -> None: ...
        def unregister_kretprobes(self, rps: list[Kretprobe]) -> None: ...
        def close(self) -> None: ...
        def on_notice(self, message: str) -> None: ...
        def _finish(self) -> None: ...
        def _publish(self) -> None: ...

    def _init_family(self) -> None:
        self._root: Process | None = None  # None: this is the root
        self.members: list[Process] = []  # (on the root) the members still traced
        self.on_new_process: NewProcessHook = _copy_root_probes
        self._first_image_hook: Callable[[], None] | None = None
        self._copies: dict[int, list[tuple[Process, Kprobe | Kretprobe]]] = {}
        self._tracer.on_child_exec = self._adopt

    @property
    def root(self) -> Process:
        """The process the user holds, at the top of the family."""
        return self._root if self._root is not None else self  # type: ignore[return-value]

    # -- adoption ---------------------------------------------------------------------------

    def _adopt(self, tracee: Tracee, t: Thread) -> bool:
        """A followed child of ours has exec'd (``t`` is at its exec event): it becomes a
        member with a tracer and an image of its own."""
        from kprobes.process.target import Process  # a part of Process: imported late

        root = self.root
        pid = tracee.pid
        self._tracer.drop_tracee(tracee)  # still traced by us; the member takes it over
        member = Process(pid, follow_forks=True, pending=True)
        member._root = root
        member.on_notice = root.on_notice
        member.on_new_process = root.on_new_process
        tracer = member._tracer
        tracer.on_gone = member._member_gone
        tracer.placement = root._tracer.placement  # one tool, one CPU for the whole family
        main = tracer.add_tracee(pid, TraceeKind.MAIN)
        thread = tracer.add_thread(main, t.tid, ThreadState.STOPPED)
        thread.event_stopped = True
        thread.exec_landing = True  # its probes at the exit of execve (pending.py)
        thread.trace_syscalls(True)
        hook = root.on_new_process
        member._first_image_hook = lambda: hook(member)
        root.members.append(member)
        root._tracer.family.append(tracer)
        cleanup.remember(member)
        thread.resume()
        return True

    def _member_gone(self) -> None:
        """A member's probes are gone: it exec'd again (published anew), or it exited
        (finished: nothing of it is traced any more)."""
        if self._tracer.main is None:
            self._finish()
            root = self.root
            if self in root.members:  # a long run may start thousands: keep the live ones
                root.members.remove(self)
            for copies in root._copies.values():
                copies[:] = [(m, c) for m, c in copies if m is not self]
        else:
            self._publish()

    def _take_first_image_hook(self) -> None:
        """Run ``on_new_process`` for this member, once, at its first image."""
        hook, self._first_image_hook = self._first_image_hook, None
        if hook is None:
            return
        try:
            hook()
        except ProbeError as exc:
            self.on_notice(f"process {self.pid}: its probes could not be placed: {exc}")

    def _copy(self, original: Kprobe | Kretprobe, copy: Kprobe | Kretprobe) -> None:
        """``copy`` stands for ``original`` in a member (and goes when it is unregistered)."""
        self.root._copies.setdefault(id(original), []).append((self, copy))  # type: ignore[arg-type]

    # -- the root's probes, in the members ------------------------------------------------

    def _unregister_copies(self, originals: list[Kprobe] | list[Kretprobe]) -> None:
        """The root's probes are unregistered: so are their copies in the members."""
        for original in originals:
            for member, copy in self.root._copies.pop(id(original), []):
                if not member._attached:
                    continue
                with contextlib.suppress(ProbeError):
                    if isinstance(copy, Kretprobe):
                        member.unregister_kretprobes([copy])
                    else:
                        member.unregister_kprobes([copy])

    def _detach_members(self) -> None:
        for member in self.members:
            with contextlib.suppress(ProbeError, OSError):
                member.close()
        self._tracer.family.clear()


def _copy_root_probes(member: Process) -> None:
    """The default ``on_new_process``: the root's probes given by symbol, in ``member``, with
    the root's handlers (and counts)."""
    root = member.root
    kps: list[Kprobe] = []
    rps: list[Kretprobe] = []
    for probe in list(root._manager.iter_probes()):
        owner = probe.owner
        if probe.symbol is None:
            continue  # an address means nothing in another image; nor do internal probes
        if isinstance(owner, Kretprobe):
            rps.append(_kretprobe_copy(owner))
            member._copy(owner, rps[-1])
        elif owner is None:  # a jprobe's arguments are bound to the root's image: not copied
            kps.append(_kprobe_copy(probe))
            member._copy(probe, kps[-1])
    if kps:
        member.register_kprobes(kps)
    if rps:
        member.register_kretprobes(rps)


class _Copy(Kprobe):
    """A root's probe in a member: the same options, handlers called with the original, and
    every hit and miss counted on the original too (``nhit``/``nmissed`` pass their changes
    on), so that an optimized count or record probe stays one in the member."""

    def __init__(self, original: Kprobe, **options: Any) -> None:
        self._original = original
        self._hits = self._misses = 0
        super().__init__(**options)

    @property
    def nhit(self) -> int:
        return self._hits

    @nhit.setter
    def nhit(self, value: int) -> None:
        self._original.nhit += value - self._hits
        self._hits = value

    @property
    def nmissed(self) -> int:
        return self._misses

    @nmissed.setter
    def nmissed(self, value: int) -> None:
        self._original.nmissed += value - self._misses
        self._misses = value


def _kprobe_copy(kp: Kprobe) -> Kprobe:
    def pre(_copy: Kprobe, regs: Any) -> Any:
        assert kp.pre_handler is not None
        return kp.pre_handler(kp, regs)

    def post(_copy: Kprobe, regs: Any, flags: int) -> None:
        assert kp.post_handler is not None
        kp.post_handler(kp, regs, flags)

    def fault(_copy: Kprobe, regs: Any, trapnr: int) -> Any:
        assert kp.fault_handler is not None
        return kp.fault_handler(kp, regs, trapnr)

    def on_record(_copy: Kprobe, hit: Any) -> None:
        assert kp.async_handler is not None
        kp.async_handler(kp, hit)

    return _Copy(
        kp,
        symbol=kp.symbol,
        offset=kp.offset,
        pre_handler=pre if kp.pre_handler is not None else None,
        post_handler=post if kp.post_handler is not None else None,
        fault_handler=fault if kp.fault_handler is not None else None,
        disabled=kp.is_disabled,
        optimize=kp.optimize,
        async_handler=on_record if kp.async_handler is not None else None,
        args=kp.args,
    )


def _kretprobe_copy(rp: Kretprobe) -> Kretprobe:
    def handler(ri: KretprobeInstance, regs: Any) -> Any:
        rp.nhit += 1
        return rp.handler(ri, regs) if rp.handler is not None else None

    def entry(ri: KretprobeInstance, regs: Any) -> Any:
        return rp.entry_handler(ri, regs) if rp.entry_handler is not None else None

    return Kretprobe(
        symbol=rp.kp.symbol,
        offset=rp.kp.offset,
        handler=handler,
        entry_handler=entry if rp.entry_handler is not None else None,
        maxactive=rp.maxactive,
        data_size=rp.data_size,
    )
