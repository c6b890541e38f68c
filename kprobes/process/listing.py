"""Appendix A's list of one process's probes: ``ADDR TYPE SYMBOL+OFF [MODULE] [FLAGS]``.

Each placed probe is listed at its site with the site's plan (how its instruction runs out
of line, or ``OPTIMIZED``) and why it is not optimized; the pending ones follow, at address
0. The probes kprobes places for itself (the loader's rendezvous, the unwinder's guards) are
left out, as the kernel's list leaves out its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kprobes.core.probes import Kprobe
from kprobes.core.table import ProbeSite, ProbeTable
from kprobes.model import ProbeListing
from kprobes.process.engine.arming import ProbeLocation
from kprobes.process.engine.trampoline import UnwindGuard
from kprobes.process.following.pending import LoaderWatch


def is_ours(probe: Kprobe) -> bool:
    """A probe kprobes placed for itself, never shown (the loader's rendezvous, a guard)."""
    return isinstance(probe.owner, (UnwindGuard, LoaderWatch))


def list_probes(
    table: ProbeTable,
    pending: Iterable[Kprobe],
    plan_of: Callable[[ProbeSite], tuple[str, str]],
    requested_addr: Callable[[Kprobe], int | None],
) -> list[ProbeListing]:
    """The listing, sorted by address. ``plan_of(site)`` is (plan, why not optimized);
    ``requested_addr(probe)`` the address a pending probe was given by, if any."""
    out = []
    for site in table:
        loc: ProbeLocation = site.location  # type: ignore[assignment]
        plan, why = plan_of(site)
        for probe in site.probes:
            if is_ours(probe):
                continue
            out.append(
                ProbeListing(
                    addr=site.addr,
                    kind=probe.kind,
                    where=loc.display,
                    module=loc.module_name,
                    is_gone=probe.is_gone,
                    is_disabled=probe.is_disabled,
                    plan=plan,
                    why_not_optimized=why,
                )
            )
    for probe in pending:
        if isinstance(probe.owner, UnwindGuard):
            continue
        out.append(
            ProbeListing(
                addr=0,
                kind=probe.kind,
                where=probe.symbol or f"{requested_addr(probe) or 0:#x}",
                module="",
                is_gone=probe.is_gone,
                is_disabled=probe.is_disabled,
                plan="",
                is_pending=True,
            )
        )
    return sorted(out, key=lambda e: e.addr)
