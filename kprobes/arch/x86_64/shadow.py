"""The shadow stacks' layout: where an optimized return probe keeps the real return addresses.

One private mapping per process of ``NTHREADS`` thread slots, each a header and its entries
(retstack.py writes and reads them: the entry action, the trampoline); a thread's slot is
found by its thread pointer, hashed (``HASH``). Apart from retstack.py so that the stack
walk (stackwalk.py, which retstack.py builds on through record.py) can read them too: a
return address that is one of our trampolines is the real one kept here.
"""

from __future__ import annotations

from typing import Final

NTHREADS: Final = 256  # thread slots per process (a power of two)
CAPACITY: Final = 16384  # entries per thread: the deepest nesting followed
PAGE: Final = 4096
# A thread slot: its header, then its entries.
T_OWNER: Final = 0  # the thread pointer, 0 while free
T_DEPTH: Final = 8
T_BUSY: Final = 16
T_LOST_NEXT: Final = 24  # how many entries were ever released (the ring's next place)
T_ENTRIES: Final = 64
# An entry: where the call returns to, its return slot, its entry time, then the registers
# a return record's $argN name, kept at the entry (``entry_regs``), a word each.
E_RET: Final = 0
E_STACK: Final = 8
E_TSC: Final = 16
E_ARGS: Final = 24
ENTRY_REGS_MAX: Final = 6  # every argument register of the SysV ABI
# And, for a probe with an entry action (``Kretprobe(entry_args=...)``), the ticket + 1 of
# the record the entry wrote of it (0: none, the ring was full), which the return's record
# carries so that the tool pairs the two exactly.
E_DATA: Final = E_ARGS + 8 * ENTRY_REGS_MAX
# And whose entry it is: the probe's counters (retstack.py), where a release counts the
# frame abandoned and, for a probe with a ``maxactive``, one instance less in flight.
E_OWNER: Final = E_DATA + 8
# And the trampoline it hooked its frame to, which the tool writes back over a frame that
# survived a C++ exception (the unwinder saw the real return address).
E_TRAMP: Final = E_OWNER + 8
ENTRY: Final = E_TRAMP + 8  # 96 bytes
# Then the released entries' (return slot, return address), the last LOST_MAX, so that a
# frame released wrongly (a stack switched under it: coroutines, a signal stack above the
# thread's) still finds its way home, as the trap tier's ``Thread.lost`` does.
T_LOST: Final = T_ENTRIES + CAPACITY * ENTRY
LOST_MAX: Final = 64
LOST: Final = 16
SLOT_STRIDE: Final = (T_LOST + LOST_MAX * LOST + PAGE - 1) & ~(PAGE - 1)
SHADOW_SIZE: Final = NTHREADS * SLOT_STRIDE
HASH: Final = 0x61C88647  # Fibonacci hashing, an imm32
