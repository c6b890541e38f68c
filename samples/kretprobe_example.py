"""kretprobe_example: the analog of the kernel's samples/kprobes/kretprobe_example.c.

An instrumentation module for ``kprobes run``: a return probe on ``func`` whose entry handler
stamps the time of each call in the instance's private data and whose return handler prints
the function's return value and how long the call took, in ns::

    kprobes run samples/kretprobe_example.py -c "samples/bin/demo 3"
    kprobes run samples/kretprobe_example.py func=libc:malloc -p 1234

Like the kernel module's ``func`` parameter, ``func=`` chooses the function (default: libc's
``write``). The time includes the cost of the probe itself (two stops of the program).
"""

from __future__ import annotations

import struct
import time
from typing import Any

import kprobes

func = "libc:write"  # module parameter: the function to probe
maxactive = 20  # module parameter: probe up to 20 instances concurrently

_STAMP = struct.Struct("<q")  # struct my_data { ktime_t entry_stamp; }
my_kretprobe: kprobes.Kretprobe | None = None


def entry_handler(ri: kprobes.KretprobeInstance, regs: kprobes.Regs) -> int:
    """Per-instance private data: the entry timestamp."""
    _STAMP.pack_into(ri.data, 0, time.monotonic_ns())
    return 0


def ret_handler(ri: kprobes.KretprobeInstance, regs: kprobes.Regs) -> int:
    """The return value and the time the call took."""
    delta = time.monotonic_ns() - _STAMP.unpack_from(ri.data, 0)[0]
    retval = regs.return_value
    if retval >= 1 << 63:
        retval -= 1 << 64  # a negative result (-1 and an errno, say)
    print(f"{func} returned {retval} and took {delta} ns to execute", flush=True)
    return 0


def init(target: Any) -> None:
    global my_kretprobe
    my_kretprobe = kprobes.Kretprobe(
        symbol=func,
        handler=ret_handler,
        entry_handler=entry_handler,
        data_size=_STAMP.size,
        maxactive=maxactive,
    )
    target.register_kretprobe(my_kretprobe)
    addr = my_kretprobe.addr  # None while pending: its library is not mapped yet
    where = f"{addr:#x}" if addr is not None else "pending"
    print(f"Planted return probe at {func}: {where}", flush=True)


def exit(target: Any) -> None:
    assert my_kretprobe is not None
    addr = my_kretprobe.addr
    target.unregister_kretprobe(my_kretprobe)
    print(f"kretprobe at {addr:#x} unregistered", flush=True)
    # nmissed > 0 suggests that maxactive was set too low.
    print(f"Missed probing {my_kretprobe.nmissed} instances of {func}", flush=True)
