"""Probe objects: what the user builds and registers, with the kernel's field names.

A ``Kprobe`` is a plain object with a lifecycle (unregistered → registered → unregistered),
like ``struct kprobe``: the user fills in where and which handlers, registration fills in
``addr`` and the counters. Status bits are an ``enum.Flag`` read through predicates, as the
kernel's ``KPROBE_FLAG_*`` are read through ``kprobe_gone()`` and ``kprobe_disabled()``.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from kprobes.errors import ProbeRejected

if TYPE_CHECKING:
    from kprobes.core.table import ProbeSite

# Handler types. ``regs`` is the target's register view (process: a writable Regs).
PreHandler = Callable[["Kprobe", Any], "bool | int | None"]
PostHandler = Callable[["Kprobe", Any, int], None]
FaultHandler = Callable[["Kprobe", Any, int], "bool | int | None"]

AsyncHandler = Callable[["Kprobe", Any], None]  # (probe, hit): after the fact, read-only

# trapnr passed to fault handlers when a Python handler raised rather than the CPU faulting.
TRAP_HANDLER_EXCEPTION = -1


class ProbeFlags(enum.Flag):
    NONE = 0
    GONE = enum.auto()  # the code it was placed in is no longer mapped (exec, exit)
    DISABLED = enum.auto()  # registered but not armed (disable_kprobe or disabled=True)
    PENDING = enum.auto()  # registered, waiting for its library to be mapped (no site)


class Location(Protocol):
    """Where a probe was placed, as the target resolved it."""

    @property
    def addr(self) -> int: ...

    @property
    def display(self) -> str: ...

    @property
    def module_name(self) -> str: ...


class Kprobe:
    """A probe on one instruction: ``Kprobe(symbol="libc:malloc", pre_handler=f)``.

    ``pre_handler(probe, regs)`` runs before the probed instruction; a true result means the
    handler changed ``regs.ip`` and the instruction must not run. ``post_handler(probe, regs,
    flags)`` runs after it ran out of line. ``fault_handler(probe, regs, trapnr)`` runs when a
    handler raises (trapnr -1) or the out-of-line copy faults; a true result means handled.

    ``optimize=True`` asks for a jump instead of a breakpoint where the site allows it (the
    kernel's optimized probes). A probe with no handler is then a *count*: its hits are
    counted in the program, with no trap, and ``nhit`` shows them. A probe with an
    ``async_handler`` is a *record*: each hit writes a record (the fetch-args ``args`` in the
    probe language, e.g. ``"size=%di name=+0(%si):string"``, evaluated at the hit, and with
    ``with_regs=True`` a copy of the registers: three times the record) that the target reads
    later and hands to ``async_handler(probe, event)`` as a read-only ``Event``: the handler
    cannot change the program, so no trap is needed. Where the
    site cannot be optimized, the same handler runs at a trap with the same snapshot. A
    probe with a pre, post or fault handler (which may change registers) keeps the breakpoint;
    ``list()`` says why a probe is not optimized.

    ``async_handler`` and ``args`` mean the same on every target: the kernel's tracefs
    targets hand it the ``Event`` their ring buffer recorded with those fetch-args. A target
    that cannot honour an option (the kernel's tracefs targets take no ``optimize``)
    refuses the probe with ``UnsupportedOption`` naming itself and the option; none is ever
    ignored.
    """

    kind = "k"

    def __init__(
        self,
        symbol: str | None = None,
        offset: int = 0,
        addr: int | None = None,
        pre_handler: PreHandler | None = None,
        post_handler: PostHandler | None = None,
        fault_handler: FaultHandler | None = None,
        disabled: bool = False,
        optimize: bool = False,
        async_handler: AsyncHandler | None = None,
        args: str | Sequence[str] = (),
        with_regs: bool = False,
    ) -> None:
        self.symbol = symbol
        self.offset = offset
        self.addr = addr
        self.pre_handler = pre_handler
        self.post_handler = post_handler
        self.fault_handler = fault_handler
        self.optimize = optimize
        self.async_handler = async_handler
        self.args: tuple[str, ...] = (args,) if isinstance(args, str) else tuple(args)
        self.with_regs = with_regs  # the async_handler's Event carries the registers
        self.flags = ProbeFlags.DISABLED if disabled else ProbeFlags.NONE
        self.nmissed = 0
        self.nhit = 0
        self.location: Location | None = None
        self.site: ProbeSite | None = None  # set while registered; core-private
        self.owner: Any = None  # the Kretprobe or Jprobe this entry probe belongs to

    @property
    def is_registered(self) -> bool:
        return self.site is not None or ProbeFlags.PENDING in self.flags

    @property
    def is_pending(self) -> bool:
        """Registered, but its library is not mapped (yet, or any more): nothing is armed."""
        return ProbeFlags.PENDING in self.flags

    @property
    def is_disabled(self) -> bool:
        return ProbeFlags.DISABLED in self.flags

    @property
    def is_gone(self) -> bool:
        return ProbeFlags.GONE in self.flags

    def __repr__(self) -> str:
        where = self.location.display if self.location else (self.symbol or hex(self.addr or 0))
        state = "registered" if self.is_registered else "unregistered"
        if self.is_pending:
            state = "pending"
        return f"<{type(self).__name__} {where} {state} nhit={self.nhit} nmissed={self.nmissed}>"


class WithArgs(Protocol):
    """A probe that takes fetch-args (a ``Kprobe``, a ``Kretprobe``)."""

    args: tuple[str, ...]

    @property
    def is_registered(self) -> bool: ...


@contextmanager
def args_given(given: Iterable[tuple[WithArgs, Sequence[str]]]) -> Iterator[None]:
    """Around a registration: fetch-args given to the register call become each probe's
    ``args`` (every target takes them either way; given both ways, and different, they are
    refused), and a probe left unregistered gets its own back, as it was given."""
    pairs = [(kp, tuple(words)) for kp, words in given]
    before = [kp.args for kp, _ in pairs]
    try:
        for kp, words in pairs:
            if words and kp.args and kp.args != words:
                raise ProbeRejected(
                    f"fetch-args given twice, differently: {' '.join(kp.args)!r} on the probe "
                    f"and {' '.join(words)!r} to the register call (give them once)",
                    errno=errno.EINVAL,
                )
            if words:
                kp.args = words
        yield
    except BaseException:
        for (kp, _), words in zip(pairs, before, strict=True):
            if not kp.is_registered:
                kp.args = words
        raise


def check_handlers(kp: Kprobe) -> None:
    """The one rule on a probe's handlers every target applies: an ``async_handler`` sees
    hits after the fact, which a pre, post or fault handler on the same probe would not."""
    if kp.async_handler is not None and (kp.pre_handler or kp.post_handler or kp.fault_handler):
        raise ProbeRejected(
            "an async_handler sees hits after the fact: it does not go with a pre, post or "
            "fault handler (register two probes)",
            errno=errno.EINVAL,
        )
