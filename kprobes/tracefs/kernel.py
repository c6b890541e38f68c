"""The Kernel target: the kernel's own kprobes on kernel functions, through ``kprobe_events``.

    with kprobes.Kernel() as k:
        k.register_kretprobe(Kretprobe(symbol="vfs_read", handler=h), ["ret=$retval:s64"])
        k.add("p:do_sys_openat2 dfd=%di:s32 name=+0(%si):string", on_open)
        k.run(timeout=5)

The probes are the kernel's, armed by enabling their events in this session's instance; the
Python side sees decoded events, after the fact. Before a line is written, the place is
checked here so that the common mistakes get a sentence instead of an errno: a function that
is not in kallsyms (ENOENT), a name shared by several functions (the kernel refuses those
too), and an address in the kernel's kprobes blacklist (``Blacklisted``, with the range and
the function it belongs to) — the kernel would answer EINVAL with no reason at all.

On a kernel built without CONFIG_KPROBES (or without CONFIG_KPROBE_EVENTS) there is no
``kprobe_events`` file, and ``Kernel()`` raises ``TargetError`` saying so and naming what this
machine can do instead: ``Uprobes`` (the kernel's uprobes, when it has them) and ``Process``.
"""

from __future__ import annotations

import builtins
import errno as _errno
import os
import platform
from collections.abc import Sequence

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import Blacklisted, ProbeError, ProbeRejected, TargetError
from kprobes.model import BlacklistEntry, ProbeListing
from kprobes.spec import AddressLocation, Location, SymbolLocation, render_location
from kprobes.symbols.aliases import group_aliases
from kprobes.symbols.kallsyms import Kallsyms
from kprobes.tracefs.control import TraceFs, find_debugfs
from kprobes.tracefs.debugfs import KprobesKnobs
from kprobes.tracefs.lines import MAXACTIVE_MAX, kernel_location
from kprobes.tracefs.points import AnyProbe, ProbePoint
from kprobes.tracefs.target import Sink, TraceTarget


def _unavailable_reason(tracefs_root: str) -> str:
    release = platform.release()
    debugfs = find_debugfs()
    has_kprobes = bool(debugfs) and os.path.isdir(os.path.join(debugfs or "", "kprobes"))
    instead = (
        "the Uprobes target (the kernel's uprobes on user programs)"
        if os.path.exists(os.path.join(tracefs_root, "uprobe_events"))
        else "no kernel-assisted target"
    )
    missing = "CONFIG_KPROBE_EVENTS" if has_kprobes else "CONFIG_KPROBES"
    return (
        f"this kernel ({release}) was built without {missing}: it has no kprobe_events, so "
        f"kernel functions cannot be probed here; available instead: {instead} and the "
        "Process target (our own kprobes on a live process, over ptrace)"
    )


def list_kprobes() -> builtins.list[ProbeListing]:
    """``/sys/kernel/debug/kprobes/list``: every kprobe on the system, without a session."""
    try:
        return KprobesKnobs().list()
    except TargetError as exc:
        try:
            fs = TraceFs.open()
        except ProbeError:
            raise exc from None
        if not fs.exists("kprobe_events"):
            raise TargetError(_unavailable_reason(fs.root), errno=_errno.ENOSYS) from exc
        raise


class Kernel(TraceTarget):
    """Kprobes and kretprobes on the running kernel (root, CONFIG_KPROBE_EVENTS)."""

    events_file = "kprobe_events"
    profile_file = "kprobe_profile"
    is_kernel = True

    def __init__(
        self,
        *,
        pid: int | None = None,
        pids: Sequence[int] = (),
        group: str | None = None,
        buffer_kb: int = 2048,
        sink: Sink | None = None,
    ) -> None:
        """``pid=`` keeps only the events of that process's threads (the instance's
        ``set_event_pid``, as ``perf -p``), and ``run()`` returns when it exits; ``pids=``
        those of several processes, and ``run()`` returns when every one has exited."""
        self._kallsyms: Kallsyms | None = None
        self._blacklist: builtins.list[BlacklistEntry] | None = None
        super().__init__(group=group, buffer_kb=buffer_kb, sink=sink, pid=pid, pids=pids)

    def _check_available(self) -> None:
        if not self.fs.exists("kprobe_events"):
            raise TargetError(_unavailable_reason(self.fs.root), errno=_errno.ENOSYS)
        self.knobs = KprobesKnobs()

    @staticmethod
    def require() -> None:
        """Raise what ``Kernel()`` would about a kernel without kprobe events (or without
        tracefs, or without root): for a caller about to start a command for it."""
        fs = TraceFs.open()
        if not fs.exists("kprobe_events"):
            raise TargetError(_unavailable_reason(fs.root), errno=_errno.ENOSYS)

    # -- Appendix A and B --------------------------------------------------------------------

    def list(self) -> builtins.list[ProbeListing]:
        """Every kprobe on the system (``/sys/kernel/debug/kprobes/list``), ours and others'."""
        return self.knobs.list()

    def list_mine(self) -> builtins.list[ProbeListing]:
        """The entries of ``list()`` at this session's probe addresses."""
        addrs = {reg.point.addr for reg in self._by_probe.values()}
        return [entry for entry in self.list() if entry.addr in addrs]

    def blacklist(self) -> builtins.list[BlacklistEntry]:
        """``/sys/kernel/debug/kprobes/blacklist``: the ranges the kernel refuses to probe."""
        if self._blacklist is None:
            self._blacklist = self.knobs.blacklist()
        return list(self._blacklist)

    @property
    def enabled(self) -> bool:
        """``kprobes/enabled``: False disarms every kprobe of the system, keeping their states."""
        return self.knobs.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.knobs.enabled = value

    @property
    def optimization(self) -> bool:
        """``debug.kprobes-optimization``: False unoptimizes every optimized probe."""
        return self.knobs.optimization

    @optimization.setter
    def optimization(self, value: bool) -> None:
        self.knobs.optimization = value

    def _after_close(self) -> None:
        knobs = getattr(self, "knobs", None)
        if knobs is not None:
            knobs.restore()

    # -- places --------------------------------------------------------------------------------

    @property
    def kallsyms(self) -> Kallsyms:
        if self._kallsyms is None:
            self._kallsyms = Kallsyms.read()
        return self._kallsyms

    def function_names(self, pattern: str) -> builtins.list[tuple[str, ...]]:
        module, sep, glob = pattern.rpartition(":")
        found = self.kallsyms.iter_function_addrs(glob, module if sep else None)
        return [tuple(f"{module}:{n}" if sep else n for n in each) for each in group_aliases(found)]

    def _resolve(self, probe: Kprobe, *, is_return: bool) -> ProbePoint:
        if is_return and probe.offset:
            raise ProbeRejected(
                f"a return probe goes on a function's entry, not at +{probe.offset:#x}",
                errno=_errno.EINVAL,
            )
        if probe.symbol:
            symbol = self.kallsyms.lookup(probe.symbol)
            if symbol.size and probe.offset >= symbol.size:
                raise ProbeRejected(
                    f"offset {probe.offset:#x} is past the end of {symbol.name} "
                    f"(size {symbol.size:#x})",
                    errno=_errno.EINVAL,
                )
            addr = symbol.addr + probe.offset
            return ProbePoint(
                addr=addr,
                display=f"{symbol.name}+{probe.offset:#x}",
                module_name=symbol.module,
                place=kernel_location(probe.symbol, probe.offset, None),
                symbol=symbol.name,
                offset=probe.offset,
                func_size=symbol.size,
            )
        if probe.addr is None:
            raise ProbeRejected("a kernel probe needs a symbol or an address", errno=_errno.EINVAL)
        addr = probe.addr + probe.offset
        found = self.kallsyms.get_symbol_at(addr)
        if found is None:
            raise ProbeRejected(f"{addr:#x} is not in the kernel's text", errno=_errno.EINVAL)
        return ProbePoint(
            addr=addr,
            display=f"{found.name}+{addr - found.addr:#x}",
            module_name=found.module,
            place=kernel_location(None, 0, addr),
            symbol=found.name,
            offset=addr - found.addr,
            func_size=found.size,
        )

    def _check(self, probe: Kprobe, point: ProbePoint) -> None:
        for entry in self.blacklist():
            if point.addr in entry:
                raise Blacklisted(
                    f"{point.display} ({point.addr:#x}) is in the kernel's kprobes blacklist "
                    f"({entry.reason}, {entry.start:#x}-{entry.end:#x}): the kernel refuses "
                    "probes on code that kprobes itself runs or that is marked NOKPROBE, "
                    "where a breakpoint would recurse",
                    errno=_errno.EINVAL,
                )

    def _maxactive(self, rp: Kretprobe) -> int:
        if rp.maxactive > MAXACTIVE_MAX:
            raise ProbeRejected(
                f"maxactive {rp.maxactive} is above the kernel's limit {MAXACTIVE_MAX}",
                errno=_errno.E2BIG,
            )
        return max(0, rp.maxactive)

    def _describe(self, addr: int, tid: int) -> str:
        return self.kallsyms.describe(addr)

    def _symbolize(self, addr: int) -> str:
        return self.kallsyms.describe(addr)

    def _probe_for_location(self, location: Location, is_return: bool) -> AnyProbe:
        symbol: str | None = None
        addr: int | None = None
        offset = 0
        match location:
            case SymbolLocation(symbol=name, offset=off, module=module) if (
                module is None or "/" not in module
            ):
                symbol, offset = (f"{module}:{name}" if module else name), off
            case AddressLocation(address=address):
                addr = address
            case _:
                raise ProbeRejected(
                    f"{render_location(location)} names a file: that is a uprobe (the "
                    "Uprobes target, or --backend uprobes), not a kernel probe",
                    errno=_errno.EINVAL,
                )
        if is_return:
            return Kretprobe(symbol=symbol, offset=offset, addr=addr)
        return Kprobe(symbol=symbol, offset=offset, addr=addr)
