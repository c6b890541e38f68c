"""Stack ids: hits counted by user stack in the program, with no record per hit.

``stackcount`` on the fast tier (issue 23, item 5). The detour walks the thread's stack over
the compact frame tables (stackwalk.py) without writing anything, folding each return
address and the walk's status word into a 64-bit hash (FNV-1a's step, a word at a time,
seeded by the probe's id): the stack id. It looks the id up in a table in the shared area
(open addressing, linear probing): a known id has its count incremented (``lock inc``); an
unknown one claims a free entry (``lock cmpxchg`` of its key from 0), then the detour walks
the stack a second time, writing the return addresses into the entry, and marks it ready
last. So the addresses of a stack are written once, at its first hit; every later hit is a
walk, a hash, a probe of the table and an increment. The tool reads the table when it
reports (stackcount's counts are the entries' counts).

An entry (``stride`` bytes, a multiple of 8)::

    0   u64 key      the stack id (never 0: an id of 0 is made 1); 0: a free entry
    8   u64 count    hits of this stack
    16  u64 meta     the probe's id | READY, written after the addresses
    24  the walk's output (stackwalk.py): its status word, then the return addresses

**A full table is counted, never hidden**: a hit that finds no entry in ``PROBES`` steps of
probing increments the area's ``OFF_STACKS_LOST`` word, which the tool reports as hits not
counted (with the ring's drops). Two stacks with one id would be counted as one: with a
64-bit id, ~n²/2⁶⁵ for n stacks, which is accepted (bcc's stack ids are a 32-bit hash of
the same kind, and collide). The second walk reads the same stack and the same tables as
the first, unless another thread publishes new tables in between (a ``dlopen``): the entry
then holds the newer walk's addresses.

Rejected: copying the walk into a buffer to hash it and then into the entry (a buffer of
``8 * depth`` bytes on the program's stack, which a small thread stack or a signal stack
may not have: the second walk costs once per distinct stack); a record per hit counted in
the tool (a full ring drops records, and counts must be exact).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

from kprobes.arch.x86_64.capture import LoadReg
from kprobes.arch.x86_64.detour import Block, Frame, at, mov_load, mov_store, rip_operand
from kprobes.arch.x86_64.iced import Code, Instruction, Register
from kprobes.arch.x86_64.record import register_loader
from kprobes.arch.x86_64.stackwalk import CLOBBERS as WALK_CLOBBERS
from kprobes.arch.x86_64.stackwalk import (
    HASH,
    HASH_MUL,
    STATUS,
    StackWalk,
    WalkResult,
    emit_stack_walk,
    read_walk,
)
from kprobes.errors import InternalError
from kprobes.values import dataclass

ENTRY_KEY: Final = 0
ENTRY_COUNT: Final = 8
ENTRY_META: Final = 16
ENTRY_WALK: Final = 24
READY: Final = 1 << 63
PROBES: Final = 32  # entries looked at before a hit counts as lost
FNV_BASIS: Final = 0xCBF29CE484222325
FNV_PRIME: Final = 0x100000001B3
_MASK64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15
_INDEX_SHIFT: Final = 29


def stride_for(max_returns: int) -> int:
    """Bytes of an entry that holds up to ``max_returns`` return addresses."""
    return ENTRY_WALK + STATUS + 8 * max_returns


def seed_of(probe_id: int) -> int:
    """The hash a probe's walk starts from: two probes' equal stacks have two ids."""
    return FNV_BASIS ^ (probe_id * _GOLDEN & _MASK64)


@dataclass(frozen=True, slots=True)
class StackTable:
    """The table as the program sees it: absolute addresses in its mapping of the area."""

    addr: int
    entries: int  # a power of two
    stride: int
    lost: int  # the area's OFF_STACKS_LOST word

    def __post_init__(self) -> None:
        if self.entries <= 0 or self.entries & (self.entries - 1) or self.entries >= 1 << 24:
            raise InternalError(f"a stack table of {self.entries} entries")


@dataclass(frozen=True, slots=True)
class StackCountAction:
    """Count the hit (``counter``, what ``nhit`` reads) and its stack: the id's entry in
    ``table`` (the module docstring)."""

    probe_id: int
    table: StackTable
    walk: StackWalk
    counter: int

    def __post_init__(self) -> None:
        if not 0 <= self.probe_id < 1 << 31:
            raise InternalError(f"probe id {self.probe_id} does not fit")
        if stride_for(self.walk.max_returns) > self.table.stride:
            raise InternalError(f"{self.walk.max_returns} frames in {self.table.stride} bytes")

    @property
    def clobbers(self) -> tuple[str, ...]:
        return ("rbx", "rsi", *WALK_CLOBBERS)

    @property
    def reads_flags(self) -> bool:
        return False

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None:
        """Step 1: count the hit; Steps 2-3: the stack id; Step 4: its entry; Step 5: a new
        id's addresses; Step 6: its count."""
        add, walk = block.add, self.walk
        add(Instruction.create_mem(Code.INC_RM64, rip_operand(self.counter)), lock=True)
        load_reg = register_loader(frame, probe_addr)
        # Step 2: the id: the walk's words folded into the probe's seed (0 is a free key).
        self._load_frame(block, load_reg)
        add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, HASH, seed_of(self.probe_id)))
        add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, HASH_MUL, FNV_PRIME))
        outer = block.prefix
        block.prefix = f"{outer}h."
        emit_stack_walk(block, walk.directory, walk.max_returns, indirect=walk.indirect,
                        hashing=True)  # fmt: skip
        block.prefix = outer
        add(Instruction.create_reg_reg(Code.TEST_RM64_R64, HASH, HASH))
        block.branch(Code.JNE_REL32_64, "sc_id")
        add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.EBX, 1))
        block.label("sc_id")
        self._emit_lookup(block)
        # Step 5: a new id: the walk again, its output into the entry, then the meta word.
        block.label("sc_new")
        add(Instruction.create_reg_reg(Code.MOV_R64_RM64, HASH, Register.R8))
        self._load_frame(block, load_reg)
        add(Instruction.create_reg_mem(Code.LEA_R64_M, Register.RDI, at(HASH, ENTRY_WALK)))
        block.prefix = f"{outer}w."
        emit_stack_walk(block, walk.directory, walk.max_returns, indirect=walk.indirect)
        block.prefix = outer
        add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, Register.RCX, self.probe_id | READY))
        add(mov_store(HASH, ENTRY_META, Register.RCX))
        add(Instruction.create_reg_reg(Code.MOV_R64_RM64, Register.R8, HASH))
        # Step 6: one more hit of this stack.
        block.label("sc_found")
        add(Instruction.create_mem(Code.INC_RM64, at(Register.R8, ENTRY_COUNT)), lock=True)
        block.label("sc_done")

    @staticmethod
    def _load_frame(block: Block, load_reg: LoadReg) -> None:
        """rax, rdx, rbp = the probe's pc, rsp and rbp, as the walk takes them."""
        load_reg(block, "rip", Register.RAX)
        load_reg(block, "rsp", Register.RDX)
        load_reg(block, "rbp", Register.RBP)

    def _emit_lookup(self, block: Block) -> None:
        """Steps 3-4: r8 = the id's entry, to "sc_found", or a free one claimed, to
        "sc_new"; after ``PROBES`` entries, the lost word counts the hit (to "sc_done")."""
        add, table = block.add, self.table
        rcx, r8, r9, rax = Register.RCX, Register.R8, Register.R9, Register.RAX
        # Step 3: the first entry to look at (the id's high bits folded into its low ones).
        add(Instruction.create_reg_reg(Code.MOV_R64_RM64, rcx, HASH))
        add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, rcx, _INDEX_SHIFT))
        add(Instruction.create_reg_reg(Code.XOR_R64_RM64, rcx, HASH))
        add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.ECX, table.entries - 1))
        add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.EDX, PROBES))
        add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, r9, table.addr))
        # Step 4: linear probing; a free key is claimed with a cmpxchg (another thread may
        # claim it first: then its key is looked at as any other).
        block.label("sc_probe")
        add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, r8, rcx, table.stride))
        add(Instruction.create_reg_reg(Code.ADD_R64_RM64, r8, r9))
        add(mov_load(rax, r8, ENTRY_KEY))
        add(Instruction.create_reg_reg(Code.CMP_R64_RM64, rax, HASH))
        block.branch(Code.JE_REL32_64, "sc_found")
        add(Instruction.create_reg_reg(Code.TEST_RM64_R64, rax, rax))
        block.branch(Code.JNE_REL32_64, "sc_next")
        add(Instruction.create_mem_reg(Code.CMPXCHG_RM64_R64, at(r8, ENTRY_KEY), HASH), lock=True)
        block.branch(Code.JE_REL32_64, "sc_new")
        add(Instruction.create_reg_reg(Code.CMP_R64_RM64, rax, HASH))
        block.branch(Code.JE_REL32_64, "sc_found")
        block.label("sc_next")
        add(Instruction.create_reg(Code.INC_RM32, Register.ECX))
        add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.ECX, table.entries - 1))
        add(Instruction.create_reg(Code.DEC_RM32, Register.EDX))
        block.branch(Code.JNE_REL32_64, "sc_probe")
        add(Instruction.create_mem(Code.INC_RM64, rip_operand(table.lost)), lock=True)
        block.branch(Code.JMP_REL32_64, "sc_done")


@dataclass(frozen=True, slots=True)
class StackEntry:
    """One stack id's entry, as the tool reads it: its probe, its hits, its walk (None: its
    addresses are still being written)."""

    index: int
    probe: int
    count: int
    walk: WalkResult | None


def iter_entries(view: memoryview, offset: int, entries: int, stride: int) -> Iterator[StackEntry]:
    """The claimed entries of the table at ``offset`` of an area (``view``, bytes)."""
    words = view.cast("B").cast("Q")
    try:
        first, step = offset // 8, stride // 8
        keys = words[first : first + entries * step : step].tolist()
        counts = words[first + 1 : first + 1 + entries * step : step].tolist()
        for i, key in enumerate(keys):
            if not key:
                continue
            meta = int(words[first + i * step + 2])  # after the key: TSO, and it is read once
            walk = None
            if meta & READY:
                start = offset + i * stride + ENTRY_WALK
                walk = read_walk(bytes(view[start : start + stride - ENTRY_WALK]))
            yield StackEntry(i, meta & 0xFFFF_FFFF, counts[i], walk)
    finally:
        words.release()


def read_lost(view: memoryview, offset: int) -> int:
    """The area's count of hits not counted by stack (the table was full)."""
    (value,) = struct.unpack_from("<Q", view, offset)
    return int(value)
