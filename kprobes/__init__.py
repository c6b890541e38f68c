"""Kprobes for live x86-64 Linux processes: break into almost any instruction, run a Python
handler with the saved registers, and carry on as if nothing happened.

    import kprobes
    with kprobes.spawn(["./prog"]) as proc:
        kp = kprobes.Kprobe(symbol="libc:malloc", pre_handler=lambda p, regs: print(regs.rdi))
        proc.register_kprobe(kp)
        proc.run()

A probe whose handler only looks (``async_handler``, with fetch-args in the probe language)
is jump-optimized where its site allows it: no trap per hit, the handler runs after the fact:

    kp = kprobes.Kprobe(symbol="libc:malloc", optimize=True, args="size=%di",
                        async_handler=lambda p, event: print(event.tid, event.arg("size")))

The kernel's own kprobes and uprobes, through tracefs, take the same probes and spec lines:

    with kprobes.Kernel() as k:
        k.add("r:vfs_read ret=$retval:s64", lambda ri, event: print(event.arg("ret")))
        k.run(timeout=5)
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kprobes import errors
    from kprobes.arch.x86_64.regs import Regs
    from kprobes.core.probes import TRAP_HANDLER_EXCEPTION, Kprobe, ProbeFlags
    from kprobes.core.retprobes import Jprobe, Kretprobe, KretprobeInstance, Task
    from kprobes.model import BlacklistEntry, EntryData, Event, EventArg, ProbeListing
    from kprobes.process.following.pending import ProbeNotice
    from kprobes.process.launch import attach, spawn
    from kprobes.process.target import Process
    from kprobes.tracefs.kernel import Kernel
    from kprobes.tracefs.uprobes import Uprobes

    Hit = Event

# Where each public name lives, imported on first use (PEP 562): ``kprobes --help`` and a
# command that needs only the kernel's probes do not pay for the ptrace engine, the x86
# decoder and the ELF reader (about 0.5 s of imports).
_WHERE = {
    "errors": "kprobes.errors",
    "Regs": "kprobes.arch.x86_64.regs",
    "TRAP_HANDLER_EXCEPTION": "kprobes.core.probes",
    "Kprobe": "kprobes.core.probes",
    "ProbeFlags": "kprobes.core.probes",
    "Jprobe": "kprobes.core.retprobes",
    "Kretprobe": "kprobes.core.retprobes",
    "KretprobeInstance": "kprobes.core.retprobes",
    "Task": "kprobes.core.retprobes",
    "BlacklistEntry": "kprobes.model",
    "EntryData": "kprobes.model",
    "Event": "kprobes.model",
    "Hit": "kprobes.model",  # what an async_handler receives: Event, by its old name
    "EventArg": "kprobes.model",
    "ProbeListing": "kprobes.model",
    "ProbeNotice": "kprobes.process.following.pending",
    "attach": "kprobes.process.launch",
    "spawn": "kprobes.process.launch",
    "Process": "kprobes.process.target",
    "Kernel": "kprobes.tracefs.kernel",
    "Uprobes": "kprobes.tracefs.uprobes",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kprobes' has no attribute {name!r}")
    module = import_module(where)
    value = module if name == "errors" else getattr(module, "Event" if name == "Hit" else name)
    globals()[name] = value  # once: the next read is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "TRAP_HANDLER_EXCEPTION",
    "BlacklistEntry",
    "EntryData",
    "Event",
    "EventArg",
    "Hit",
    "Jprobe",
    "Kernel",
    "Kprobe",
    "Kretprobe",
    "KretprobeInstance",
    "ProbeFlags",
    "ProbeListing",
    "ProbeNotice",
    "Process",
    "Regs",
    "Task",
    "Uprobes",
    "attach",
    "errors",
    "spawn",
]
