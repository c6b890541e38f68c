"""A probe site's out-of-line state, the kernel's ``ainsn``: decided once at prepare time
(arming.py), read on every hit (tracer.py)."""

from __future__ import annotations

from kprobes.arch.x86_64.emulate import Emulator
from kprobes.arch.x86_64.plan import Plan, PlanKind
from kprobes.linux import ptrace
from kprobes.values import dataclass, field


@dataclass(frozen=True, slots=True)
class Prepared:
    """A site's out-of-line state (the kernel's ``ainsn``): its plan and slot."""

    plan: Plan
    kind: PlanKind
    slot: int  # 0 for EMULATE
    slot_len: int
    emulator: Emulator | None = None  # EMULATE: the specialised emulation
    is_one_stop: bool = False  # EMULATE or BOOST: the hit path can finish it inline
    is_rip_only: bool = False  # running it out of line changes rip alone (write back rip only)
    slot_word: ptrace.Word = field(default_factory=ptrace.Word)  # slot, built for POKEUSER
    addr_word: ptrace.Word = field(default_factory=ptrace.Word)  # the probed address, likewise
