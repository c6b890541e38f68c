"""Return probes in the program: the shadow stacks and the entry action that hooks.

An optimized return probe hooks a call without a trap. Its entry detour runs ``RetEntryAction``:
it finds the thread's shadow stack, keeps the real return address at ``[rsp]``, the stack
pointer and ``rdtsc`` there, and writes the probe's return trampoline over ``[rsp]``. When the
function returns it lands in the trampoline (rettramp.py), which pops the newest entry
of its slot, adds the call's duration to the probe's log2 histogram and counters, and returns to
the real caller with a plain ``ret``. This is the kernel's uretprobe (``prepare_uretprobe`` and
``handle_trampoline`` in kernel/events/uprobes.c) with the two traps taken out.

**Shadow stacks** live in one private anonymous mapping per process (``ShadowLayout``), not in
the shared area: a ``fork`` child then gets its own copy of every live entry, copy-on-write,
exactly as the kernel duplicates ``return_instances`` at fork, and keeps returning through
its inherited frames after we let it go. Rejected: the shared memfd (a child returning through
its copy of the stack would pop its parent's entries). The tool reads them only to put real
return addresses back (detach, an exception), through ``/proc/PID/mem``.

A thread's stack is found by its thread pointer (``rdfsbase``, else ``fs:0``), hashed into a
table of ``NTHREADS`` slots claimed with ``lock cmpxchg``; a thread that finds the table full is
not hooked (a miss). A thread that ends leaves its slot to the next thread with the same
thread pointer (glibc reuses a dead thread's stack and TCB together).

**Never mis-paired.** As the kernel does (``cleanup_return_instances``), stacks grow down: at
an entry whose return slot is ``S``, entries with a slot below ``S`` (or at ``S`` unless a
tail call chained this call to them, ``[S]`` being one of our trampolines) belong to frames
that vanished (``longjmp``) and are released; at a return through slot ``R``, entries below
``R`` are released and the newest entry at ``R`` is the call returning. None at ``R`` cannot
happen; the trampoline then stops on ``int3`` rather than guess (the kernel sends SIGILL).

**Signals.** A thread's ``busy`` word is set while an entry or a trampoline changes its stack;
an entry that finds it set (a signal handler interrupted the other) is not hooked and counts a
miss, so a handler never sees a half-pushed entry. Only the thread writes its own stack, so no
lock is needed there; the per-probe counters in the shared area are ``lock``ed.

Registers: the entry detour saves what it clobbers (detour.py). The trampoline keeps every
register (gcc's ``-fipa-ra`` lets a caller keep values in caller-saved registers across a call
to a function it knows); the arithmetic flags are not kept: no caller reads flags a call
returns with (the ABI leaves them undefined after a call).
"""

from __future__ import annotations

from typing import Final

from kprobes.arch.x86_64.detour import Block, Frame, at, mov_load, mov_store
from kprobes.arch.x86_64.iced import Code, Instruction, MemoryOperand, Register, Register_
from kprobes.arch.x86_64.record import RecordAction, ThreadId
from kprobes.arch.x86_64.shadow import (
    CAPACITY,
    E_ARGS,
    E_DATA,
    E_OWNER,
    E_RET,
    E_STACK,
    E_TRAMP,
    E_TSC,
    ENTRY,
    ENTRY_REGS_MAX,
    LOST_MAX,
    NTHREADS,
    SLOT_STRIDE,
    T_BUSY,
    T_DEPTH,
    T_ENTRIES,
    T_LOST,
    T_LOST_NEXT,
    T_OWNER,
)
from kprobes.arch.x86_64.shadow import HASH as _HASH
from kprobes.errors import InternalError
from kprobes.values import dataclass

# A probe's counters in the shared area, 8 bytes each from its first counter: the entries
# (hits), the calls returned, entries not hooked (cap, no slot, busy), frames released,
# the sum of what it aggregates (durations, or return values), then their log2 histogram
# (bcc's 65 slots: slot k > 0 holds [2**(k-1), 2**k), 0 and 1 go to slot 1).
C_HITS: Final = 0
C_RETURNS: Final = 8
C_MISSED: Final = 16
C_ABANDONED: Final = 24
C_SUM_NS: Final = 32
C_LIVE: Final = 40  # a probe with a maxactive: its calls hooked now, every thread's
C_HIST: Final = 64
HIST_SLOTS: Final = 65
COUNTERS_SIZE: Final = C_HIST + 8 * HIST_SLOTS  # 584 bytes
# Then, for a linear histogram (bpftrace's lhist: ``Linear``), its slots in place of the
# log2 ones: below ``low``, the buckets, ``high`` and above.
C_LHIST: Final = COUNTERS_SIZE
LHIST_SLOTS_MAX: Final = 1024


@dataclass(frozen=True, slots=True)
class Linear:
    """Linear buckets of ``step`` from ``low`` to ``high`` (output/hist.py's
    ``LinearHistogram``, slot for slot), for values compared unsigned: ``low`` >= 0."""

    low: int
    high: int
    step: int

    def __post_init__(self) -> None:
        if not (0 <= self.low < self.high < 1 << 63 and self.step >= 1):
            raise InternalError(f"linear buckets {self}")
        if self.nslots > LHIST_SLOTS_MAX:
            raise InternalError(f"{self.nslots} linear slots")

    @property
    def nbuckets(self) -> int:
        return (self.high - self.low) // self.step

    @property
    def nslots(self) -> int:
        return self.nbuckets + 2


def counters_size(linear: Linear | None) -> int:
    """Bytes of a return probe's counters, with its linear slots if it has them."""
    return COUNTERS_SIZE + (8 * linear.nslots if linear is not None else 0)


RAX, RCX, RDX, RSI, RDI, R8, R9, R10, R11 = (
    Register.RAX, Register.RCX, Register.RDX, Register.RSI, Register.RDI,
    Register.R8, Register.R9, Register.R10, Register.R11,
)  # fmt: skip
SAVED: Final = (RAX, RCX, RDX, RSI, RDI, R8, R9, R10, R11)
# Where an entry action's record leaves its ticket (``RecordAction.ticket_to``): the entry,
# which r9 points at while that record is written.
ENTRY_TICKET: Final = (R9, E_DATA)
SAVED_NAMES: Final = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")


def thread_slot(shadow: int, fs_base: int, index: int) -> int:
    """The address of thread slot ``index`` (the tool's walk of the table)."""
    return shadow + (index % NTHREADS) * SLOT_STRIDE


def first_index(fs_base: int) -> int:
    """The slot the table's search for ``fs_base`` starts at (as the code computes it)."""
    return (((fs_base >> 12) * _HASH) & 0xFFFF_FFFF_FFFF_FFFF) >> 16 & (NTHREADS - 1)


@dataclass(frozen=True, slots=True)
class ReturnSite:
    """What the code of one optimized return probe needs: where the shadow stacks are, its
    trampoline, the range every trampoline lies in (for tail-call chains), the trap tier's
    trampoline (0 if none), its counters, its cap, how to read the thread pointer, and what
    its trampoline aggregates: the call's duration (``value_bits`` 0), or the low 32 or 64
    bits of the return value; and, with ``record``, the record its trampoline writes of each
    return (the registers at the return, "rip" the real return address, and ``ENTRY_TSC``)."""

    shadow: int
    trampoline: int
    tramp_start: int
    tramp_size: int
    trap_trampoline: int
    counters: int
    cap: int = CAPACITY  # entries a thread's shadow stack takes, every probe's
    thread_id: ThreadId = ThreadId.FSBASE
    value_bits: int = 0
    record: RecordAction | None = None
    entry_regs: tuple[str, ...] = ()  # registers the entry keeps for the record (its $argN)
    linear: Linear | None = None  # linear slots (at C_LHIST) in place of the log2 ones
    thread_salt: int = 0  # where its record's thread salt is (record.py), 0: none
    # The entry action's record (``Kretprobe(entry_args=...)``), written by the entry once the
    # call is hooked; its ticket is kept in the entry (E_DATA) for the return's record.
    entry_record: RecordAction | None = None
    # The kernel's maxactive: calls of this probe hooked at once in the process, at most
    # (its instances, every thread's: C_LIVE); 0: as many as the threads' stacks take.
    maxactive: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.cap <= CAPACITY:
            raise InternalError(f"a return probe's cap {self.cap} is not 1..{CAPACITY}")
        if self.value_bits not in (0, 32, 64):
            raise InternalError(f"a return value of {self.value_bits} bits")
        regs = self.entry_regs
        if regs and (
            self.record is None
            or len(regs) > ENTRY_REGS_MAX
            or len(set(regs)) < len(regs)
            or not set(regs) <= set(SAVED_NAMES)
        ):
            raise InternalError(f"entry registers {regs!r} (for a record, at most six)")
        if self.entry_record is not None and (
            self.record is None or self.entry_record.ticket_to != ENTRY_TICKET
        ):
            raise InternalError("an entry action's record with no return record to pair it")


def imm64(block: Block, reg: Register_, value: int) -> None:
    block.add(Instruction.create_reg_u64(Code.MOV_R64_IMM64, reg, value))


def count(block: Block, site: ReturnSite, field: int, scratch: Register_) -> None:
    """``lock inc`` of one of the probe's counters (absolute: no reach to check)."""
    imm64(block, scratch, site.counters + field)
    block.add(Instruction.create_mem(Code.INC_RM64, at(scratch, 0)), lock=True)


def emit_find(block: Block, site: ReturnSite, *, claim: bool, missing: str) -> None:
    """rdi = this thread's slot (rcx = its thread pointer); jumps to ``missing`` when it has
    none (and ``claim`` is off, or the table is full). Clobbers rax, rdx, rsi."""
    if site.thread_id is ThreadId.FSBASE:
        block.add(Instruction.create_reg(Code.RDFSBASE_R64, RCX))
    else:
        fs0 = MemoryOperand(displ=0, displ_size=8, seg=Register.FS)
        block.add(Instruction.create_reg_mem(Code.MOV_R64_RM64, RCX, fs0))
    block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, RSI, RCX))
    block.add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, RSI, 12))
    block.add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, RSI, RSI, _HASH))
    block.add(Instruction.create_reg_i32(Code.SHR_RM64_IMM8, RSI, 16))
    block.add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.ESI, NTHREADS - 1))
    block.add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.EDX, NTHREADS))
    block.label("look")
    block.add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, RDI, RSI, SLOT_STRIDE))
    imm64(block, RAX, site.shadow)
    block.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, RDI, RAX))
    block.add(mov_load(RAX, RDI, T_OWNER))
    block.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, RCX))
    block.branch(Code.JE_REL32_64, "found")
    block.add(Instruction.create_reg_reg(Code.TEST_RM64_R64, RAX, RAX))
    block.branch(Code.JNE_REL32_64, "next")
    if not claim:
        block.branch(Code.JMP_REL32_64, missing)
    else:
        # rax is 0: a free slot, ours unless another thread claims it first.
        block.add(
            Instruction.create_mem_reg(Code.CMPXCHG_RM64_R64, at(RDI, T_OWNER), RCX), lock=True
        )
        block.branch(Code.JE_REL32_64, "found")
        block.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, RCX))
        block.branch(Code.JE_REL32_64, "found")
    block.label("next")
    block.add(Instruction.create_reg(Code.INC_RM32, Register.ESI))
    block.add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.ESI, NTHREADS - 1))
    block.add(Instruction.create_reg(Code.DEC_RM32, Register.EDX))
    block.branch(Code.JNE_REL32_64, "look")
    block.branch(Code.JMP_REL32_64, missing)
    block.label("found")


def emit_top(block: Block) -> None:
    """r10 = the entry below depth rsi (the newest live one); clobbers rax."""
    block.add(Instruction.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, RAX, RSI, ENTRY))
    block.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, RAX, RDI))
    block.add(Instruction.create_reg_mem(Code.LEA_R64_M, R10, at(RAX, T_ENTRIES - ENTRY)))


def emit_release(block: Block) -> None:
    """The newest entry (r10, at depth rsi) is released: remembered in the lost ring, the
    depth one less, counted abandoned by the probe whose entry it is (``E_OWNER``), one
    instance less in flight for it. Clobbers rcx, rdx."""
    block.add(mov_load(RCX, RDI, T_LOST_NEXT))
    block.add(Instruction.create_reg_mem(Code.LEA_R64_M, RDX, at(RCX, 1)))
    block.add(mov_store(RDI, T_LOST_NEXT, RDX))
    block.add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.ECX, LOST_MAX - 1))
    block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, RCX, 4))  # * LOST
    block.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, RCX, RDI))
    block.add(mov_load(RDX, R10, E_STACK))
    block.add(mov_store(RCX, T_LOST, RDX))
    block.add(mov_load(RDX, R10, E_RET))
    block.add(mov_store(RCX, T_LOST + 8, RDX))
    block.add(Instruction.create_reg(Code.DEC_RM64, RSI))
    block.add(mov_load(RDX, R10, E_OWNER))
    block.add(Instruction.create_mem(Code.INC_RM64, at(RDX, C_ABANDONED)), lock=True)
    block.add(Instruction.create_mem(Code.DEC_RM64, at(RDX, C_LIVE)), lock=True)


def emit_newest_vs_slot(block: Block, empty: str) -> None:
    """The newest entry (r10, see ``emit_top``) or a jump to ``empty`` if depth rsi is 0;
    then its return slot compared with r8 (the flags say which is above)."""
    block.add(Instruction.create_reg_reg(Code.TEST_RM64_R64, RSI, RSI))
    block.branch(Code.JE_REL32_64, empty)
    emit_top(block)
    block.add(mov_load(RAX, R10, E_STACK))
    block.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, R8))


def _emit_take_instance(block: Block, maxactive: int, none_left: str) -> None:
    """One more of the probe's calls in flight (its counters at r11), or a jump to
    ``none_left`` if ``maxactive`` are. The compare is signed: a fork child returns
    through its copies of the hooked frames, and both processes give back each of those
    instances (the counters are shared), so the count may go below zero; it then admits
    a few calls too many, never none again. Clobbers rax."""
    block.add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.EAX, 1))
    block.add(Instruction.create_mem_reg(Code.XADD_RM64_R64, at(R11, C_LIVE), RAX), lock=True)
    block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, RAX, maxactive))
    block.branch(Code.JL_REL32_64, "instance")
    block.add(Instruction.create_mem(Code.DEC_RM64, at(R11, C_LIVE)), lock=True)
    block.branch(Code.JMP_REL32_64, none_left)
    block.label("instance")


@dataclass(frozen=True, slots=True)
class RetEntryAction:
    """The entry detour's action of an optimized return probe (see the module docstring)."""

    site: ReturnSite

    @property
    def clobbers(self) -> tuple[str, ...]:
        own = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")
        entry = self.site.entry_record
        return own if entry is None else (*own, *(r for r in entry.clobbers if r not in own))

    @property
    def reads_flags(self) -> bool:
        entry = self.site.entry_record
        return entry is not None and entry.reads_flags

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None:
        site = self.site
        count(block, site, C_HITS, R11)
        # Step 1: the thread's shadow stack, unless a signal handler interrupted its use.
        emit_find(block, site, claim=True, missing="missed")
        block.add(Instruction.create_mem_i32(Code.CMP_RM64_IMM8, at(RDI, T_BUSY), 0))
        block.branch(Code.JNE_REL32_64, "missed")
        block.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDI, T_BUSY), 1))
        # Step 2: r8 = the return slot S, r9 = the return address, rsi = the depth.
        block.add(Instruction.create_reg_mem(Code.LEA_R64_M, R8, at(Register.RSP, frame.probe_rsp)))
        block.add(mov_load(R9, R8, 0))
        block.add(mov_load(RSI, RDI, T_DEPTH))
        # Step 3: release the entries of frames that vanished (below S, or at S unchained).
        block.label("release")
        emit_newest_vs_slot(block, "push")
        block.branch(Code.JA_REL32_64, "push")
        block.branch(Code.JB_REL32_64, "drop")
        imm64(block, RAX, site.tramp_start)
        block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, R11, R9))
        block.add(Instruction.create_reg_reg(Code.SUB_R64_RM64, R11, RAX))
        block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, R11, site.tramp_size))
        block.branch(Code.JB_REL32_64, "push")  # chained to one of our trampolines
        if site.trap_trampoline:
            imm64(block, RAX, site.trap_trampoline)
            block.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, R9, RAX))
            block.branch(Code.JE_REL32_64, "push")  # chained to the trap tier's
        block.label("drop")
        emit_release(block)
        block.branch(Code.JMP_REL32_64, "release")
        # Step 4: a new entry if the cap allows: its fields, the depth, then the hook.
        block.label("push")
        block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, RSI, site.cap))
        block.branch(Code.JAE_REL32_64, "full")
        imm64(block, R11, site.counters)
        if site.maxactive:
            _emit_take_instance(block, site.maxactive, "full")
        block.add(Instruction.create_reg(Code.INC_RM64, RSI))
        emit_top(block)
        block.add(mov_store(R10, E_RET, R9))
        block.add(mov_store(R10, E_STACK, R8))
        block.add(mov_store(R10, E_OWNER, R11))
        block.add(Instruction.create(Code.RDTSC))
        block.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, RDX, 32))
        block.add(Instruction.create_reg_reg(Code.OR_R64_RM64, RAX, RDX))
        block.add(mov_store(R10, E_TSC, RAX))
        for i, reg in enumerate(site.entry_regs):  # the program's, saved in the frame
            block.add(mov_load(RAX, Register.RSP, frame.offset(reg)))
            block.add(mov_store(R10, E_ARGS + 8 * i, RAX))
        if site.entry_record is not None:
            block.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(R10, E_DATA), 0))
        block.add(mov_store(RDI, T_DEPTH, RSI))
        imm64(block, RAX, site.trampoline)
        block.add(mov_store(R10, E_TRAMP, RAX))
        block.add(mov_store(R8, 0, RAX))
        block.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDI, T_BUSY), 0))
        if site.entry_record is not None:
            # Step 4b: the entry action's record, its ticket into the entry (r9 = the entry:
            # the record keeps r9; it reads the program's registers from the frame).
            block.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, R9, R10))
            prefix = block.prefix
            block.prefix = prefix + "data."
            try:
                site.entry_record.emit(block, frame, probe_addr)
            finally:
                block.prefix = prefix
        block.branch(Code.JMP_REL32_64, "done")
        # Step 5: not hooked: the depth the releases left, and a miss.
        block.label("full")
        block.add(mov_store(RDI, T_DEPTH, RSI))
        block.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDI, T_BUSY), 0))
        block.label("missed")
        count(block, site, C_MISSED, R11)
        block.label("done")
