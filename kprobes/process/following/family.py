"""Followed children that exec: a process of the family, with an image of its own.

A followed fork child shares its parent's image (the same code at the same addresses), so
the parent's probes and tracer serve it (tracee.py). Once it execs, nothing is shared any
more: its code, its libraries, its addresses are its own, as are the rescue, the out-of-line
pages and the trampoline it needs. So it becomes a ``Process`` of its own, a *member* of the
family of the process the user holds (the *root*), adopted at its exec event:

- the root's tracer lets go of the child's threads without detaching them (they stay traced
  by this tool: a ptrace relationship belongs to the tracing thread, not to a Tracer object),
  and the member's tracer takes them, stopped at the exec (``Process`` builds the member:
  ``target.py``'s ``_adopt``; this module keeps the family's books);
- at the exit of ``execve`` (pending.py's new image) the member gets its probes:
  ``on_new_process(member)`` registers what the user wants there. By default, a copy of each
  of the root's probes given by symbol, whose handlers are the root's: the counts and the
  handlers the user holds see every process of the tree, as the kernel's uprobes (one per
  file) would. A probe line the root's ``add()`` placed is added again in the member, so
  that its events are made of the member (its pid, its memory); its hits count there;
- the root's ``run()`` drives the members' stops (``Lifecycle.pump_family``), ``detach()``
  lets every member go first, and a member's own children are adopted into the same family.

Rejected: one tracer for every image (its probe table, breakpoints and slots are per
address space; keying them all by process would slow every hit of the common case, a
single image), and following children by attaching a new session from another thread (a
tracee's stops are reported to the thread that traces it: one loop must see them all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe, KretprobeInstance
from kprobes.errors import ProbeError


class Member(Protocol):
    """What the family needs of each of its processes (a ``Process``)."""

    @property
    def pid(self) -> int: ...

    @property
    def is_attached(self) -> bool: ...

    @property
    def family(self) -> Family: ...

    def iter_probes(self) -> Iterable[Kprobe]: ...
    def get_event_name(self, probe: Kprobe) -> str | None: ...
    def added_lines(self) -> list[tuple[Kprobe | Kretprobe, str, Any]]: ...
    def add(self, text: str, handler: Any = None) -> Kprobe | Kretprobe: ...
    def register_kprobes(
        self,
        kps: Sequence[Kprobe],
        args: Mapping[Kprobe, Sequence[str]] | None = None,
        *,
        events: Mapping[Kprobe, str] | None = None,
    ) -> None: ...
    def register_kretprobes(self, rps: Sequence[Kretprobe]) -> None: ...
    def unregister_kprobes(self, kps: Sequence[Kprobe]) -> None: ...
    def unregister_kretprobes(self, rps: Sequence[Kretprobe]) -> None: ...
    def close(self) -> None: ...


NewProcessHook = Callable[[Any], None]  # on_new_process(member), member a Process


class Family:
    """The members of a followed process tree: held by the root, and by every member."""

    def __init__(self, root: Member) -> None:
        self.root = root
        self.members: list[Member] = []  # the members still traced
        self.on_new_process: NewProcessHook = copy_root_probes
        self._copies: dict[int, list[tuple[Member, Kprobe | Kretprobe]]] = {}

    def welcome(self, member: Member, on_notice: Callable[[str], None]) -> Callable[[], None]:
        """``member`` joins: what to run at its first image (``on_new_process``, once)."""
        self.members.append(member)
        hook = self.on_new_process

        def first_image() -> None:
            try:
                hook(member)
            except ProbeError as exc:
                on_notice(f"process {member.pid}: its probes could not be placed: {exc}")

        return first_image

    def join(self, member: Member) -> None:
        """``member`` joins with the probes it has (a process attached beside the root:
        ``attach(beside=...)``); ``on_new_process`` is not called for it."""
        self.members.append(member)

    def leave(self, member: Member) -> None:
        """``member`` exited: nothing of it is traced any more (a long run may start
        thousands of them: the family keeps the live ones)."""
        if member in self.members:
            self.members.remove(member)
        for copies in self._copies.values():
            copies[:] = [(m, c) for m, c in copies if m is not member]

    def copy(self, member: Member, original: Kprobe | Kretprobe, copy: Kprobe | Kretprobe) -> None:
        """``copy`` stands for ``original`` in ``member`` (and goes when it is unregistered)."""
        self._copies.setdefault(id(original), []).append((member, copy))

    def unregister_copies(self, originals: Sequence[Kprobe] | Sequence[Kretprobe]) -> None:
        """The root's probes are unregistered: so are their copies in the members."""
        for original in originals:
            for member, copy in self._copies.pop(id(original), []):
                if not member.is_attached:
                    continue
                with contextlib.suppress(ProbeError):
                    if isinstance(copy, Kretprobe):
                        member.unregister_kretprobes([copy])
                    else:
                        member.unregister_kprobes([copy])

    def close_members(self) -> None:
        for member in self.members:
            with contextlib.suppress(ProbeError, OSError):
                member.close()


def copy_root_probes(member: Member) -> None:
    """The default ``on_new_process``: the root's probes given by symbol, in ``member``, with
    the root's handlers (and counts)."""
    family = member.family
    kps: list[Kprobe] = []
    rps: list[Kretprobe] = []
    events: dict[Kprobe, str] = {}  # the events of an async_handler keep their name
    lines = family.root.added_lines()
    of_lines = {id(p.kp if isinstance(p, Kretprobe) else p) for p, _, _ in lines}
    for probe in list(family.root.iter_probes()):
        owner = probe.owner
        if probe.symbol is None or id(probe) in of_lines:
            continue  # an address means nothing in another image; a line is added again
        if isinstance(owner, Kretprobe):
            rps.append(_kretprobe_copy(owner))
            family.copy(member, owner, rps[-1])
        elif owner is None:  # a jprobe's arguments are bound to the root's image: not copied
            kps.append(_kprobe_copy(probe))
            family.copy(member, probe, kps[-1])
            name = family.root.get_event_name(probe)
            if name is not None:
                events[kps[-1]] = name
    if kps:
        member.register_kprobes(kps, events=events)
    if rps:
        member.register_kretprobes(rps)
    for original, text, handler in lines:  # its events made of the member, not the root
        family.copy(member, original, member.add(text, _line_handler(original, handler)))


def _line_handler(original: Kprobe | Kretprobe, handler: Any) -> Any:
    """A probe line's handler in a member: an entry's is called with the root's probe, as
    the copies' are; a return's with the member's instance."""
    if handler is None or isinstance(original, Kretprobe):
        return handler
    return lambda _copy, event: handler(original, event)


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
