"""A user stack walked in the program, over the compact frame tables: return addresses only.

The fast tier's stacks, without copying the stack (issue 23, item 5). The tool compiles each
mapped file's ``.eh_frame`` into compact rows (symbols/frametable.py) and puts them, with a
directory of the mappings they cover, in memory the program can read (``pack_directory``).
The code built here (``emit_stack_walk``) walks the thread's stack there, as
symbols/tablewalk.py does in Python: for each frame, find the mapping that holds the pc
(a scan of the directory: a process maps tens of files), then its row (a bisection of the
table's row starts), then the CFA (rsp or rbp plus the row's offset), the return address at
CFA-8 and the caller's rbp; it writes each return address, 8 bytes a frame, and a status
word that says how many there are and why the walk ended. Where no row covers the pc it
follows the frame pointer, as both unwinders of the tool do.

Every load from the stack follows the fetch fixup convention (abi.FETCH_FAULT_MAGIC): r11
holds the magic and r10 the walk's fault label for the whole walk, so a stack that cannot
be read ends the walk (``WalkStop.UNREADABLE``) and never becomes the program's SIGSEGV.
One difference from the Python walk: a caller's rbp that cannot be read ends the walk here,
where tablewalk.py goes on without it (rbp's slot lies beside the return address's, which
was just read: it does not happen on a real stack).

The directory (absolute address ``directory``)::

    0     u64 count
    8     u64 the shadow stacks of the fast return probes (retstack.py; 0: none), then the
          range of their trampolines (u64 start, u64 end)
    32    entries, 48 bytes each: start, end (the executable mapping, run-time addresses),
          bias (run-time minus link-time), then u32s: the table's offset from the entry,
          its rows, its index's offset from the entry, the index's blocks, the first
          row's start
    table u32 starts[rows] (link-time, sorted), then rows[rows] of 8 bytes:
          i32 CFA offset, i16 rbp's offset from the CFA (0: kept), u8 base (6 rbp, 7 rsp),
          u8 kind (frametable.Kind: 0 CFA, 1 outermost, 2 marker, 3 not covered)
    index u32[blocks + 1]: for each 256 bytes of code from the first row's start, the row
          holding its first byte; the last is the last row

The index narrows the bisection to the rows of one block: libc's 28,274 rows take 15 steps
without it, each a branch the processor cannot predict and a load that may miss the cache
(~30 ns a frame), and 2-3 with it. It is what SFrame's and the kernel's ORC lookup tables
do for the same reason.

**Our return trampolines.** A return address in the trampolines' range is a frame a fast
return probe hooked: the real one is in the thread's shadow stack (shadow.py), in the
newest entry whose return slot is the slot the address was read from (CFA-8). The walk
finds the thread's slot by its thread pointer (``rdfsbase``), as the trampoline does, and
goes on from the real address; a hooked frame with no entry (it cannot happen but for a
frame released by a ``longjmp``) ends the walk as ``NO_UNWIND_INFO``. So the stacks of the
fast tier show the real callers, never a trampoline.

Offsets are from the entry, not from the directory, so that a frame's lookup needs the
directory's address once: a walk given the address of a word that holds it (``indirect``,
the tool's way: process/fast/frametables.py) loads it once a frame, and a directory
replaced meanwhile (a new one published, the old one left in place) is read whole, old or
new, never half of each.

The output (``out``): a status word (the return addresses written, bits 0-31; the
``WalkStop``, bits 32-39), then the return addresses. The record action runs the walk when
it is given a ``StackWalk`` (record.py); process/fast/frametables.py keeps the tables in the
program and the directory current as files are mapped.

Rejected: copying the stack for the tool to unwind later (perf's ``--call-graph dwarf``:
8 KiB a hit, which is why users avoid it); walking the frame-pointer chain alone (wrong on
the -O2 code distributions ship).
"""

from __future__ import annotations

import bisect
import functools
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Final

from kprobes.arch.x86_64 import shadow
from kprobes.arch.x86_64.abi import FETCH_FAULT_MAGIC
from kprobes.arch.x86_64.detour import Block, at, mov_load, mov_store
from kprobes.arch.x86_64.iced import Code, Instruction, MemoryOperand, Register, Register_
from kprobes.errors import InternalError
from kprobes.values import dataclass

DIR_HEADER: Final = 32  # the count, the shadow stacks, the trampolines' range
# start, end, bias; table offset, rows; index offset, blocks, first row's start; padding
ENTRY: Final = struct.Struct("<QQQIIIIII")
BLOCK_SHIFT: Final = 8  # the index has an entry per 256 bytes of code
ROW_SIZE: Final = 8
ROW_BASE: Final = 6  # offsets inside a row
ROW_KIND: Final = 7
ROW_RBP: Final = 4
KIND_CFA: Final = 0
KIND_OUTERMOST: Final = 1
KIND_UNSUPPORTED: Final = 2
DWARF_RSP: Final = 7
STATUS: Final = 8  # the status word, then the return addresses
STOP_SHIFT: Final = 32
_MAX_FP_FRAME: Final = 1 << 24  # as unwind.py: a frame pointer farther up is not one


class WalkStop(IntEnum):
    """Why the walk in the program ended (symbols/unwind.py's StopReason, in a byte)."""

    OUTERMOST = 0
    NO_UNWIND_INFO = 1
    UNSUPPORTED = 2
    UNREADABLE = 3
    NOT_OUTWARD = 4
    MAX_FRAMES = 5


@dataclass(frozen=True, slots=True)
class MappedTable:
    """One executable mapping and the compact table of its file (frametable.FrameTable's
    ``to_bytes()``, ``rows`` rows)."""

    start: int
    end: int
    bias: int
    table: bytes
    rows: int

    def __post_init__(self) -> None:
        if len(self.table) != self.rows * (4 + ROW_SIZE):
            raise InternalError(f"a table of {len(self.table)} bytes for {self.rows} rows")


def pack_directory(
    mappings: Sequence[MappedTable], returns: tuple[int, int, int] = (0, 0, 0)
) -> bytes:
    """The directory, the tables and their indexes, as the walker reads them (any order
    given; sorted); ``returns``: the shadow stacks and the trampolines' start and end."""
    ordered = sorted(mappings, key=lambda m: m.start)
    offset = DIR_HEADER + ENTRY.size * len(ordered)
    head = [struct.pack("<4Q", len(ordered), *returns)]
    parts = []
    for i, m in enumerate(ordered):
        offset = (offset + 7) & ~7
        index, first = block_index(m.table, m.rows)
        entry = DIR_HEADER + ENTRY.size * i  # offsets are the entry's (the module docstring)
        index_at = offset + len(m.table) - entry
        blocks = max(len(index) // 4 - 1, 0)
        fields = (offset - entry, m.rows, index_at, blocks, first, 0)
        head.append(ENTRY.pack(m.start, m.end, m.bias, *fields))
        parts.append((offset, m.table + index))
        offset += len(m.table) + len(index)
    out = bytearray(b"".join(head))
    for at_offset, part in parts:
        out += bytes(at_offset - len(out)) + part
    return bytes(out)


def block_index(table: bytes, rows: int) -> tuple[bytes, int]:
    """The index of a table (u32s) and the first row's start; empty for an empty table."""
    if not rows:
        return b"", 0
    starts = struct.unpack_from(f"<{rows}I", table)
    first = starts[0]
    blocks = ((starts[-1] - first) >> BLOCK_SHIFT) + 1
    index = [bisect.bisect_right(starts, first + (b << BLOCK_SHIFT)) - 1 for b in range(blocks + 1)]
    return struct.pack(f"<{len(index)}I", *index), first


@dataclass(frozen=True, slots=True)
class StackWalk:
    """A walk for a record: the tables' directory (an absolute address; with ``indirect``,
    the address of a word that holds it) and how many return addresses at most; ``size``
    bytes of the record hold its output."""

    directory: int
    max_returns: int
    indirect: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.max_returns < 1 << 16:
            raise InternalError(f"a walk of {self.max_returns} frames")

    @property
    def size(self) -> int:
        return STATUS + 8 * self.max_returns


@dataclass(frozen=True, slots=True)
class WalkResult:
    """What a walk wrote: its return addresses, outermost last, and why it ended."""

    returns: tuple[int, ...]
    stop: WalkStop


def read_walk(data: bytes | memoryview) -> WalkResult:
    """The walk's output, read back by the tool."""
    (status,) = struct.unpack_from("<Q", data, 0)
    count = status & 0xFFFF_FFFF
    returns = struct.unpack_from(f"<{count}Q", data, STATUS)
    return WalkResult(returns, WalkStop((status >> STOP_SHIFT) & 0xFF))


def read_walk_at(data: bytes, at: int) -> WalkResult:
    """``read_walk`` of the output at byte ``at`` of a record, each walk decoded once (a busy
    probe's repeat): the same value each time, which the naming of stacks (stacks.py) then
    finds by identity. Only the output's used bytes are the key (the slots past its last
    return address hold what an older record left there)."""
    count = int.from_bytes(data[at : at + 4], "little")
    return _read_walk_once(data[at : at + STATUS + 8 * count])


@functools.lru_cache(maxsize=4096)
def _read_walk_once(data: bytes) -> WalkResult:
    return read_walk(data)


# The walker's registers: the frame's pc, sp and rbp; the lookup address; the output. rbx
# and rsi are left alone: the record action keeps its record and its ticket there.
PC, SP, BP, LOOKUP, OUT, COUNT = (Register.RAX, Register.RDX, Register.RBP, Register.R8,
                                  Register.RDI, Register.RCX)  # fmt: skip
_ENTRY_P, _LO, _T1, _T2, _ROWS = Register.R9, Register.R15, Register.R12, Register.R13, Register.R14
CLOBBERS: Final = ("rax", "rcx", "rdx", "rbp", "rdi", "r8", "r9", "r10", "r11", "r12",
                   "r13", "r14", "r15")  # fmt: skip
# A hashing walk (``hashing``) folds each return address, then the status word, into HASH:
# HASH = (HASH ^ word) * HASH_MUL (FNV-1a's step, a word at a time); both are left alone by
# the walk, as rbx and rsi are.
HASH, HASH_MUL = Register.RBX, Register.RSI


def emit_stack_walk(
    block: Block,
    directory: int,
    max_returns: int,
    *,
    indirect: bool = False,
    hashing: bool = False,
) -> None:
    """Append the walk to ``block``. In: rax = the pc of the innermost frame (exact: the
    probed instruction), rdx = its rsp, rbp = its rbp, rdi = the output. Writes at most
    ``max_returns`` return addresses. ``indirect``: ``directory`` is the address of a word
    that holds the directory's (0: none yet, every frame is uncovered). ``hashing``:
    nothing is written, each return address and the status word are folded into HASH
    instead (rdi is not used). Clobbers ``CLOBBERS`` and the arithmetic flags."""
    if not 0 < max_returns < 1 << 16:
        raise InternalError(f"a walk of {max_returns} frames")
    add = block.add
    # Step 1: the fault convention for the whole walk, no frame yet, the exact pc.
    add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, Register.R11, FETCH_FAULT_MAGIC))
    block.lea_label(Register.R10, "sw_fault")
    add(Instruction.create_reg_reg(Code.XOR_R32_RM32, Register.ECX, Register.ECX))
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, LOOKUP, PC))
    block.label("sw_frame")
    _emit_find_row(block, directory, indirect)
    # Step 4: the row's kind; a CFA row gives the caller.
    add(Instruction.create_reg_mem(Code.MOVZX_R32_RM8, Register.R12D, at(_ROWS, ROW_KIND)))
    add(Instruction.create_reg_i32(Code.CMP_RM32_IMM8, Register.R12D, KIND_CFA))
    block.branch(Code.JNE_REL32_64, "sw_not_cfa")
    _emit_cfa_step(block)
    # Step 6: the caller's return address is written, unless ``max_returns`` already are
    # (then the walk ends short of it, as unwind.py's depth limit ends it); its frame is next.
    block.label("sw_push")
    _emit_real_return(block, directory, indirect)
    add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, COUNT, max_returns))
    block.branch(Code.JAE_REL32_64, "sw_max")
    if hashing:
        _emit_fold(block, PC)
    else:
        add(Instruction.create_mem_reg(Code.MOV_RM64_R64, _at_index(OUT, COUNT, STATUS), PC))
    add(Instruction.create_reg(Code.INC_RM64, COUNT))
    add(Instruction.create_reg_mem(Code.LEA_R64_M, LOOKUP, at(PC, -1)))  # the call's row
    block.branch(Code.JMP_REL32_64, "sw_frame")
    block.label("sw_not_cfa")
    add(Instruction.create_reg_i32(Code.CMP_RM32_IMM8, Register.R12D, KIND_OUTERMOST))
    block.branch(Code.JE_REL32_64, "sw_outermost")
    add(Instruction.create_reg_i32(Code.CMP_RM32_IMM8, Register.R12D, KIND_UNSUPPORTED))
    block.branch(Code.JE_REL32_64, "sw_unsupported")
    _emit_frame_pointer(block)
    _emit_stops(block, hashing)


def _emit_fold(block: Block, word: Register_) -> None:
    """HASH = (HASH ^ word) * HASH_MUL."""
    block.add(Instruction.create_reg_reg(Code.XOR_R64_RM64, HASH, word))
    block.add(Instruction.create_reg_reg(Code.IMUL_R64_RM64, HASH, HASH_MUL))


def _emit_find_row(block: Block, directory: int, indirect: bool) -> None:
    """Steps 2-3: _ROWS = the row of LOOKUP, or a jump to "sw_uncovered"."""
    add = block.add
    # Step 2: the mapping holding LOOKUP (entries sorted by start; a scan).
    add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, _ENTRY_P, directory))
    if indirect:  # the directory published now (read once a frame)
        add(mov_load(_ENTRY_P, _ENTRY_P, 0))
        add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _ENTRY_P, _ENTRY_P))
        block.branch(Code.JE_REL32_64, "sw_uncovered")
    add(mov_load(_T1, _ENTRY_P, 0))
    add(Instruction.create_reg_i32(Code.ADD_RM64_IMM8, _ENTRY_P, DIR_HEADER))
    block.label("sw_mapping")
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _T1, _T1))
    block.branch(Code.JE_REL32_64, "sw_uncovered")
    add(Instruction.create_reg_mem(Code.CMP_R64_RM64, LOOKUP, at(_ENTRY_P, 0)))
    block.branch(Code.JB_REL32_64, "sw_uncovered")  # sorted: no later one starts lower
    add(Instruction.create_reg_mem(Code.CMP_R64_RM64, LOOKUP, at(_ENTRY_P, 8)))
    block.branch(Code.JB_REL32_64, "sw_mapped")
    add(Instruction.create_reg_i32(Code.ADD_RM64_IMM8, _ENTRY_P, ENTRY.size))
    add(Instruction.create_reg(Code.DEC_RM64, _T1))
    block.branch(Code.JMP_REL32_64, "sw_mapping")
    # Step 3: its table; the link-time address (32 bits); the rows of its block in the
    # index: starts[lo] <= rel < starts[hi] (hi = rows past the last block).
    block.label("sw_mapped")
    add(Instruction.create_reg_mem(Code.SUB_R64_RM64, LOOKUP, at(_ENTRY_P, 16)))
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _T1, LOOKUP))
    add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, _T1, 32))
    block.branch(Code.JNE_REL32_64, "sw_uncovered")
    add(Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.R13D, at(_ENTRY_P, 28)))
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _T2, _T2))
    block.branch(Code.JE_REL32_64, "sw_uncovered")
    add(Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.R12D, at(_ENTRY_P, 24)))
    add(Instruction.create_reg_reg(Code.ADD_R64_RM64, _T1, _ENTRY_P))  # the starts
    add(Instruction.create_reg_mem(Code.LEA_R64_M, _ROWS, _at_index(_T1, _T2, 0, 4)))
    add(Instruction.create_reg_reg(Code.MOV_R32_RM32, Register.EAX, Register.R8D))
    add(Instruction.create_reg_mem(Code.SUB_R32_RM32, Register.EAX, at(_ENTRY_P, 40)))
    block.branch(Code.JB_REL32_64, "sw_uncovered")  # below the first row
    add(Instruction.create_reg_i32(Code.SHR_RM32_IMM8, Register.EAX, BLOCK_SHIFT))
    add(Instruction.create_reg_mem(Code.LEA_R64_M, _LO, at(_T2, -1)))
    add(Instruction.create_reg_mem(Code.CMP_R32_RM32, Register.EAX, at(_ENTRY_P, 36)))
    block.branch(Code.JAE_REL32_64, "sw_range")  # past the last block: the last row
    add(Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.R13D, at(_ENTRY_P, 32)))
    add(Instruction.create_reg_reg(Code.ADD_R64_RM64, _T2, _ENTRY_P))  # the index
    add(Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.R15D, _at_index(_T2, PC, 0, 4)))
    add(Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.R13D, _at_index(_T2, PC, 4, 4)))
    add(Instruction.create_reg(Code.INC_RM64, _T2))
    block.label("sw_range")
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _ENTRY_P, _T1))
    block.label("sw_bisect")
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _T1, _T2))
    add(Instruction.create_reg_reg(Code.SUB_R64_RM64, _T1, _LO))
    add(Instruction.create_reg_i32(Code.CMP_RM64_IMM8, _T1, 1))
    block.branch(Code.JBE_REL32_64, "sw_row")
    add(Instruction.create_reg_mem(Code.LEA_R64_M, _T1, _at_index(_LO, _T2, 0, 1)))
    add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, _T1, 1))
    add(Instruction.create_reg_mem(Code.CMP_R32_RM32, Register.R8D, _at_index(_ENTRY_P, _T1, 0, 4)))
    block.branch(Code.JB_REL32_64, "sw_lower")
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _LO, _T1))
    block.branch(Code.JMP_REL32_64, "sw_bisect")
    block.label("sw_lower")
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _T2, _T1))
    block.branch(Code.JMP_REL32_64, "sw_bisect")
    block.label("sw_row")
    add(Instruction.create_reg_mem(Code.LEA_R64_M, _ROWS, _at_index(_ROWS, _LO, 0, ROW_SIZE)))


def _emit_real_return(block: Block, directory: int, indirect: bool) -> None:
    """Step 6a: PC in our trampolines' range is replaced by the real return address of the
    thread's newest shadow entry whose slot is SP-8 (the module docstring), or the walk
    ends. Clobbers LOOKUP and _ENTRY_P, _LO, _T1, _T2, _ROWS (free between two frames)."""
    add = block.add
    add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, _ENTRY_P, directory))
    if indirect:
        add(mov_load(_ENTRY_P, _ENTRY_P, 0))
        add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _ENTRY_P, _ENTRY_P))
        block.branch(Code.JE_REL32_64, "sw_real")
    add(Instruction.create_reg_mem(Code.CMP_R64_RM64, PC, at(_ENTRY_P, 16)))
    block.branch(Code.JB_REL32_64, "sw_real")
    add(Instruction.create_reg_mem(Code.CMP_R64_RM64, PC, at(_ENTRY_P, 24)))
    block.branch(Code.JAE_REL32_64, "sw_real")
    # The thread's slot: its thread pointer hashed, then probed as the trampoline does.
    add(Instruction.create_reg(Code.RDFSBASE_R64, LOOKUP))
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _LO, LOOKUP))
    add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, _LO, 12))
    add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, _LO, _LO, shadow.HASH))
    add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, _LO, 16))
    add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.R15D, shadow.NTHREADS - 1))
    add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.R13D, shadow.NTHREADS))
    block.label("sw_look")
    add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, _ROWS, _LO, shadow.SLOT_STRIDE))
    add(Instruction.create_reg_mem(Code.ADD_R64_RM64, _ROWS, at(_ENTRY_P, 8)))
    add(mov_load(_T1, _ROWS, shadow.T_OWNER))  # may fault: r10
    add(Instruction.create_reg_reg(Code.CMP_R64_RM64, _T1, LOOKUP))
    block.branch(Code.JE_REL32_64, "sw_thread")
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _T1, _T1))
    block.branch(Code.JE_REL32_64, "sw_no_info")
    add(Instruction.create_reg(Code.INC_RM32, Register.R15D))
    add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.R15D, shadow.NTHREADS - 1))
    add(Instruction.create_reg(Code.DEC_RM32, Register.R13D))
    block.branch(Code.JNE_REL32_64, "sw_look")
    block.branch(Code.JMP_REL32_64, "sw_no_info")
    # Its entries, newest first, for the one whose return slot is SP-8.
    block.label("sw_thread")
    add(Instruction.create_reg_mem(Code.LEA_R64_M, _T1, at(SP, -8)))
    add(mov_load(_T2, _ROWS, shadow.T_DEPTH))
    block.label("sw_entry")
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _T2, _T2))
    block.branch(Code.JE_REL32_64, "sw_no_info")
    add(Instruction.create_reg(Code.DEC_RM64, _T2))
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _LO, _T2))
    add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, _LO, _LO, shadow.ENTRY))
    add(Instruction.create_reg_reg(Code.ADD_R64_RM64, _LO, _ROWS))
    add(
        Instruction.create_reg_mem(
            Code.CMP_R64_RM64, _T1, at(_LO, shadow.T_ENTRIES + shadow.E_STACK)
        )
    )
    block.branch(Code.JNE_REL32_64, "sw_entry")
    add(mov_load(PC, _LO, shadow.T_ENTRIES + shadow.E_RET))
    block.label("sw_real")


def _emit_cfa_step(block: Block) -> None:
    """Step 5: CFA = base + offset (above sp, or the stack is corrupt); PC = [CFA-8] (0: the
    outermost frame); BP = [CFA + rbp offset] where saved; SP = CFA."""
    add = block.add
    add(Instruction.create_reg_mem(Code.MOVSXD_R64_RM32, _T1, at(_ROWS, 0)))
    add(Instruction.create_mem_i32(Code.CMP_RM8_IMM8, _byte(_ROWS, ROW_BASE), DWARF_RSP))
    block.branch(Code.JNE_REL32_64, "sw_on_rbp")
    add(Instruction.create_reg_reg(Code.ADD_R64_RM64, _T1, SP))
    block.branch(Code.JMP_REL32_64, "sw_cfa")
    block.label("sw_on_rbp")
    add(Instruction.create_reg_reg(Code.ADD_R64_RM64, _T1, BP))
    block.label("sw_cfa")
    add(Instruction.create_reg_reg(Code.CMP_R64_RM64, _T1, SP))
    block.branch(Code.JBE_REL32_64, "sw_not_outward")
    add(mov_load(PC, _T1, -8))  # may fault: r10
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, PC, PC))
    block.branch(Code.JE_REL32_64, "sw_outermost")
    add(Instruction.create_reg_mem(Code.MOVSX_R64_RM16, _T2, at(_ROWS, ROW_RBP)))
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, _T2, _T2))
    block.branch(Code.JE_REL32_64, "sw_rbp_kept")
    add(Instruction.create_reg_mem(Code.MOV_R64_RM64, BP, _at_index(_T1, _T2, 0, 1)))  # fault
    block.label("sw_rbp_kept")
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, SP, _T1))


def _emit_frame_pointer(block: Block) -> None:
    """No row: rbp frames the function if it is aligned and a little above sp; then PC =
    [rbp+8], SP = rbp+16, BP = [rbp] (the order matters: BP last)."""
    add = block.add
    block.label("sw_uncovered")
    add(Instruction.create_reg_i32(Code.TEST_RM8_IMM8, Register.BPL, 7))
    block.branch(Code.JNE_REL32_64, "sw_no_info")
    add(Instruction.create_reg_reg(Code.MOV_R64_RM64, _T1, BP))
    add(Instruction.create_reg_reg(Code.SUB_R64_RM64, _T1, SP))
    block.branch(Code.JB_REL32_64, "sw_no_info")  # rbp below sp
    add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, _T1, _MAX_FP_FRAME))
    block.branch(Code.JAE_REL32_64, "sw_no_info")
    add(mov_load(PC, BP, 8))  # may fault: r10
    add(Instruction.create_reg_mem(Code.LEA_R64_M, SP, at(BP, 16)))
    add(mov_load(BP, BP, 0))  # may fault: r10
    add(Instruction.create_reg_reg(Code.TEST_RM64_R64, PC, PC))
    block.branch(Code.JE_REL32_64, "sw_outermost")
    block.branch(Code.JMP_REL32_64, "sw_push")


def _emit_stops(block: Block, hashing: bool) -> None:
    """The ends: the status word = the count | the reason << 32 (stored, or folded)."""
    for label, stop in (
        ("sw_outermost", WalkStop.OUTERMOST),
        ("sw_no_info", WalkStop.NO_UNWIND_INFO),
        ("sw_unsupported", WalkStop.UNSUPPORTED),
        ("sw_fault", WalkStop.UNREADABLE),
        ("sw_not_outward", WalkStop.NOT_OUTWARD),
        ("sw_max", WalkStop.MAX_FRAMES),
    ):
        block.label(label)
        block.add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.R12D, stop))
        block.branch(Code.JMP_REL32_64, "sw_status")
    block.label("sw_status")
    block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, _T1, STOP_SHIFT))
    block.add(Instruction.create_reg_reg(Code.OR_R64_RM64, _T1, COUNT))
    if hashing:
        _emit_fold(block, _T1)
    else:
        block.add(mov_store(OUT, 0, _T1))


def _at_index(base: Register_, index: Register_, disp: int, scale: int = 8) -> MemoryOperand:
    size = 0 if disp == 0 else 1 if -128 <= disp < 128 else 8
    return MemoryOperand(base, index, scale, displ=disp, displ_size=size)


def _byte(base: Register_, disp: int) -> MemoryOperand:
    return MemoryOperand(base, displ=disp, displ_size=1)


def build_walk_function(addr: int, directory: int, max_returns: int) -> bytes:
    """The walk as a C function at ``addr`` (for tests and benchmarks of the code alone):
    ``void walk(const uint64_t regs[3] /* pc, sp, rbp */, uint64_t *out)``."""
    block = Block()
    saved = (Register.RBP, Register.R12, Register.R13, Register.R14, Register.R15)
    for reg in saved:
        block.add(Instruction.create_reg(Code.PUSH_R64, reg))
    block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, Register.R9, Register.RDI))
    block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, OUT, Register.RSI))
    block.add(mov_load(PC, Register.R9, 0))
    block.add(mov_load(SP, Register.R9, 8))
    block.add(mov_load(BP, Register.R9, 16))
    emit_stack_walk(block, directory, max_returns)
    for reg in reversed(saved):
        block.add(Instruction.create_reg(Code.POP_R64, reg))
    block.add(Instruction.create(Code.RETNQ))
    return block.encode(addr)
