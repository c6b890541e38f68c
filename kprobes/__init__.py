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

from kprobes import errors
from kprobes.arch.x86_64.regs import Regs
from kprobes.core.probes import TRAP_HANDLER_EXCEPTION, Kprobe, ProbeFlags
from kprobes.core.retprobes import Jprobe, Kretprobe, KretprobeInstance, Task
from kprobes.model import BlacklistEntry, Event, EventArg, ProbeListing
from kprobes.process.following.pending import ProbeNotice
from kprobes.process.launch import attach, spawn
from kprobes.process.target import Process
from kprobes.tracefs.kernel import Kernel
from kprobes.tracefs.uprobes import Uprobes

Hit = Event  # what an async_handler receives: the one after-the-fact type, by its old name

__version__ = "0.1.0"

__all__ = [
    "TRAP_HANDLER_EXCEPTION",
    "BlacklistEntry",
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
