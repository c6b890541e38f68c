"""The *record* action of a detour: one record per hit in the shared ring, fetch-args included.

The action reserves ``slots`` slots (shared_area.py has the protocol), writes the header, the
registers if the probe's handler wants them, the captures of its fetch-args (capture.py), and
the commit word last; when the ring is full it counts a drop and writes nothing, and fetches
nothing. Reserving first is what makes a record probe cheap to leave behind: after the tool's
death nobody reads the ring, it fills, and from then on a hit costs the reservation's check.
An action that ``may_wait`` (``--block``) retries a full ring, with a ``pause`` between two
tries, as long as the reader's lease holds (shared_area.py), and only then drops.

The thread is identified by its fs base, the thread pointer that glibc and musl point at their
thread control block and that the tracer reads in every thread's registers (``fs_base``): with
FSGSBASE (Linux 5.9+, AT_HWCAP2 bit 1) ``rdfsbase`` reads it without touching memory; else
``mov rcx, fs:[0]`` loads the TCB's self pointer, the same value under glibc, but a fault in a
thread without a TLS block. A fork child's threads have their parent's thread pointers and
write into the same ring (the shared area is shared), so the pointer is XORed with a word of
the address space's own (``thread_salt``), kept at the start of each detour page, where a fork
child's copy gets its own value before it runs. Rejected: ``syscall(gettid)`` (about 90 ns on
these machines, three times the whole record). The timestamp is ``rdtsc``: the machines have an
invariant TSC (``constant_tsc nonstop_tsc``) and the tool converts ticks to time. The CPU,
which the kernel's trace prints, comes from ``rdpid`` (the kernel keeps the CPU number in
TSC_AUX), else from ``rdtscp``, which also waits for older instructions to retire.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from kprobes.arch.x86_64 import shared_area as area
from kprobes.arch.x86_64.capture import CapturePlan, LoadReg, emit_captures
from kprobes.arch.x86_64.detour import (
    EFLAGS,
    Block,
    Frame,
    at,
    mov_load,
    mov_store,
    rip_operand,
)
from kprobes.arch.x86_64.iced import Code, Instruction, MemoryOperand, Register, Register_
from kprobes.arch.x86_64.stackwalk import CLOBBERS as WALK_CLOBBERS
from kprobes.arch.x86_64.stackwalk import STATUS as STACK_STATUS
from kprobes.arch.x86_64.stackwalk import StackWalk, emit_stack_walk
from kprobes.errors import InternalError
from kprobes.values import dataclass, field

_GPRS: Final[dict[str, Register_]] = {
    "rax": Register.RAX, "rcx": Register.RCX, "rdx": Register.RDX, "rbx": Register.RBX,
    "rsp": Register.RSP, "rbp": Register.RBP, "rsi": Register.RSI, "rdi": Register.RDI,
    "r8": Register.R8, "r9": Register.R9, "r10": Register.R10, "r11": Register.R11,
    "r12": Register.R12, "r13": Register.R13, "r14": Register.R14, "r15": Register.R15,
}  # fmt: skip


THREAD_SALT_SHIFT: Final = 48  # above any user-space thread pointer (47 bits)
THREAD_MASK: Final = (1 << THREAD_SALT_SHIFT) - 1
SALT_SIZE: Final = 16  # the salt's room at the start of a page of detours (kept aligned)


def thread_salt(number: int) -> int:
    """The word a record's thread pointer is XORed with in the address space numbered
    ``number``: 0 in the program's own, another in each followed fork child, whose threads
    have the thread pointers of their parent's and write into the same ring."""
    return (number & 0xFFFF) << THREAD_SALT_SHIFT


class ThreadId(Enum):
    """How a record names its thread (both give the thread pointer, fs base)."""

    FSBASE = "rdfsbase"
    FS0 = "fs:0"


class CpuId(Enum):
    """How a record learns its CPU (TSC_AUX, which Linux sets to the CPU number)."""

    RDPID = "rdpid"
    RDTSCP = "rdtscp"
    NONE = "none"  # the cpu field reads META_CPU_MASK


@dataclass(frozen=True, slots=True)
class RecordAction:
    """Write a record of the hit (probe id, thread, CPU, TSC, the registers if
    ``with_regs``, the captures of ``plan``, the user stack's return addresses if ``stack``)
    into the shared ring."""

    probe_id: int
    ring: area.RingAddrs
    thread_id: ThreadId = ThreadId.FSBASE
    with_regs: bool = True
    plan: CapturePlan = field(default_factory=CapturePlan)
    cpu_id: CpuId = CpuId.RDPID
    counter: int | None = None  # also count every hit there, recorded or dropped
    may_wait: bool = False  # a full ring is retried while the reader's lease holds
    stack: StackWalk | None = None  # walk the stack (stackwalk.py) after the captures
    # After the commit, the record's ticket + 1 is stored at [register + displacement] (a
    # return probe's entry action: its shadow entry's E_DATA, retstack.py); nothing is
    # stored when the ring was full.
    ticket_to: tuple[Register_, int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.probe_id < 1 << 31:
            raise InternalError(f"probe id {self.probe_id} does not fit an imm32")
        area.slots_for(self.size)  # raises past the largest record

    @property
    def data_offset(self) -> int:
        return area.REC_HEADER + (area.REGS_BLOCK if self.with_regs else 0)

    @property
    def stack_offset(self) -> int:
        """Where the walk's output starts in the record (after the captures)."""
        return self.data_offset + self.plan.size

    @property
    def size(self) -> int:
        return self.stack_offset + (0 if self.stack is None else self.stack.size)

    @property
    def slots(self) -> int:
        return area.slots_for(self.size)

    @property
    def clobbers(self) -> tuple[str, ...]:
        # rax/rdx: cmpxchg and rdtsc; rcx: scratch; rbx: the record; rsi: the ticket;
        # rdi, r10, r11: the captures' address and their fault fixup.
        regs = ["rax", "rcx", "rdx", "rbx", "rsi"]
        if self.plan.captures:
            regs += ["rdi", "r10", "r11"]
        if self.stack is not None:  # the walk leaves rbx (the record) and rsi (the ticket)
            regs += [r for r in WALK_CLOBBERS if r not in regs]
        return tuple(regs)

    @property
    def reads_flags(self) -> bool:
        return True

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None:
        """Reserve a place in the ring (Steps 1-2), fill it (3-5), commit it (6); a full ring
        jumps to Step 7 and writes nothing."""
        rcx, rbx, rsi = (_GPRS[r] for r in ("rcx", "rbx", "rsi"))
        if self.counter is not None:
            block.add(Instruction.create_mem(Code.INC_RM64, rip_operand(self.counter)), lock=True)
        self._emit_reserve(block)
        self._emit_header(block)
        load_reg = register_loader(frame, probe_addr)
        # Step 4: the registers block.
        if self.with_regs:
            for name in area.REG_ORDER:
                if name in frame.words or name in ("rip", "eflags", "rsp"):
                    load_reg(block, name, rcx)
                    block.add(mov_store(rbx, area.rec_reg(name), rcx))
                else:
                    block.add(mov_store(rbx, area.rec_reg(name), _GPRS[name]))
        # Step 5: the fetch-args' captures.
        emit_captures(block, self.plan, rbx, self.data_offset, load_reg)
        # Step 5b: the stack's return addresses, walked from the probe's pc, rsp and rbp.
        if self.stack is not None:
            load_reg(block, "rip", Register.RAX)
            load_reg(block, "rsp", Register.RDX)
            load_reg(block, "rbp", Register.RBP)
            block.add(
                Instruction.create_reg_mem(Code.LEA_R64_M, Register.RDI, at(rbx, self.stack_offset))
            )
            emit_stack_walk(
                block, self.stack.directory, self.stack.max_returns, indirect=self.stack.indirect
            )
            self._emit_give_back(block)
        # Step 6: the commit word, last.
        block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, rcx, area.COMMIT_TAG + 1))
        block.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, rcx, rsi))
        block.add(mov_store(rbx, area.REC_COMMIT, rcx))
        if self.ticket_to is not None:
            block.add(Instruction.create_reg_mem(Code.LEA_R64_M, rcx, at(rsi, 1)))
            block.add(mov_store(self.ticket_to[0], self.ticket_to[1], rcx))
        block.branch(Code.JMP_REL32_64, "done")
        # Step 7: the ring is full: wait while the reader's lease holds (``may_wait``), else
        # count the drop and write nothing.
        block.label("full")
        if self.may_wait:
            self._emit_wait(block)
        block.add(Instruction.create_mem(Code.INC_RM64, rip_operand(self.ring.drops)), lock=True)
        block.label("done")

    def _emit_reserve(self, block: Block) -> None:
        """Steps 1-2: a ticket in rsi and its record in rbx, or a jump to "full"."""
        ring = self.ring
        rax, rcx, rdx, rbx, rsi = (_GPRS[r] for r in ("rax", "rcx", "rdx", "rbx", "rsi"))
        k = self.slots
        # Step 1: reserve tickets rax .. rax+k-1 if the ring has room (see shared_area.py).
        block.add(Instruction.create_reg_mem(Code.MOV_R64_RM64, rax, rip_operand(ring.head)))
        block.label("retry")
        block.add(Instruction.create_reg_mem(Code.LEA_R64_M, rcx, at(rax, k)))
        block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, rdx, rcx))
        block.add(Instruction.create_reg_mem(Code.SUB_R64_RM64, rdx, rip_operand(ring.tail)))
        block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, rdx, ring.capacity))
        # Signed: rax may be a head older than the tail just loaded (others reserved and
        # committed, the reader read them meanwhile), and then rdx is negative: not a full
        # ring, and the cmpxchg fails and retries with the new head. Unsigned, that was a drop.
        block.branch(Code.JG_REL32_64, "full")
        block.add(
            Instruction.create_mem_reg(Code.CMPXCHG_RM64_R64, rip_operand(ring.head), rcx),
            lock=True,
        )
        block.branch(Code.JNE_REL32_64, "retry")
        # Step 2: rbx = the record of ticket rax; keep the ticket in rsi for the commit.
        block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, rsi, rax))
        block.add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.EAX, ring.capacity - 1))
        block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, rax, 6))  # * SLOT
        block.add(Instruction.create_reg_mem(Code.LEA_R64_M, rbx, rip_operand(ring.ring)))
        block.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, rbx, rax))

    def _emit_give_back(self, block: Block) -> None:
        """Step 5c: a record with a stack was reserved for the deepest walk; the slots its
        walk did not fill go back to the ring if no producer reserved after it (the head is
        still its end: ``lock cmpxchg`` of the head from its end to its real end), and its
        meta says its real size. Else it keeps them (the reader skips them with it)."""
        rax, rcx, rdx, rbx, rsi = (_GPRS[r] for r in ("rax", "rcx", "rdx", "rbx", "rsi"))
        k = self.slots
        # k_real = (stack_offset + STATUS + 8 * returns + SLOT - 1) / SLOT, the returns the
        # low 32 bits of the walk's status word.
        block.add(
            Instruction.create_reg_mem(Code.MOV_R32_RM32, Register.ECX, at(rbx, self.stack_offset))
        )
        end = self.stack_offset + STACK_STATUS + area.SLOT - 1
        block.add(
            Instruction.create_reg_mem(
                Code.LEA_R64_M, rcx, MemoryOperand(index=rcx, scale=8, displ=end, displ_size=8)
            )
        )
        block.add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, rcx, 6))  # / SLOT
        block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, rcx, k))
        block.branch(Code.JAE_REL32_64, "kept")
        block.add(Instruction.create_reg_mem(Code.LEA_R64_M, rax, at(rsi, k)))
        block.add(
            Instruction.create_reg_mem(
                Code.LEA_R64_M, rdx, MemoryOperand(rsi, rcx, 1, displ=0, displ_size=0)
            )
        )
        block.add(
            Instruction.create_mem_reg(Code.CMPXCHG_RM64_R64, rip_operand(self.ring.head), rdx),
            lock=True,
        )
        block.branch(Code.JNE_REL32_64, "kept")
        # The meta word's slots (bits 32-47) become the real ones, before the commit.
        block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, rcx, area.META_SLOTS_SHIFT))
        block.add(mov_load(rax, rbx, area.REC_META))
        mask = ~(0xFFFF << area.META_SLOTS_SHIFT) & (1 << 64) - 1
        block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, rdx, mask))
        block.add(Instruction.create_reg_reg(Code.AND_R64_RM64, rax, rdx))
        block.add(Instruction.create_reg_reg(Code.OR_R64_RM64, rax, rcx))
        block.add(mov_store(rbx, area.REC_META, rax))
        block.label("kept")

    def _emit_wait(self, block: Block) -> None:
        """Step 7a: back to Step 1 while ``rdtsc`` < the lease; falls through once it is not
        (clobbers rax and rdx, as Step 1 and the header do)."""
        rax, rdx = _GPRS["rax"], _GPRS["rdx"]
        block.add(Instruction.create(Code.RDTSC))
        block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, rdx, 32))
        block.add(Instruction.create_reg_reg(Code.OR_R64_RM64, rax, rdx))
        block.add(
            Instruction.create_reg_mem(Code.CMP_R64_RM64, rax, rip_operand(self.ring.block_until))
        )
        block.branch(Code.JAE_REL32_64, "drop")
        block.add(Instruction.create(Code.PAUSE))
        block.add(Instruction.create_reg_mem(Code.MOV_R64_RM64, rax, rip_operand(self.ring.head)))
        block.branch(Code.JMP_REL32_64, "retry")
        block.label("drop")

    def _emit_header(self, block: Block) -> None:
        """The header of the record at rbx (its place from Step 2); clobbers rax, rcx, rdx."""
        rax, rcx, rdx, rbx = (_GPRS[r] for r in ("rax", "rcx", "rdx", "rbx"))
        # Step 3: the header: thread, time, then meta (probe id, slots, cpu, registers).
        if self.thread_id is ThreadId.FSBASE:
            block.add(Instruction.create_reg(Code.RDFSBASE_R64, rcx))
        else:
            fs0 = MemoryOperand(displ=0, displ_size=8, seg=Register.FS)
            block.add(Instruction.create_reg_mem(Code.MOV_R64_RM64, rcx, fs0))
        if block.thread_salt:  # this address space's own (thread_salt)
            xor = Instruction.create_reg_mem(Code.XOR_R64_RM64, rcx, rip_operand(block.thread_salt))
            block.add(xor)
        block.add(mov_store(rbx, area.REC_THREAD, rcx))
        if self.cpu_id is CpuId.RDTSCP:
            block.add(Instruction.create(Code.RDTSCP))  # ecx = TSC_AUX
        else:
            block.add(Instruction.create(Code.RDTSC))
            if self.cpu_id is CpuId.RDPID:
                block.add(Instruction.create_reg(Code.RDPID_R64, rcx))
            else:
                no_cpu = area.META_CPU_MASK
                block.add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.ECX, no_cpu))
        block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, rdx, 32))
        block.add(Instruction.create_reg_reg(Code.OR_R64_RM64, rax, rdx))
        block.add(mov_store(rbx, area.REC_TSC, rax))
        if self.cpu_id is not CpuId.NONE:  # TSC_AUX: the node above the CPU's 12 bits
            block.add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.ECX, 0xFFF))
        block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, rcx, area.META_CPU_SHIFT))
        meta = self.probe_id | self.slots << area.META_SLOTS_SHIFT
        if self.with_regs:
            meta |= area.META_REGS
        block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, rax, meta))
        block.add(Instruction.create_reg_reg(Code.OR_R64_RM64, rcx, rax))
        block.add(mov_store(rbx, area.REC_META, rcx))


def register_loader(frame: Frame, probe_addr: int) -> LoadReg:
    """``load_reg`` for this detour's captures: a register it saved is read from ``frame``."""

    def load_reg(b: Block, name: str, into: Register_) -> None:
        """The program's value of ``name`` at the probe, into ``into``: a word of the frame
        first (a return trampoline keeps the real return address there as "rip")."""
        if name in frame.words:
            b.add(mov_load(into, Register.RSP, frame.offset(name)))
        elif name == "rsp":
            b.add(
                Instruction.create_reg_mem(Code.LEA_R64_M, into, at(Register.RSP, frame.probe_rsp))
            )
        elif name == "rip":
            b.add(Instruction.create_reg_mem(Code.LEA_R64_M, into, rip_operand(probe_addr)))
        elif name == "eflags":
            b.add(mov_load(into, Register.RSP, frame.offset(EFLAGS)))
        elif _GPRS[name] != into:
            b.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, into, _GPRS[name]))

    return load_reg
