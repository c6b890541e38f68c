"""The optimizer's state machine: where each probe site stands with jump optimization.

The kernel keeps this in kernel/kprobes.c (``optimize_kprobe``, ``unoptimize_kprobe``, the
``KPROBE_FLAG_OPTIMIZED`` bit and the optimizing and unoptimizing lists); the machine work of
building detours and writing jumps is the target's (process/fast/optimizer.py, as the kernel's
arch/x86/kernel/kprobes/opt.c). A site is optimized when every probe on it asked for it, none
has a handler that may change the program, the site is armed and optimization is on; the
target then decides whether the code allows it, and a refusal is final for that code.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Final

from kprobes.errors import InternalError
from kprobes.values import dataclass, field

if TYPE_CHECKING:
    from kprobes.core.probes import Kprobe
    from kprobes.core.table import ProbeSite


class OptState(enum.Enum):
    """Where a site stands with jump optimization (changed only by ``SiteOpt.to``)."""

    TRAP = "trap"  # an int3 probe: not asked for, or asked and not possible now
    OPTIMIZED = "optimized"  # a jmp to a detour
    REFUSED = "refused"  # the site can never be optimized (the reason says why)


_ALLOWED: Final[dict[OptState, frozenset[OptState]]] = {
    OptState.TRAP: frozenset({OptState.TRAP, OptState.OPTIMIZED, OptState.REFUSED}),
    OptState.OPTIMIZED: frozenset({OptState.TRAP}),
    OptState.REFUSED: frozenset({OptState.REFUSED}),
}


@dataclass(slots=True)
class SiteOpt:
    """One site's optimization: its state, why it is not optimized, its counter."""

    state: OptState = OptState.TRAP
    reason: str = ""
    area: int = 0  # which shared area (JumpState.areas) holds its counter
    counter: int = -1  # index in that area, kept across unoptimize/optimize
    counters: int = 0  # how many counters from there are the site's (its return probes')
    seen: int = 0  # the counter's value already added to the probes' nhit
    detour: int = 0  # where the current detour is (0 when not optimized)
    region_len: int = 0
    probes: tuple[Any, ...] = ()  # the site's probes its detour was made for
    record_id: int = 0  # a record site's id in its records (reader.py), 0 for a count
    plan: Any = None  # the captures that id's records hold (the target's)
    # The same, of the records each return probe's trampoline writes, by return probe.
    returns: dict[Any, tuple[int, Any]] = field(default_factory=dict)
    # And of the records each return probe's entry action writes, by return probe.
    entry_data: dict[Any, tuple[int, Any]] = field(default_factory=dict)

    def to(self, state: OptState, reason: str = "") -> None:
        if state not in _ALLOWED[self.state]:
            raise InternalError(f"optimization: {self.state.value} -> {state.value}")
        self.state = state
        self.reason = reason


def why_no_jump(site: ProbeSite, is_enabled: bool) -> str | None:
    """Why ``site`` keeps its int3 whatever its code ("" when no probe asked); None when it
    should be optimized."""
    if not any(p.optimize for p in site.probes):
        return ""
    for p in site.probes:
        if not p.optimize:
            return "another probe here did not ask for a jump"
        why_owner = _why_owner_traps(p.owner)
        if why_owner is not None:
            return why_owner
        if p.owner is None and (p.pre_handler or p.post_handler or p.fault_handler):
            return "a probe here has a handler that may change the program, which runs at a trap"
    # Entry probes and return probes share a detour; a probe of another type (a jprobe)
    # runs at its trap, alone.
    owners = [p for p in site.probes if p.owner is not None]
    if len(site.probes) > 1 and not all(_is_return(p) for p in owners):
        return "a probe here shares its site with a probe of another type"
    if not site.is_armed:
        return "disabled"
    if not is_enabled:
        return "optimization is off (proc.optimization)"
    return None


def _is_return(probe: Kprobe) -> bool:
    """A return probe's entry (which an entry probe's record may share: the target runs
    both in one detour)."""
    return probe.kind == "r"


def _why_owner_traps(owner: Any) -> str | None:
    """Why the probe type an entry probe belongs to keeps it on traps (None: it does not, or
    the probe is a plain kprobe). A return probe whose handlers need no trap runs its entry's
    pre handler (the trap tier's hook) only while its site is on traps."""
    if owner is None:
        return None
    why_on_traps = getattr(owner, "why_on_traps", None)
    if why_on_traps is None:
        return "a probe here has a handler that may change the program, which runs at a trap"
    why: str | None = why_on_traps()
    return why
