"""The optimized return probes' unhook on an entry point of the C++ unwinder.

An exception unwinding through frames hooked by our return trampolines must see the real
return addresses, as the unwinder finds each frame's caller by its return address: a hidden
jump probe on ``__cxa_throw``/``__cxa_rethrow`` (engine/trampoline.py's ``UnwindUnhook``)
runs this action, which puts them back in every live frame of the thread, over the shadow
stack that retstack.py keeps (its layout: shadow.py).
"""

from __future__ import annotations

from kprobes.arch.x86_64.detour import Block, Frame, at, mov_load, mov_store
from kprobes.arch.x86_64.iced import Code, Instruction, Register
from kprobes.arch.x86_64.record import ThreadId
from kprobes.arch.x86_64.retstack import (
    R8,
    R10,
    R11,
    RAX,
    RCX,
    RDI,
    RDX,
    RSI,
    ReturnSite,
    emit_find,
    emit_top,
    imm64,
)
from kprobes.arch.x86_64.shadow import E_RET, E_STACK, T_DEPTH
from kprobes.values import dataclass


@dataclass(frozen=True, slots=True)
class UnhookAction:
    """The action on an entry point of the C++ unwinder: the real return address back in
    every frame of this thread still hooked to one of our trampolines, newest first (in a
    tail-call chain the newer entry's address is the older one's trampoline). Only frames
    above the stack pointer are live (and surely mapped); the entries stay, released later
    as vanished. With ``counter``, the hits are counted there."""

    shadow: int
    tramp_start: int
    tramp_size: int
    counter: int
    thread_id: ThreadId = ThreadId.FSBASE

    @property
    def clobbers(self) -> tuple[str, ...]:
        return ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r10", "r11")

    @property
    def reads_flags(self) -> bool:
        return False

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None:
        site = ReturnSite(
            self.shadow, 0, self.tramp_start, self.tramp_size, 0, 0, 1, self.thread_id
        )
        imm64(block, R11, self.counter)
        block.add(Instruction.create_mem(Code.INC_RM64, at(R11, 0)), lock=True)
        emit_find(block, site, claim=False, missing="done")
        block.add(Instruction.create_reg_mem(Code.LEA_R64_M, R8, at(Register.RSP, frame.probe_rsp)))
        block.add(mov_load(RSI, RDI, T_DEPTH))
        block.label("loop")
        block.add(Instruction.create_reg_reg(Code.TEST_RM64_R64, RSI, RSI))
        block.branch(Code.JE_REL32_64, "done")
        emit_top(block)
        block.add(Instruction.create_reg(Code.DEC_RM64, RSI))
        block.add(mov_load(RAX, R10, E_STACK))
        block.add(Instruction.create_reg_reg(Code.CMP_R64_RM64, RAX, R8))
        block.branch(Code.JB_REL32_64, "loop")  # below the stack pointer: a vanished frame
        block.add(mov_load(RDX, RAX, 0))
        imm64(block, RCX, self.tramp_start)
        block.add(Instruction.create_reg_reg(Code.SUB_R64_RM64, RDX, RCX))
        block.add(Instruction.create_reg_i32(Code.CMP_RM64_IMM32, RDX, self.tramp_size))
        block.branch(Code.JAE_REL32_64, "loop")  # not hooked (any more)
        block.add(mov_load(RDX, R10, E_RET))
        block.add(mov_store(RAX, 0, RDX))
        block.branch(Code.JMP_REL32_64, "loop")
        block.label("done")
