"""Return probes in the program: the return trampoline of one probe.

A call hooked by an optimized return probe's entry (retstack.py's ``RetEntryAction``)
returns into ``build_trampoline``'s code, which finds the thread's shadow stack, releases
the entries of frames that vanished and pops this call's (the newest at its return slot),
puts the real return address where the final ``ret`` takes it, and either aggregates the
call (its duration or its return value, into the probe's log2 or linear histogram and sum)
or writes a record of the return (record.py's ``RecordAction``, with the entry's words: its
time, its ``$argN`` registers, its entry action's ticket). A return slot with no entry of
ours cannot happen; then the released entries' ring (``T_LOST``) gives the address, or the
trampoline stops on ``int3`` rather than guess (the kernel sends SIGILL).
"""

from __future__ import annotations

from typing import Final

from kprobes.arch.x86_64.capture import ENTRY_DATA, ENTRY_TSC, entry_word
from kprobes.arch.x86_64.detour import EFLAGS, Block, Frame, at, mov_load, mov_store
from kprobes.arch.x86_64.iced import Code, Instruction, MemoryOperand, Register
from kprobes.arch.x86_64.retstack import (
    C_HIST,
    C_LHIST,
    C_LIVE,
    C_RETURNS,
    C_SUM_NS,
    R8,
    R10,
    R11,
    RAX,
    RCX,
    RDI,
    RDX,
    RSI,
    SAVED,
    SAVED_NAMES,
    Linear,
    ReturnSite,
    emit_find,
    emit_newest_vs_slot,
    emit_release,
    imm64,
)
from kprobes.arch.x86_64.shadow import (
    E_ARGS,
    E_DATA,
    E_RET,
    E_STACK,
    E_TSC,
    ENTRY,
    LOST_MAX,
    T_BUSY,
    T_DEPTH,
    T_ENTRIES,
    T_LOST,
    T_LOST_NEXT,
)
from kprobes.errors import InternalError

TRAMPOLINE_MAX: Final = 512  # bytes of one trampoline, with room to spare
RECORD_TRAMPOLINE_MAX: Final = 8192  # one that also writes a record (its captures' code)
_WALK_SAVED: Final = (Register.RBP, Register.R12, Register.R13, Register.R14, Register.R15)
_WALK_SAVED_NAMES: Final = ("rbp", "r12", "r13", "r14", "r15")


def _emit_measure(b: Block, site: ReturnSite, mult: int, saved_rax: int) -> None:
    """rax = the return value the function left in rax (saved at ``[rsp + saved_rax]``), or
    the call's duration (a negative one, TSCs of two CPUs, is 0), ``ticks * mult >> 32``."""
    if site.value_bits:
        b.add(mov_load(RAX, Register.RSP, saved_rax))
        if site.value_bits == 32:
            b.add(Instruction.create_reg_reg(Code.MOV_R32_RM32, Register.EAX, Register.EAX))
        return
    b.add(Instruction.create(Code.RDTSC))
    b.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, RDX, 32))
    b.add(Instruction.create_reg_reg(Code.OR_R64_RM64, RAX, RDX))
    b.add(Instruction.create_reg_mem(Code.SUB_R64_RM64, RAX, at(R10, E_TSC)))
    b.branch(Code.JNS_REL32_64, "positive")
    b.add(Instruction.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX))
    b.label("positive")
    imm64(b, RCX, mult)
    b.add(Instruction.create_reg(Code.MUL_RM64, RCX))
    b.add(Instruction.create_reg_reg_i32(Code.SHRD_RM64_R64_IMM8, RAX, RDX, 32))


# A recording trampoline's frame word: where its ``ret`` goes, while the "rip" word holds
# the caller for the record (they differ in a chain of trampolines: ``_emit_caller``).
RETURN_TO: Final = "return_to"


def record_frame(site: ReturnSite) -> Frame:
    """The trampoline's words while its record is written, in push order: the real return
    address (as "rip": the program's rip once the trampoline returns), the saved registers,
    and, with a record, rbx (the record's pointer), the flags, the call's entry time, where
    its ``ret`` goes (``RETURN_TO``) and the registers its entry kept (``entry_word``); a
    record's stack walk saves callee-saved registers of its own after the others."""
    extra: tuple[str, ...] = ()
    if site.record is not None:
        extra = ("rbx", EFLAGS, ENTRY_TSC, RETURN_TO)
        extra += (ENTRY_DATA,) if site.entry_record is not None else ()
    kept = tuple(entry_word(reg) for reg in site.entry_regs)
    return Frame(("rip", *SAVED_NAMES, *_walk_names(site), *extra, *kept), below=0)


def _walk_names(site: ReturnSite) -> tuple[str, ...]:
    """The callee-saved registers a record's stack walk uses, saved by its trampoline."""
    if site.record is None or site.record.stack is None:
        return ()
    return _WALK_SAVED_NAMES


def build_trampoline(site: ReturnSite, mult: int) -> bytes:
    """The return trampoline of one probe, at ``site.trampoline``. ``mult`` turns TSC ticks
    into ns: ``ns = ticks * mult >> 32``."""
    if not 0 < mult < 1 << 63:
        raise InternalError(f"tsc multiplier {mult}")
    b = Block(site.thread_salt)
    frame = record_frame(site)
    nsaved = len(frame.words) - 1
    # Step 1: a word for the real return address (the slot the ret just freed), the registers
    # (and, to write a record, rbx, the flags and a word for the entry time).
    b.add(Instruction.create_reg_mem(Code.LEA_R64_M, Register.RSP, at(Register.RSP, -8)))
    walk = _WALK_SAVED if _walk_names(site) else ()
    for reg in (*SAVED, *walk):
        b.add(Instruction.create_reg(Code.PUSH_R64, reg))
    if site.record is not None:
        b.add(Instruction.create_reg(Code.PUSH_R64, Register.RBX))
        b.add(Instruction.create(Code.PUSHFQ))
        for _ in range(len(frame.words) - 1 - len(SAVED) - len(walk) - 2):  # the entry's words
            b.add(Instruction.create_reg(Code.PUSH_R64, RAX))
    # Step 2: the thread's stack; r8 = the return slot R, rsi = the depth.
    emit_find(b, site, claim=False, missing="nowhere")
    b.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDI, T_BUSY), 1))
    b.add(Instruction.create_reg_mem(Code.LEA_R64_M, R8, at(Register.RSP, 8 * nsaved)))
    b.add(mov_load(RSI, RDI, T_DEPTH))
    # Step 3: entries below R vanished; the newest at R is this call.
    b.label("pop")
    emit_newest_vs_slot(b, "lost")
    b.branch(Code.JE_REL32_64, "match")
    b.branch(Code.JA_REL32_64, "lost")
    emit_release(b)
    b.branch(Code.JMP_REL32_64, "pop")
    b.label("match")
    b.add(Instruction.create_reg(Code.DEC_RM64, RSI))
    b.add(mov_store(RDI, T_DEPTH, RSI))
    b.add(mov_load(RAX, R10, E_RET))
    b.add(mov_store(R8, 0, RAX))  # where the final ret finds it
    if site.maxactive:  # its instance is free again
        imm64(b, RDX, site.counters)
        b.add(Instruction.create_mem(Code.DEC_RM64, at(RDX, C_LIVE)), lock=True)
    if site.record is not None:
        _emit_entry_words(b, site, frame)
    imm64(b, R11, site.counters)
    b.add(Instruction.create_mem(Code.INC_RM64, at(R11, C_RETURNS)), lock=True)
    if site.record is not None:
        # Step 4: the record of this return (its events are the tool's to aggregate), the
        # thread's stack left first (a signal handler may call probed functions while the
        # record waits for room: --block).
        b.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDI, T_BUSY), 0))
        site.record.emit(b, frame, 0)
        b.branch(Code.JMP_REL32_64, "restore")
    else:
        _emit_aggregate(b, site, mult, frame.offset("rax"))
    b.label("home")
    b.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDI, T_BUSY), 0))
    # Step 5: the registers back, and home.
    b.label("restore")
    if site.record is not None:
        b.add(mov_load(RAX, Register.RSP, frame.offset(RETURN_TO)))  # the ret's, once more
        b.add(mov_store(Register.RSP, frame.offset("rip"), RAX))
        # all but rbx above the walk's registers: the flags, the entry's time and words
        kept = 8 * (len(frame.words) - 1 - len(SAVED) - len(walk) - 1)
        b.add(Instruction.create_reg_mem(Code.LEA_R64_M, Register.RSP, at(Register.RSP, kept)))
        b.add(Instruction.create_reg(Code.POP_R64, Register.RBX))
    for reg in reversed((*SAVED, *walk)):
        b.add(Instruction.create_reg(Code.POP_R64, reg))
    b.add(Instruction.create(Code.RETNQ))
    _emit_lost(b)
    code = b.encode(site.trampoline)
    limit = TRAMPOLINE_MAX if site.record is None else RECORD_TRAMPOLINE_MAX
    if len(code) > limit:
        raise InternalError(f"a trampoline of {len(code)} bytes")
    return code


def _emit_aggregate(b: Block, site: ReturnSite, mult: int, saved_rax: int) -> None:
    """Step 4 of a trampoline without a record: what the probe aggregates (``_emit_measure``)
    into its sum and its log2 or linear histogram (r11: its counters)."""
    _emit_measure(b, site, mult, saved_rax)
    b.add(Instruction.create_mem_reg(Code.ADD_RM64_R64, at(R11, C_SUM_NS), RAX), lock=True)
    if site.linear is not None:
        _emit_linear_slot(b, site.linear)
        hist = MemoryOperand(R11, RCX, 8, C_LHIST, 1)
    else:
        b.add(Instruction.create_reg_i32(Code.OR_RM64_IMM8, RAX, 1))
        b.add(Instruction.create_reg_reg(Code.BSR_R64_RM64, RCX, RAX))
        hist = MemoryOperand(R11, RCX, 8, C_HIST + 8, 1)  # slot bsr + 1: bcc's bit length
    b.add(Instruction.create_mem(Code.INC_RM64, hist), lock=True)


def _emit_entry_words(b: Block, site: ReturnSite, frame: Frame) -> None:
    """A recording trampoline's frame words from its call's entry (r10): the entry time,
    the registers the entry kept, where the ``ret`` goes and the caller."""
    b.add(mov_load(RAX, R10, E_TSC))
    b.add(mov_store(Register.RSP, frame.offset(ENTRY_TSC), RAX))
    if site.entry_record is not None:
        b.add(mov_load(RAX, R10, E_DATA))
        b.add(mov_store(Register.RSP, frame.offset(ENTRY_DATA), RAX))
    for i, name in enumerate(site.entry_regs):
        b.add(mov_load(RAX, R10, E_ARGS + 8 * i))
        b.add(mov_store(Register.RSP, frame.offset(entry_word(name)), RAX))
    _emit_caller(b, site, frame)


def _emit_caller(b: Block, site: ReturnSite, frame: Frame) -> None:
    """The record's "rip" is the caller: where this call's entry (r10) returns, unless that
    is another of our trampolines (a later return probe's hook at one site, or a tail
    call, chains the calls at one slot r8), then the oldest entry of the chain's; the
    ``ret`` still goes to the next trampoline (``RETURN_TO``). As the trap tier, which
    gives each instance of a chain the real address. Clobbers rax, rcx, r11."""
    b.add(mov_load(RAX, R10, E_RET))
    b.add(mov_store(Register.RSP, frame.offset(RETURN_TO), RAX))
    b.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, R11, R10))
    b.label("caller")
    imm64(b, RCX, site.tramp_start)
    b.add(Instruction.create_reg_reg(Code.SUB_R64_RM64, RCX, RAX))
    b.add(Instruction.create_reg(Code.NEG_RM64, RCX))  # rax - tramp_start
    b.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, RCX, site.tramp_size))
    b.branch(Code.JAE_REL32_64, "caller_found")  # not one of ours: the caller
    b.add(Instruction.create_reg_mem(Code.LEA_R64_M, R11, at(R11, -ENTRY)))
    b.add(Instruction.create_reg_mem(Code.LEA_R64_M, RCX, at(RDI, T_ENTRIES)))
    b.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, R11, RCX))
    b.branch(Code.JB_REL32_64, "caller_found")  # no older entry: the trampoline it is
    b.add(mov_load(RCX, R11, E_STACK))
    b.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RCX, R8))
    b.branch(Code.JNE_REL32_64, "caller_found")  # not of this slot: the same
    b.add(mov_load(RAX, R11, E_RET))
    b.branch(Code.JMP_REL32_64, "caller")
    b.label("caller_found")
    b.add(mov_store(R8, 0, RAX))


def _emit_linear_slot(b: Block, linear: Linear) -> None:
    """rcx = the linear slot of the value in rax (unsigned): 0 below ``low``, ``nslots - 1``
    from ``high`` on, else ``(value - low) // step + 1``. Clobbers rax and rdx."""
    imm64(b, RDX, linear.low)
    b.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, RDX))
    b.branch(Code.JB_REL32_64, "lin_below")
    imm64(b, RCX, linear.high)
    b.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, RCX))
    b.branch(Code.JAE_REL32_64, "lin_above")
    b.add(Instruction.create_reg_reg(Code.SUB_R64_RM64, RAX, RDX))
    b.add(Instruction.create_reg_reg(Code.XOR_R32_RM32, Register.EDX, Register.EDX))
    imm64(b, RCX, linear.step)
    b.add(Instruction.create_reg(Code.DIV_RM64, RCX))
    b.add(Instruction.create_reg_mem(Code.LEA_R64_M, RCX, at(RAX, 1)))
    b.branch(Code.JMP_REL32_64, "lin_slot")
    b.label("lin_below")
    b.add(Instruction.create_reg_reg(Code.XOR_R32_RM32, Register.ECX, Register.ECX))
    b.branch(Code.JMP_REL32_64, "lin_slot")
    b.label("lin_above")
    b.add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.ECX, linear.nslots - 1))
    b.label("lin_slot")


def _emit_lost(b: Block) -> None:
    """No live entry at R: a frame released wrongly (its stack was switched under it) finds
    its return address in the lost ring (taken out, not counted); none there, or no slot
    for the thread at all: where it should go is unknown. Stop rather than guess."""
    b.label("lost")
    b.add(mov_store(RDI, T_DEPTH, RSI))
    b.add(mov_load(RCX, RDI, T_LOST_NEXT))
    b.add(Instruction.create_reg_u32(Code.MOV_R32_IMM32, Register.R9D, LOST_MAX))
    b.label("search")  # newest first: an older release of the same slot is a dead frame's
    b.add(Instruction.create_reg(Code.DEC_RM64, RCX))
    b.add(Instruction.create_reg_reg(Code.MOV_R64_RM64, RDX, RCX))
    b.add(Instruction.create_reg_u32(Code.AND_RM32_IMM32, Register.EDX, LOST_MAX - 1))
    b.add(Instruction.create_reg_i32(Code.SHL_RM64_IMM8, RDX, 4))  # * LOST
    b.add(Instruction.create_reg_reg(Code.ADD_R64_RM64, RDX, RDI))
    b.add(mov_load(RAX, RDX, T_LOST))
    b.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, R8))
    b.branch(Code.JE_REL32_64, "recovered")
    b.add(Instruction.create_reg(Code.DEC_RM32, Register.R9D))
    b.branch(Code.JNE_REL32_64, "search")
    b.branch(Code.JMP_REL32_64, "nowhere")
    b.label("recovered")
    b.add(Instruction.create_mem_i32(Code.MOV_RM64_IMM32, at(RDX, T_LOST), 0))
    b.add(mov_load(RAX, RDX, T_LOST + 8))
    b.add(mov_store(R8, 0, RAX))
    b.branch(Code.JMP_REL32_64, "home")
    b.label("nowhere")
    b.add(Instruction.create(Code.INT3))
