"""The rescue area's layout: where the tool writes what the program needs to carry on alone.

The rescue (``rescue.c``, compiled into ``rescue_code.py``) is a SIGTRAP handler the probed
program runs only when the tool died without detaching (and, once detour code may fault on a
fetch, its SIGSEGV and SIGBUS handler). It reads everything from one anonymous executable
mapping, laid out here, which the tool fills through /proc/PID/mem:

    +0x000000  code: the injection stub (``syscall; int3``), the signal restorer, the
               handlers (SIGTRAP; SIGSEGV and SIGBUS)
    +0x001000  header: the trampoline, the injection in flight, table sizes, our pages,
               the program's own SIGTRAP action, the registers an injection borrowed, the
               program's own SIGSEGV and SIGBUS actions; past it, the rescue's own actions
    +0x002000  breakpoints: (address, original byte; a jump's other four bytes), one per
               address ever patched
    +0x042000  stepped copies: (slot, length, probed address)
    +0x062000  return records: (stack slot, real return address, sequence), one per
               kretprobe instance; the newest record of a slot is the frame's caller

Every function here is pure: offsets in, bytes out.
"""

from __future__ import annotations

import signal
import struct
from collections.abc import Callable
from typing import Final

from kprobes.arch.x86_64 import rescue_code

AREA_SIZE: Final = 0x400000
HEADER: Final = 0x1000
BP_TABLE: Final = 0x2000
BP_ENTRY: Final = 16
BP_MAX: Final = (0x42000 - BP_TABLE) // BP_ENTRY
REDIRECT_TABLE: Final = 0x42000
REDIRECT_ENTRY: Final = 24
REDIRECT_MAX: Final = (0x62000 - REDIRECT_TABLE) // REDIRECT_ENTRY
RECORDS: Final = 0x62000
RECORD_SIZE: Final = 24
RECORD_MAX: Final = (AREA_SIZE - RECORDS) // RECORD_SIZE
MAX_PAGES: Final = 64
PAGE: Final = 0x1000
MAX_RANGES: Final = 64

MAGIC: Final = 0x6575637365526B50  # "PkResc" + "ue", little-endian

# struct header (rescue.c): offsets from HEADER
H_MAGIC: Final = 0
H_TRAMP: Final = 8
H_INJECT_TRAP: Final = 16
H_NBP: Final = 24
H_BPS: Final = 32
H_NREDIRECT: Final = 40
H_REDIRECTS: Final = 48
H_NRANGE: Final = 56
H_RANGES: Final = 64
H_NPAGE: Final = 1088
H_PAGES: Final = 1096
H_OLD: Final = 2120
H_SAVED: Final = 2152
H_OLD_FAULT: Final = 2368  # the program's own SIGSEGV, then SIGBUS action
H_SIZE: Final = 2432
H_NEW_ACTION: Final = 0xF00  # past the struct: the rescue's own action, for rt_sigaction
H_NEW_FAULT: Final = 0xF20  # the rescue's own SIGSEGV, then SIGBUS action

# The signals of a fetch that hit a bad pointer, in the order of the header's actions.
FAULT_SIGNALS: Final = (signal.SIGSEGV, signal.SIGBUS)

SIGACTION_SIZE: Final = 32
SA_SIGINFO: Final = 0x4
SA_ONSTACK: Final = 0x08000000
SA_NODEFER: Final = 0x40000000
SA_RESTART: Final = 0x10000000
SA_RESTORER: Final = 0x04000000

# The siginfo of a trap the tool puts back on its int3 before it reaps it: a thread whose
# tool dies in between gets this trap delivered, at the int3 or one byte on (rescue.c).
PUT_BACK_CODE: Final = 0x4B50
PUT_BACK_ERRNO: Final = 0x4B505242
SIGINFO_SIZE: Final = 128

_Q: Final = struct.Struct("<Q")
_QQ: Final = struct.Struct("<QQ")
_QQQ: Final = struct.Struct("<QQQ")


def code() -> bytes:
    return rescue_code.CODE


def stub(area: int) -> int:
    """``syscall; int3``: injections run here, so that a dead tool's rescue can undo them."""
    return area + rescue_code.STUB


def stub_trap(area: int) -> int:
    """The int3 after the stub's syscall (also the return address of injected calls)."""
    return area + rescue_code.STUB + 2


def restorer(area: int) -> int:
    """The rescue's ``rt_sigreturn``: the restorer of every action of ours (how one is known
    after the kernel reset its handler to SIG_DFL)."""
    return area + rescue_code.RESTORER


def syscall_ret(area: int) -> int:
    """``syscall; ret``: with the restorer, a way home for an injection that must not end on
    a trap (``selfrestore.py``): the ones that make the rescue no signal handler any more,
    and those after them."""
    return area + rescue_code.SYSCALL_RET


def restarter(area: int) -> int:
    """The restorer of such an injection for a thread borrowed from a call with a restart
    block (``nanosleep``, ``poll`` with a timeout): ``restart_syscall`` first, its result in
    the frame's rax, then ``rt_sigreturn`` (which would cancel the block)."""
    return area + rescue_code.RESTARTER


def header(area: int) -> bytes:
    """A fresh header: tables empty, one range covering every return record."""
    out = bytearray(H_SIZE)
    _Q.pack_into(out, H_MAGIC, MAGIC)
    _Q.pack_into(out, H_BPS, area + BP_TABLE)
    _Q.pack_into(out, H_REDIRECTS, area + REDIRECT_TABLE)
    _Q.pack_into(out, H_NRANGE, 1)
    _QQ.pack_into(out, H_RANGES, area + RECORDS, 0)
    return bytes(out) + bytes(H_NEW_ACTION - H_SIZE) + sigaction(area)


def sigaction(area: int) -> bytes:
    """The kernel's ``struct sigaction`` that makes the rescue the SIGTRAP handler."""
    return struct.pack(
        "<QQQQ",
        area + rescue_code.HANDLER,
        SA_SIGINFO | SA_RESTORER,
        restorer(area),
        0,
    )


def fault_sigaction(area: int, own: bytes) -> bytes:
    """The action that makes the rescue the SIGSEGV or SIGBUS handler, given the program's
    own (``own``, the kernel's ``struct sigaction``).

    When the program has a handler of its own, the rescue's action takes its mask and its
    SA_NODEFER, SA_ONSTACK and SA_RESTART: the kernel then builds the frame the rescue hands
    on to that handler as it would have built the handler's own (on its alternate stack, a
    stack overflow included, with its signals blocked), and restarts the syscall a sent
    SIGSEGV interrupted as it would have. SA_RESETHAND is done by the rescue itself.
    """
    handler, flags, _, mask = struct.unpack("<QQQQ", own)
    ours = SA_SIGINFO | SA_RESTORER
    if handler > 1:  # neither SIG_DFL nor SIG_IGN
        ours |= flags & (SA_NODEFER | SA_ONSTACK | SA_RESTART)
    else:
        mask = 0
    return struct.pack("<QQQQ", area + rescue_code.FAULT_HANDLER, ours, restorer(area), mask)


def word(value: int) -> bytes:
    return _Q.pack(value & (1 << 64) - 1)


BP_JUMP: Final = 1 << 40  # rescue.c: the entry holds the four other bytes of a jump too


def bp_entry(addr: int, original: int, jmp: bytes = b"") -> bytes:
    """A breakpoint's entry: its original byte and, at a jump site, the jump's four bytes
    after its first (the rescue finishes the jump when it finds them after an int3)."""
    word = original
    if jmp:
        word |= BP_JUMP | int.from_bytes(jmp[1:5], "little") << 8
    return _QQ.pack(addr, word)


def find_areas(start: int, end: int, read: Callable[[int, int], bytes]) -> list[int]:
    """The start of every rescue area in ``[start, end)``, one line of the maps of anonymous
    executable memory: adjacent mappings of one kind merge into one line, so a later tool's
    rescue mapped right below a dead one's hides it from a look at the line's start alone
    (the dead one's int3s were then taken for another debugger's). Every page is a candidate
    start; one read a page (a rescue is skipped whole).
    """
    found = []
    at = start
    while at + AREA_SIZE <= end:
        word = read(at + HEADER + H_MAGIC, 8)
        if len(word) == 8 and _Q.unpack(word)[0] == MAGIC:
            found.append(at)
            at += AREA_SIZE
        else:
            at += PAGE
    return found


def left_breakpoints(area: int, read: Callable[[int, int], bytes]) -> dict[int, int]:
    """{address: original byte} of every int3 the rescue at ``area`` lists, or {} when no
    rescue is there (``read(at, n)`` reads up to ``n`` bytes of the program).

    A kprobes SIGKILLed on the trap tier leaves its int3s, each put back by its rescue when a
    thread next traps on it: until then the next tool finds them, and the dead tool's rescue,
    which nobody else writes, is the record of which int3s are its own and what they hide.
    """
    head = read(area + HEADER, H_SIZE)
    if len(head) < H_SIZE or _Q.unpack_from(head, H_MAGIC)[0] != MAGIC:
        return {}
    count = min(_Q.unpack_from(head, H_NBP)[0], BP_MAX)
    table = read(area + BP_TABLE, count * BP_ENTRY)
    found = {}
    for at in range(0, len(table) - BP_ENTRY + 1, BP_ENTRY):
        addr, word = _QQ.unpack_from(table, at)
        if word & BP_JUMP:
            # A jump site: the rescue's own rule (rescue.c, first_byte). Before the jump's four
            # bytes the int3 is finished into the jump (leftover.py takes that back), never
            # one byte back (a mixture); before any others, the original byte goes back.
            tail = read(addr + 1, 4)
            if len(tail) < 4 or int.from_bytes(tail, "little") == (word >> 8) & 0xFFFFFFFF:
                continue
        found[addr] = word & 0xFF
    return found


def redirect_entry(slot: int, length: int, addr: int) -> bytes:
    return _QQQ.pack(slot, length, addr)


def record(slot: int, real: int, seq: int) -> bytes:
    return _QQQ.pack(slot, real, seq)


def range_entry(addr: int, count: int) -> bytes:
    """A range of return records: where it starts and how many are in use."""
    return _QQ.pack(addr, count)


def page_entry(start: int, end: int) -> bytes:
    return _QQ.pack(start, end - start)


def put_back_mark(addr: int) -> bytes:
    """The siginfo that tells the rescue "this trap is the int3 at ``addr``'s, and the
    thread may have been put back on it" (``PTRACE_SETSIGINFO`` before rip is written)."""
    head = struct.pack("<iii4xQ", signal.SIGTRAP, PUT_BACK_ERRNO, PUT_BACK_CODE, addr)
    return head.ljust(SIGINFO_SIZE, b"\0")
