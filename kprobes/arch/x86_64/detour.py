"""The detour of a jump-optimized probe: machine code built from a template with named parts.

A thread that reaches the probe address ``A`` takes the 5-byte ``jmp`` written there
(``Detour.patch``) into its detour at ``D``, laid out as the kernel lays out an optprobe's
(``optprobe_template_entry`` in arch/x86/kernel/kprobes/opt.c)::

    entry     lea rsp, [rsp-128]        step over the System V red zone: the probed function may
              push rax                  keep live data in the 128 bytes below rsp, which a push
              seto al; lahf             would overwrite. lea, not sub: sub would change the
              push <what the action     flags before they are saved (see FlagsSave for why
                    clobbers>           not pushfq/popfq)
    action    count or record           a compiled action (below), no call, no trap
    exit      pop ..., add al, 0x7f; sahf; pop rax; lea rsp, [rsp+128]
    copy      the displaced instructions, relocated (jumpopt.relocate_region)
    back      jmp A+len                 rel32: the detour must lie within ±2 GiB of A

Unlike the kernel's, the action is not a call into a handler: the program has no handler to
call, and the tool is another process. Each action is a small code generator; it saves only
what it clobbers, so counting costs a flags save and one instruction. The template's parts
are ``Frame`` (what the entry pushed, where the action finds the program's values),
``_enter``/``_leave`` and the action's ``emit``; ``Detour`` names where the copy and the jump
back landed.

*count* is ``lock inc qword [rip+counter]``; the unlocked form is for a counter that only one
thread updates. *record* (record.py) reserves a record in the shared ring and fills it.

Every function here is pure: bytes out, no process. Anything out of rel32 reach raises
NotRelocatable (ERANGE), as the kernel's optimizer returns -ERANGE. iced's BlockEncoder
encodes the instructions, and its output is decoded again and checked operand by operand:
given a rip-relative target out of reach it silently falls back to an eip-relative form.
"""

from __future__ import annotations

import errno
from enum import Enum
from typing import Final, Protocol

from kprobes.arch.x86_64.abi import RED_ZONE
from kprobes.arch.x86_64.encode import jmp_rel32
from kprobes.arch.x86_64.iced import (
    BlockEncoder,
    Code,
    Code_,
    Decoder,
    Instruction,
    MemoryOperand,
    Register,
    Register_,
)
from kprobes.arch.x86_64.jumpopt import Region, relocate_region
from kprobes.errors import InternalError, NotRelocatable
from kprobes.values import dataclass

DETOUR_MAX: Final = 4096  # the largest detour (a record with 16 fetch-args and registers)

_LABEL_BASE: Final = 0x7FF0_0000_0000_0000  # fake ips naming instructions inside a block
_REL32_MIN: Final = -(1 << 31)
_REL32_MAX: Final = (1 << 31) - 1

_GPRS: Final[dict[str, Register_]] = {
    "rax": Register.RAX,
    "rcx": Register.RCX,
    "rdx": Register.RDX,
    "rbx": Register.RBX,
    "rsp": Register.RSP,
    "rbp": Register.RBP,
    "rsi": Register.RSI,
    "rdi": Register.RDI,
    "r8": Register.R8,
    "r9": Register.R9,
    "r10": Register.R10,
    "r11": Register.R11,
    "r12": Register.R12,
    "r13": Register.R13,
    "r14": Register.R14,
    "r15": Register.R15,
}


class Block:
    """A list of iced instructions with named labels, encoded at one address.

    Branches name labels; rip-relative operands name absolute addresses. ``encode()`` checks
    that every one of them came out pointing where it was asked to.
    """

    def __init__(self, thread_salt: int = 0) -> None:
        self._instrs: list[Instruction] = []
        self._labels: dict[str, int] = {}
        self._branches: list[tuple[Instruction, str]] = []
        self._label_refs: list[tuple[Instruction, str]] = []
        self.prefix = ""  # prepended to every label named (``Actions``: one per action)
        self.thread_salt = thread_salt  # where the address space's (record.py); 0: none

    def add(self, instr: Instruction, *, lock: bool = False) -> None:
        instr.ip = _LABEL_BASE + 16 * len(self._instrs)
        instr.has_lock_prefix = lock
        self._instrs.append(instr)

    def label(self, name: str) -> None:
        """Name the next instruction added."""
        name = self.prefix + name
        if name in self._labels:
            raise InternalError(f"label {name} defined twice")
        self._labels[name] = len(self._instrs)

    def branch(self, code: Code_, name: str) -> None:
        instr = Instruction.create_branch(code, 0)
        self._branches.append((instr, self.prefix + name))
        self.add(instr)

    def lea_label(self, reg: Register_, name: str) -> None:
        """``lea reg, [rip + label]``: the address of a labelled instruction."""
        instr = Instruction.create_reg_mem(Code.LEA_R64_M, reg, _rip(_LABEL_BASE))
        self._label_refs.append((instr, self.prefix + name))
        self.add(instr)

    def _label_ip(self, name: str) -> int:
        index = self._labels.get(name)
        if index is None or index >= len(self._instrs):
            raise InternalError(f"label {name} names no instruction")
        return _LABEL_BASE + 16 * index

    def encode(self, base: int) -> bytes:
        for instr, name in self._branches:
            instr.near_branch64 = self._label_ip(name)
        for instr, name in self._label_refs:
            instr.memory_displacement = self._label_ip(name)
        inside = {id(i) for i, _ in self._label_refs}
        # The block is small (DETOUR_MAX): a target this far from its start is out of reach of
        # every instruction in it, and BlockEncoder would refuse or mis-encode it.
        for instr in self._instrs:
            if instr.is_ip_rel_memory_operand and id(instr) not in inside:
                target = instr.memory_displacement
                if not _REL32_MIN + DETOUR_MAX <= target - base <= _REL32_MAX - DETOUR_MAX:
                    raise _out_of_reach(target, base)
        encoder = BlockEncoder(64)
        encoder.add_many(self._instrs)
        try:
            code = encoder.encode(base)
        except ValueError as exc:
            raise InternalError(f"iced cannot encode the detour at {base:#x}: {exc}") from exc
        self._check(code, base)
        return bytes(code)

    def _check(self, code: bytes, base: int) -> None:
        out = list(Decoder(64, code, ip=base))
        if len(out) != len(self._instrs):
            raise InternalError(f"{len(self._instrs)} instructions encoded as {len(out)}")
        for want, got in zip(self._instrs, out, strict=True):
            if not want.is_ip_rel_memory_operand:
                continue
            if want.memory_displacement >= _LABEL_BASE:  # a label inside the block
                index = (want.memory_displacement - _LABEL_BASE) // 16
                if not got.is_ip_rel_memory_operand or got.ip_rel_memory_address != out[index].ip:
                    raise InternalError(f"`{got}` at {got.ip:#x} misses its label")
                continue
            # Reach was checked before encoding: a mismatch here is a bug of ours or iced's.
            target = want.memory_displacement
            if (
                not got.is_ip_rel_memory_operand
                or got.memory_base != Register.RIP
                or got.ip_rel_memory_address != target
            ):
                raise InternalError(f"`{got}` at {got.ip:#x} does not reach {target:#x}")


def _out_of_reach(target: int, at: int) -> NotRelocatable:
    return NotRelocatable(
        f"{target:#x} is out of rel32 reach (±2 GiB) of the detour code at {at:#x}",
        errno=errno.ERANGE,
    )


def rip_operand(target: int) -> MemoryOperand:
    """``[rip + target - next ip]``: an absolute address, reached rip-relative."""
    return _rip(target)


def at(base: Register_, disp: int) -> MemoryOperand:
    """``[base + disp]``."""
    return _at(base, disp)


def mov_store(base: Register_, disp: int, reg: Register_) -> Instruction:
    """``mov [base + disp], reg``."""
    return _mov_store(base, disp, reg)


def mov_load(reg: Register_, base: Register_, disp: int) -> Instruction:
    """``mov reg, [base + disp]``."""
    return _mov_load(reg, base, disp)


def _rip(target: int) -> MemoryOperand:
    return MemoryOperand(Register.RIP, displ=target, displ_size=8)


def _at(base: Register_, disp: int) -> MemoryOperand:
    # iced's displacement sizes in 64-bit code: 0 none, 1 disp8, 8 disp32 (sign-extended).
    size = 0 if disp == 0 else 1 if -128 <= disp < 128 else 8
    return MemoryOperand(base, displ=disp, displ_size=size)


def _mov_store(base: Register_, disp: int, reg: Register_) -> Instruction:
    return Instruction.create_mem_reg(Code.MOV_RM64_R64, _at(base, disp), reg)


def _mov_load(reg: Register_, base: Register_, disp: int) -> Instruction:
    return Instruction.create_reg_mem(Code.MOV_R64_RM64, reg, _at(base, disp))


class FlagsSave(Enum):
    """How the detour keeps the program's flags across its action.

    LAHF: ``seto al; lahf`` after saving rax, ``add al, 0x7f; sahf`` before restoring it: the
    six arithmetic flags, all an action's instructions change. Needs LAHF/SAHF in 64-bit mode
    (CPUID ``lahf_lm``, every x86-64 CPU since 2005). PUSHF: ``pushfq``/``popfq``, for the rest.
    ``popfq`` rewrites the system flags too and is slow: measured pinned on this project's
    machines (AMD EPYC, KVM; tests/arch/bench_detour.py), a count detour costs 4.4 ns per call
    with it and 0.7 ns with LAHF; a record detour 13 and 11 ns. ``pushfq`` alone is free, so
    a record action that wants the whole flags word still pushes it and only skips ``popfq``.
    """

    LAHF = "lahf"
    PUSHF = "pushf"


# Frame words that are not registers.
EFLAGS: Final = "eflags"  # a pushfq image
ARITH: Final = "arith"  # the seto/lahf snapshot of the arithmetic flags, in ax


@dataclass(frozen=True, slots=True)
class Frame:
    """The words the entry pushed below the red zone, in push order: register names (their
    program values), EFLAGS and ARITH."""

    words: tuple[str, ...]
    # Bytes between the program's rsp and the first word: a detour skips the red zone; a
    # return trampoline, entered by a ``ret``, has none to skip (retstack.py).
    below: int = RED_ZONE

    def offset(self, word: str) -> int:
        """``[rsp + offset]`` holds ``word`` while the action runs."""
        return 8 * (len(self.words) - 1 - self.words.index(word))

    @property
    def probe_rsp(self) -> int:
        """The program's rsp at the probe is ``rsp + probe_rsp`` inside the action."""
        return 8 * len(self.words) + self.below

    @classmethod
    def of(cls, action: Action, flags: FlagsSave) -> Frame:
        if flags is FlagsSave.PUSHF:
            return cls((EFLAGS, *action.clobbers))
        words = [EFLAGS] if action.reads_flags else []
        words.append("rax")
        if "rax" in action.clobbers:
            words.append(ARITH)
        words += [r for r in action.clobbers if r != "rax"]
        return cls(tuple(words))


class Action(Protocol):
    """A compiled action: the registers it clobbers (and the arithmetic flags), whether it
    reads the program's whole flags word (``[rsp + frame.offset(EFLAGS)]``), and its code."""

    @property
    def clobbers(self) -> tuple[str, ...]: ...

    @property
    def reads_flags(self) -> bool: ...

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Actions:
    """Several actions run one after the other in one detour (an entry's record, then a
    return probe's hook, at one site): the registers any of them clobbers are saved, and
    each one's labels are its own (``Block.prefix``)."""

    actions: tuple[Action, ...]

    @property
    def clobbers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for a in self.actions for r in a.clobbers))

    @property
    def reads_flags(self) -> bool:
        return any(a.reads_flags for a in self.actions)

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None:
        for i, action in enumerate(self.actions):
            block.prefix = f"a{i}."
            try:
                action.emit(block, frame, probe_addr)
            finally:
                block.prefix = ""


@dataclass(frozen=True, slots=True)
class CountAction:
    """Add one to the 8-byte counter at ``counter`` (an absolute address within reach)."""

    counter: int
    locked: bool = True

    @property
    def clobbers(self) -> tuple[str, ...]:
        return ()

    @property
    def reads_flags(self) -> bool:
        return False

    def emit(self, block: Block, frame: Frame, probe_addr: int) -> None:
        block.add(Instruction.create_mem(Code.INC_RM64, _rip(self.counter)), lock=self.locked)


@dataclass(frozen=True, slots=True)
class Detour:
    """One probe's detour: ``code`` to place at ``addr``, and the ``patch`` for the probe."""

    addr: int
    code: bytes
    copy_offset: int
    region: Region

    @property
    def copy_addr(self) -> int:
        """The relocated displaced instructions: where a thread stopped at the probe address
        resumes to skip the action (the kernel's ``setup_detour_execution()``)."""
        return self.addr + self.copy_offset

    @property
    def back_addr(self) -> int:
        """The final ``jmp`` back to the instruction after the region."""
        return self.copy_addr + self.region.length

    @property
    def patch(self) -> bytes:
        """The 5 bytes to write at the probe address: ``jmp addr``."""
        return jmp_rel32(self.region.addr, self.addr)

    def original_address(self, rip: int) -> int | None:
        """Where a thread whose ``rip`` is in the copy (or on the jmp back) is in the original
        code; None for a rip in the action or elsewhere."""
        if self.copy_addr <= rip <= self.back_addr:
            return self.region.addr + (rip - self.copy_addr)
        return None


def build_detour(
    addr: int,
    region: Region,
    action: Action,
    *,
    flags: FlagsSave = FlagsSave.LAHF,
    thread_salt: int = 0,
) -> Detour:
    """The detour at ``addr`` for the probe whose jump displaces ``region``, running ``action``;
    a record names its thread with the salt word at ``thread_salt`` (record.py), if given.

    Raises NotRelocatable (ERANGE) when ``addr`` is out of rel32 reach of the probe, or an
    address the action uses or a displaced rip-relative operand is out of reach of the code.
    """
    # Step 1: the patch must reach the detour (checked first: the cheapest refusal).
    jmp_rel32(region.addr, addr)
    # Step 2: entry, action and exit, encoded at addr.
    frame = Frame.of(action, flags)
    block = Block(thread_salt)
    _enter(block, frame, flags)
    action.emit(block, frame, region.addr)
    _leave(block, frame, flags)
    head = block.encode(addr)
    # Step 3: the displaced instructions, relocated, and the jump back.
    copy_at = addr + len(head)
    copy = relocate_region(region, copy_at)
    back = jmp_rel32(copy_at + len(copy), region.end)
    code = head + copy + back
    if len(code) > DETOUR_MAX:
        raise NotRelocatable(
            f"its detour would be {len(code)} bytes, more than {DETOUR_MAX}", errno=errno.E2BIG
        )
    return Detour(addr, code, len(head), region)


def _enter(block: Block, frame: Frame, flags: FlagsSave) -> None:
    block.add(_lea_rsp(-RED_ZONE))
    for word in frame.words:
        if word == EFLAGS:
            block.add(Instruction.create(Code.PUSHFQ))
        elif word == ARITH:
            block.add(Instruction.create_reg(Code.PUSH_R64, Register.RAX))
        else:
            block.add(Instruction.create_reg(Code.PUSH_R64, _GPRS[word]))
            if word == "rax" and flags is FlagsSave.LAHF:
                block.add(Instruction.create_reg(Code.SETO_RM8, Register.AL))
                block.add(Instruction.create(Code.LAHF))


def _leave(block: Block, frame: Frame, flags: FlagsSave) -> None:
    skip = RED_ZONE
    for word in reversed(frame.words):
        if word == EFLAGS and flags is FlagsSave.PUSHF:
            block.add(Instruction.create(Code.POPFQ))
        elif word == EFLAGS:
            skip += 8  # only read: the first word pushed, so the last one left
        elif word == ARITH:
            block.add(Instruction.create_reg(Code.POP_R64, Register.RAX))
        else:
            if word == "rax" and flags is FlagsSave.LAHF:
                # al = OF (0 or 1): 1 + 0x7f overflows, 0 + 0x7f does not; sahf sets the rest.
                block.add(Instruction.create_reg_i32(Code.ADD_RM8_IMM8, Register.AL, 0x7F))
                block.add(Instruction.create(Code.SAHF))
            block.add(Instruction.create_reg(Code.POP_R64, _GPRS[word]))
    block.add(_lea_rsp(skip))


def _lea_rsp(delta: int) -> Instruction:
    # lea, not add/sub: the flags are the program's before the entry's save and after the exit.
    return Instruction.create_reg_mem(Code.LEA_R64_M, Register.RSP, _at(Register.RSP, delta))
