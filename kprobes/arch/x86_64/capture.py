"""Fetch-args evaluated in the program: what a record probe copies into its record, and back.

A record probe's fetch-args (``+0(%di):string``, ``+8(+16(%si)):u32``, ``$arg7``) run inside
the program, in the detour, at the hit: there is no trap and the tool reads the record long
after the registers and the memory have changed. So the detour *captures* everything the
fetch would read, and the tool evaluates the very same fetch (process/fetch/evaluate.py, the trap
tier's code) against the capture instead of the live program: ``Captured.regs`` and
``Captured.read``/``read_string`` serve the registers and the bytes that were there at the
hit. One evaluator for both tiers: an event from an optimized probe is the event the trap
would have given, but for strings longer than a ``String`` capture's limit, which are cut
there. Rejected: a second evaluator in machine code that produces the typed value
(every type, bitfield and array rule written twice, and the two drifting apart).

A ``CapturePlan`` is a list of captures, each at a fixed offset of the record's data:

    Value(Reg)            8 bytes    a register at the probe
    Bytes(base, off, n)   16 + n     the address, then a status word, then n bytes read
                                     element by element; the first faulting element stops it
    String(base, off, m)  16 + m     the address, the status, then bytes up to the NUL (kept)
                                     or m of them

``base`` is a register, a constant (a symbol's address), or a word that an earlier ``Bytes``
capture read (``+8(+16(%si))`` reads 8 bytes at ``rsi+16`` first): a chain of dereferences is
a chain of captures. The status word holds the bytes copied, ``FAULTED`` if a load faulted,
``TRUNCATED`` if a string reached its limit; 0 for a capture that was skipped because the word
it starts from was not read. Every status word is cleared first: the ring's slots are reused.

**Loads that may fault** follow the fetch fixup convention (abi.FETCH_FAULT_MAGIC): r11 holds
the magic for the whole capture code and r10 the capture's fault label, so a bad pointer
sends the thread (through the tracer, or the rescue handler if the tool is gone) to that
label, which records the fault; it never becomes the program's SIGSEGV. This is the kernel's
``copy_from_user_nofault`` with an exception table entry, in our words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kprobes.arch.x86_64.abi import FETCH_FAULT_MAGIC
from kprobes.arch.x86_64.detour import Block, at, mov_load, mov_store
from kprobes.arch.x86_64.iced import Code, Code_, Instruction, MemoryOperand, Register, Register_
from kprobes.errors import InternalError, TargetError
from kprobes.values import dataclass, field

MASK64: Final = (1 << 64) - 1
FAULTED: Final = 1 << 32
TRUNCATED: Final = 1 << 33
COUNT_MASK: Final = 0xFFFF_FFFF
ELEMENT_SIZES: Final = (1, 2, 4, 8)
GPRS: Final = (
    "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
)  # fmt: skip
REGISTERS: Final = (*GPRS, "rip", "eflags")
# A return trampoline's frame word: the call's entry time (rdtsc), which its record keeps
# beside the registers at the return (retstack.py); no spec names it.
ENTRY_TSC: Final = "entry_tsc"
# And, with an entry action, the ticket + 1 of its entry's record (shadow.py's E_DATA).
ENTRY_DATA: Final = "entry_data"
# And the $argN registers its entry kept (retstack.py), a word each: ``entry_word("rdi")``.
ENTRY_PREFIX: Final = "entry_"


def entry_word(register: str) -> str:
    """The trampoline's frame word holding ``register`` as the call's entry had it."""
    return ENTRY_PREFIX + register


def entry_register_of(word: str) -> str | None:
    """The register an ``entry_word`` holds; None for any other word."""
    if word.startswith(ENTRY_PREFIX) and word[len(ENTRY_PREFIX) :] in GPRS:
        return word[len(ENTRY_PREFIX) :]
    return None


@dataclass(frozen=True, slots=True)
class Reg:
    """A register's value at the probe point ("rip" is the probe address)."""

    name: str

    def __post_init__(self) -> None:
        name = self.name
        if (
            name not in REGISTERS
            and name not in (ENTRY_TSC, ENTRY_DATA)
            and entry_register_of(name) is None
        ):
            raise InternalError(f"{self.name} cannot be captured")


@dataclass(frozen=True, slots=True)
class Const:
    value: int


@dataclass(frozen=True, slots=True)
class Word:
    """The ``index``-th 8-byte word that ``Bytes`` capture number ``capture`` read."""

    capture: int
    index: int = 0


Src = Reg | Const | Word


@dataclass(frozen=True, slots=True)
class Value:
    reg: Reg


@dataclass(frozen=True, slots=True)
class Bytes:
    base: Src
    offset: int
    size: int
    elem: int

    def __post_init__(self) -> None:
        if self.elem not in ELEMENT_SIZES or self.size <= 0 or self.size % self.elem:
            raise InternalError(f"cannot capture {self.size} bytes by {self.elem}")


@dataclass(frozen=True, slots=True)
class String:
    base: Src
    offset: int
    limit: int

    def __post_init__(self) -> None:
        if self.limit <= 0:  # the copy takes a byte before it compares with the limit
            raise InternalError(f"a string of at most {self.limit} bytes")


Capture = Value | Bytes | String


def capture_size(c: Capture) -> int:
    if isinstance(c, Value):
        return 8
    size = c.size if isinstance(c, Bytes) else c.limit
    return 16 + (size + 7) // 8 * 8


@dataclass(slots=True)
class CapturePlan:
    """The captures of one probe, in order; ``add`` returns a capture's index (the same
    capture asked twice is made once)."""

    captures: list[Capture] = field(default_factory=list)

    def add(self, c: Capture) -> int:
        if isinstance(c, Bytes | String) and isinstance(c.base, Word):
            if not 0 <= c.base.capture < len(self.captures):
                raise InternalError(f"{c.base} names no earlier capture")
            base = self.captures[c.base.capture]
            if not isinstance(base, Bytes) or 8 * (c.base.index + 1) > base.size:
                raise InternalError(f"{c.base} names no word that was read")
        if c in self.captures:
            return self.captures.index(c)
        self.captures.append(c)
        return len(self.captures) - 1

    def offsets(self) -> list[int]:
        out, at = [], 0
        for c in self.captures:
            out.append(at)
            at += capture_size(c)
        return out

    @property
    def size(self) -> int:
        return sum(capture_size(c) for c in self.captures)

    @property
    def reads_memory(self) -> bool:
        return any(not isinstance(c, Value) for c in self.captures)

    def registers(self) -> set[str]:
        """The program registers the code reads (to save those it clobbers first)."""
        out = {c.reg.name for c in self.captures if isinstance(c, Value)}
        for c in self.captures:
            if isinstance(c, Bytes | String) and isinstance(c.base, Reg):
                out.add(c.base.name)
        return out


# -- the tool's side: the capture read back ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Region:
    addr: int
    data: bytes
    status: int
    is_string: bool


class Captured:
    """One record's captures as the evaluator wants them: the registers that were captured,
    and memory that answers only what was read at the hit (anything else is a fault)."""

    def __init__(self, plan: CapturePlan, data: bytes | memoryview) -> None:
        self.regs: dict[str, int] = {}
        self._regions: list[_Region] = []
        for c, pos in zip(plan.captures, plan.offsets(), strict=True):
            if isinstance(c, Value):
                self.regs[c.reg.name] = int.from_bytes(data[pos : pos + 8], "little")
                continue
            addr = int.from_bytes(data[pos : pos + 8], "little")
            status = int.from_bytes(data[pos + 8 : pos + 16], "little")
            count = status & COUNT_MASK
            body = bytes(data[pos + 16 : pos + 16 + count])
            self._regions.append(_Region(addr, body, status, isinstance(c, String)))

    def read(self, addr: int, size: int) -> bytes:
        for r in self._regions:
            if not r.is_string and r.addr <= addr and addr + size <= r.addr + len(r.data):
                return r.data[addr - r.addr : addr - r.addr + size]
        raise TargetError(f"{size} bytes at {addr:#x} could not be read at the hit")

    def read_string(self, addr: int, max_len: int) -> bytes:
        for r in self._regions:
            if r.is_string and r.addr == addr and r.status:
                nul = r.data.find(b"\0")
                if nul >= 0:
                    return r.data[: min(nul, max_len)]
                if r.status & FAULTED:
                    break
                return r.data[:max_len]  # truncated at the capture's limit
        raise TargetError(f"the string at {addr:#x} could not be read at the hit")


# -- the program's side: the code ------------------------------------------------------------


LoadReg = Callable[[Block, str, Register_], None]  # (block, program register, into)


def emit_captures(
    block: Block, plan: CapturePlan, rec: Register_, data_offset: int, load_reg: LoadReg
) -> None:
    """Append the capture code to ``block``: the record is at ``rec``, its captures start at
    ``data_offset``; ``load_reg`` loads a program register (the detour knows which it saved).
    Clobbers rax, rcx, rdi, r10 and r11, which the record action saves."""
    rax, rcx, rdi = Register.RAX, Register.RCX, Register.RDI
    offsets = [data_offset + o for o in plan.offsets()]
    # Step 1: clear every status word, and set r11 to the fixup magic once.
    for c, off in zip(plan.captures, offsets, strict=True):
        if not isinstance(c, Value):
            block.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(rec, off + 8), 0))
    if plan.reads_memory:
        magic = FETCH_FAULT_MAGIC
        block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, Register.R11, magic))
    for i, (c, off) in enumerate(zip(plan.captures, offsets, strict=True)):
        done = f"cap{i}_done"
        if isinstance(c, Value):
            load_reg(block, c.reg.name, rcx)
            block.add(mov_store(rec, off, rcx))
            continue
        # Step 2: the address in rdi (skipped if the word it starts from was not read).
        base = c.base
        if isinstance(base, Reg):
            load_reg(block, base.name, rdi)
        elif isinstance(base, Const):
            block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, rdi, base.value & MASK64))
        else:
            src_off = offsets[base.capture]
            status = at(rec, src_off + 8)
            block.add(Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, status))
            need = 8 * (base.index + 1)
            block.add(Instruction.create_reg_u32(Code.CMP_RM32_IMM32, Register.EAX, need))
            block.branch(Code.JB_REL32_64, done)
            block.add(mov_load(rdi, rec, src_off + 16 + 8 * base.index))
        if c.offset:
            if -(1 << 31) <= c.offset < 1 << 31:
                block.add(Instruction.create_reg_mem(Code.LEA_R64_M, rdi, at(rdi, c.offset)))
            else:
                offset = c.offset & MASK64  # the address wraps, as the evaluator's does
                block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, rax, offset))
                block.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, rdi, rax))
        block.add(mov_store(rec, off, rdi))
        # Step 3: copy, with r10 at this capture's fault label; rcx counts the bytes copied.
        block.add(Instruction.create_reg_reg(Code.XOR_R32_RM32, Register.ECX, Register.ECX))
        block.lea_label(Register.R10, f"cap{i}_fault")
        block.label(f"cap{i}_loop")
        dst = MemoryOperand(rec, rcx, 1, displ=off + 16, displ_size=8)
        src = MemoryOperand(rdi, rcx, 1, displ_size=0)
        if isinstance(c, String):
            block.add(Instruction.create_reg_mem(Code.MOVZX_R32_RM8, Register.EAX, src))
            block.add(Instruction.create_mem_reg(Code.MOV_RM8_R8, dst, Register.AL))
            block.add(Instruction.create_reg(Code.INC_RM64, rcx))
            block.add(Instruction.create_reg_reg(Code.TEST_RM8_R8, Register.AL, Register.AL))
            block.branch(Code.JE_REL32_64, f"cap{i}_store")
            block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, rcx, c.limit))
            block.branch(Code.JB_REL32_64, f"cap{i}_loop")
            block.add(Instruction.create_reg_i32(Code.BTS_RM64_IMM8, rcx, 33))  # TRUNCATED
        else:
            load, wide, store, narrow = _MOVES[c.elem]
            block.add(Instruction.create_reg_mem(load, wide, src))
            block.add(Instruction.create_mem_reg(store, dst, narrow))
            block.add(Instruction.create_reg_i32(Code.ADD_RM64_IMM8, rcx, c.elem))
            block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, rcx, c.size))
            block.branch(Code.JB_REL32_64, f"cap{i}_loop")
        block.label(f"cap{i}_store")
        block.add(mov_store(rec, off + 8, rcx))
        block.branch(Code.JMP_REL32_64, done)
        # Step 4: the fault label: the bytes before the fault, and the fault bit.
        block.label(f"cap{i}_fault")
        block.add(Instruction.create_reg_i32(Code.BTS_RM64_IMM8, rcx, 32))  # FAULTED
        block.add(mov_store(rec, off + 8, rcx))
        block.label(done)  # names the next instruction: the record action's commit follows


# element size → (load, into, store, from)
_MOVES: Final[dict[int, tuple[Code_, Register_, Code_, Register_]]] = {
    1: (Code.MOVZX_R32_RM8, Register.EAX, Code.MOV_RM8_R8, Register.AL),
    2: (Code.MOVZX_R32_RM16, Register.EAX, Code.MOV_RM16_R16, Register.AX),
    4: (Code.MOV_R32_RM32, Register.EAX, Code.MOV_RM32_R32, Register.EAX),
    8: (Code.MOV_R64_RM64, Register.RAX, Code.MOV_RM64_R64, Register.RAX),
}
