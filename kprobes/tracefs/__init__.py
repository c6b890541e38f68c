"""The Kernel and Uprobes targets: the kernel's own kprobes and uprobes, driven through tracefs.

``Kernel`` puts kprobes on kernel functions (``kprobe_events``), ``Uprobes`` puts the kernel's
uprobes on user programs (``uprobe_events``). Both write probe lines under a group of their
own, enable them in a private tracefs instance, read the instance's per-CPU ring buffers in
binary and hand decoded ``Event`` values to the probes' handlers; both remove everything they
created on every way out. See ``target.py`` for the shared pipeline.
"""

from kprobes.tracefs.control import ErrorLogEntry, TraceFs, parse_error_log
from kprobes.tracefs.kernel import Kernel
from kprobes.tracefs.points import ProbePoint
from kprobes.tracefs.target import TraceTarget
from kprobes.tracefs.uprobes import Uprobes

__all__ = [
    "ErrorLogEntry",
    "Kernel",
    "ProbePoint",
    "TraceFs",
    "TraceTarget",
    "Uprobes",
    "parse_error_log",
]
