"""Runs inside GDB (``gdb -batch -nx -x gdb_script.py --args PROGRAM ...``), not under Python.

Counts hits of one breakpoint with a Python ``stop()`` that never stops, the cheapest scripted
breakpoint GDB offers, then prints ``hits=<n>`` once the program has exited. The location comes
from the environment (``KPBENCH_LOCATION``, a GDB location such as ``*work_push``): the ``*``
puts the breakpoint on the first instruction, where a plain ``break work_push`` would skip what
GDB takes for the prologue.
"""

import contextlib
import os

import gdb  # type: ignore[import-untyped]


class CountingBreakpoint(gdb.Breakpoint):  # type: ignore[misc]
    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        self.count = 0

    def stop(self) -> bool:
        self.count += 1
        return False


gdb.execute("set pagination off")
gdb.execute("set confirm off")
gdb.execute("set startup-with-shell off")
with contextlib.suppress(gdb.error):  # a GDB built without debuginfod has no such setting
    gdb.execute("set debuginfod enabled off")  # never ask, never fetch
counter = CountingBreakpoint(os.environ["KPBENCH_LOCATION"])
gdb.execute("run")
print(f"hits={counter.count}", flush=True)
