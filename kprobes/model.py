"""Frozen values shared by the targets and the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProbeListing:
    """One line of Appendix A's ``/sys/kernel/debug/kprobes/list``, for one probe."""

    addr: int
    kind: str  # "k", "r", "j"
    where: str  # symbol+offset
    module: str  # basename of the file the probe is in ("" if unknown)
    is_gone: bool
    is_disabled: bool
    plan: str  # how the probed instruction runs out of line: emulate, boost, step, singlestep

    def __str__(self) -> str:
        parts = [f"{self.addr:016x}", self.kind, self.where]
        if self.module:
            parts.append(f"[{self.module}]")
        if self.is_gone:
            parts.append("[GONE]")
        if self.is_disabled:
            parts.append("[DISABLED]")
        if self.plan:
            parts.append(f"[{self.plan}]")
        return "  ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {
            "addr": self.addr,
            "kind": self.kind,
            "where": self.where,
            "module": self.module,
            "is_gone": self.is_gone,
            "is_disabled": self.is_disabled,
            "plan": self.plan,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ProbeListing:
        return cls(
            addr=int(str(data["addr"])),
            kind=str(data["kind"]),
            where=str(data["where"]),
            module=str(data["module"]),
            is_gone=bool(data["is_gone"]),
            is_disabled=bool(data["is_disabled"]),
            plan=str(data["plan"]),
        )


@dataclass(frozen=True, slots=True)
class BlacklistEntry:
    """An address range where probes are refused, and why (debugfs ``kprobes/blacklist``)."""

    start: int
    end: int
    reason: str

    def __contains__(self, addr: object) -> bool:
        return isinstance(addr, int) and self.start <= addr < self.end

    def __str__(self) -> str:
        return f"0x{self.start:016x}-0x{self.end:016x}\t{self.reason}"
