"""jprobe_example: the analog of the kernel's samples/kprobes/jprobe_example.c.

An instrumentation module for ``kprobes run``: a jprobe on the demo program's
``emit_line(int fd, const char *text, int number, double fraction)``. The handler has the
probed function's signature and is called with its arguments at every call; returning from it
is ``jprobe_return()``. The demo is built without debug information, so the argument types
come from the handler's annotations (with DWARF they would come from there)::

    kprobes run samples/jprobe_example.py -c "samples/bin/demo 3"
"""

from __future__ import annotations

import ctypes
from typing import Any

import kprobes

func = "emit_line"  # module parameter: the function to probe


def j_emit_line(fd: ctypes.c_int, text: str, number: ctypes.c_int, fraction: float) -> None:
    """Mirror the probed function's signature; the arguments arrive as Python values."""
    print(
        f"jprobe: fd = {fd}, text = {text!r}, number = {number}, fraction = {fraction:.6f}",
        flush=True,
    )
    # Always end with a return: it is jprobe_return().


my_jprobe: kprobes.Jprobe | None = None


def init(target: Any) -> None:
    global my_jprobe
    my_jprobe = kprobes.Jprobe(symbol=func, entry=j_emit_line)
    target.register_jprobe(my_jprobe)
    addr = my_jprobe.addr  # None while pending: its library is not mapped yet
    where = f"{addr:#x}" if addr is not None else "pending"
    print(f"Planted jprobe at {where}, handler addr {id(j_emit_line):#x}", flush=True)


def exit(target: Any) -> None:
    assert my_jprobe is not None
    addr = my_jprobe.addr
    target.unregister_jprobe(my_jprobe)
    print(f"jprobe at {addr:#x} unregistered", flush=True)
