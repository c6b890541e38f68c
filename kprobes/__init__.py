"""Kprobes for live x86-64 Linux processes: break into almost any instruction, run a Python
handler with the saved registers, and carry on as if nothing happened.

    import kprobes
    with kprobes.spawn(["./prog"]) as proc:
        kp = kprobes.Kprobe(symbol="libc:malloc", pre_handler=lambda p, regs: print(regs.rdi))
        proc.register_kprobe(kp)
        proc.run()
"""

from kprobes import errors
from kprobes.arch.x86_64.regs import Regs
from kprobes.core.probes import TRAP_HANDLER_EXCEPTION, Kprobe, ProbeFlags
from kprobes.core.retprobes import Jprobe, Kretprobe, KretprobeInstance, Task
from kprobes.model import BlacklistEntry, ProbeListing
from kprobes.process.target import Process, attach, spawn

__version__ = "0.1.0"

__all__ = [
    "TRAP_HANDLER_EXCEPTION",
    "BlacklistEntry",
    "Jprobe",
    "Kprobe",
    "Kretprobe",
    "KretprobeInstance",
    "ProbeFlags",
    "ProbeListing",
    "Process",
    "Regs",
    "Task",
    "attach",
    "errors",
    "spawn",
]
