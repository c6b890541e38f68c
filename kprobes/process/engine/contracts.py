"""What the trap engine asks of the parts built above it, written down as Protocols.

The engine is the lowest room of ``process/``: it imports none of the others (the fast
tier falls back to the engine, never the other way round). Three parts that live higher up
plug into its loop, and the engine knows each of them only by what is written here; the
``Process`` that assembles the parts hands the engine the real ones:

- ``FaultFixer``: our executable pages and the fetch faults taken in them
  (``fetch/faults.py``), asked at every SIGSEGV or SIGBUS stop and at detach;
- ``Guardian``: the trap guard (``survival/trapguard.py``), which keeps the program's own
  SIGTRAP handler from seeing our traps while the tool lives;
- ``Injector``: the program's own calls made for us (``inject/program.py``): its mmaps of
  our pages, its ifunc resolvers, the rescue's installation, the world held around them;
- ``FastTier``: the optimized tier (``fast/``), told when a site leaves the probe table or
  the address space is replaced (it also polls its rings while ``run()`` waits, and learns
  new threads, through the two callables ``Tracer.ring_poll`` and ``on_thread_start``).

Rejected: the engine importing the concrete classes (it did, before issue 19: seven modules
of three rooms in one import loop, and no written line between what the engine may call and
what it must not touch).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kprobes.process.engine.threads import Thread
    from kprobes.process.engine.tracee import Tracee
    from kprobes.process.engine.xol import XolArea


class FaultFixer(Protocol):
    """Our code's pages in one address space, and the faults of our fetches in them."""

    def note_code(self, start: int, end: int) -> None:
        """Executable code of ours at [start, end): a fault there may be a fetch's."""
        ...

    def is_ours(self, addr: int) -> bool: ...

    def fix(self, t: Thread, sig: int) -> bool:
        """``t`` is in the signal-delivery stop of ``sig`` with its registers loaded: if it
        is a fault of a fetch of ours, send the thread on past it (True: resume it without
        the signal); False: the signal is the program's own."""
        ...

    def forget(self) -> None:
        """The address space was replaced (exec)."""
        ...


class Guardian(Protocol):
    """The trap guard: the program's own SIGTRAP handler kept from our traps."""

    @property
    def is_armed(self) -> bool: ...

    def arm_if_needed(self, thread: Thread) -> None:
        """``thread`` is held: arm the guard if the program has a SIGTRAP handler."""
        ...

    def repair(self, thread: Thread) -> None:
        """``thread`` is held after a hit: undo what the guard's arming cost it."""
        ...

    def forget(self) -> None:
        """The program's handlers were reset (exec)."""
        ...


class Injector(Protocol):
    """What the engine's parts (arming, return probes) need the program to run for them."""

    def world_held(self) -> AbstractContextManager[None]:
        """Every thread held for the block (a nested stop of the world only counts)."""
        ...

    def ensure_rescue(self) -> None:
        """Give the program its rescue before anything of ours goes in."""
        ...

    def xol(self) -> XolArea:
        """The out-of-line area, its pages mapped by the program as they are needed."""
        ...

    def ifunc_target(self, resolver_addr: int) -> int:
        """Run a GNU ifunc resolver in the program: the implementation it picks."""
        ...

    def map_records(self, size: int) -> int:
        """More room for the rescue's return records, mapped by the program."""
        ...


class FastTier(Protocol):
    """The optimized tier, as the engine sees it."""

    def forget_site(self, addr: int) -> None:
        """The site at ``addr`` left the probe table (unregistered, or its code unmapped)."""
        ...

    def forget(self) -> None:
        """The address space was replaced (exec): nothing of the tier is in it any more."""
        ...

    def unhook_returns(self, threads: Iterable[Thread]) -> None:
        """Real return addresses back in every frame of ``threads`` the tier's return
        trampolines hooked (the threads are held)."""
        ...

    def rehook_returns(self, t: Thread, sp: int) -> None:
        """A catch block begins in held thread ``t`` at ``sp``: the frames above it the
        tier's trampolines had hooked are hooked again."""
        ...

    def fork_child(self, child: Tracee) -> None:
        """A followed fork child (``child.number`` its own), held before it runs a single
        instruction: its copy of the tier's private pages becomes its own."""
        ...
