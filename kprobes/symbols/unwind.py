"""Stack traces of a stopped thread, from the call frame information (CFI) of each module.

x86-64 code is built without frame pointers from -O1 on, so walking the ``rbp`` chain loses
frames or invents them. What nearly every binary does carry is ``.eh_frame``: the unwind
tables that C++ exceptions, ``pthread_cancel`` and ``backtrace()`` need, one FDE per function
saying, for every instruction, how to find the Canonical Frame Address (the caller's ``rsp``)
and where the caller's registers and the return address were saved. ``unwind()`` applies
those rules frame after frame, as GDB and libgcc do; ``.debug_frame`` (what ``-g`` emits
when unwind tables are turned off) is consulted next, and the frame-pointer chain only where
a module has no entry for an address at all.

The tables are read by ``cfi.py``: finding an entry costs one bisection of the linker's
``.eh_frame_hdr`` search table and the parsing of one FDE (parsing all 3700 of libc's up front
takes a third of a second); files without that table, and ``.debug_frame``, are parsed in full
once. Everything is cached per file identity and shared by every process that maps the file.

The walk reads memory and learns where files are mapped only through callbacks, so this
module needs no ptrace and is tested against fakes. One callback exists for return probes:
a frame hooked by a kretprobe holds the trampoline's address in its return-address slot,
and ``translate_return(slot, value)`` lets the caller put the real address in its place, so
that a trace never shows the trampoline (the kernel's uprobes show ``[uprobes]`` there).

Rejected: prologue analysis as GDB does it for code without CFI (it needs the instruction
decoder of ``arch/``, which this layer must not import, for code that hardly exists outside
hand-written assembly); and libunwind through ctypes (its remote unwinding needs accessors
written in C, and it would know nothing of our trampoline).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Final

from kprobes.errors import TargetError
from kprobes.symbols.cfa import Fde, RegRule, Row, Rule
from kprobes.symbols.cfi import find_fde
from kprobes.symbols.leb128 import sleb128, uleb128
from kprobes.values import dataclass

# DWARF register numbers of x86-64 (System V psABI, figure 3.36); 16 is the return address.
DWARF_REGISTERS: Final = (
    "rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip",
)  # fmt: skip
_RBP: Final = 6
_RSP: Final = 7
_RIP: Final = 16
# Registers a callee must preserve: the only ones whose value in a caller frame is known
# without a rule saying where it was saved.
_CALLEE_SAVED: Final = (3, _RBP, 12, 13, 14, 15)
_MASK64: Final = (1 << 64) - 1
# A frame pointer farther than this above the stack pointer is taken for an unrelated value.
_MAX_FP_FRAME: Final = 1 << 24

ReadWord = Callable[[int], int]
ModuleAt = Callable[[int], tuple[str, int] | None]
TranslateReturn = Callable[[int, int], int]


class FoundBy(Enum):
    """How a frame's address was found."""

    FIRST = "first"  # the stopped thread's own rip
    CFI = "cfi"  # a return address located by the callee's unwind table
    FP = "fp"  # a return address located by the callee's frame pointer
    SIGNAL = "signal"  # the interrupted instruction, from a signal frame's saved context


class StopReason(Enum):
    """Why the walk found no frame after the last one."""

    OUTERMOST = "outermost frame"  # the unwind table says so (_start, clone) or ra is 0
    NO_MODULE = "address in no mapped file and no usable frame pointer"
    NO_UNWIND_INFO = "no unwind table entry and no usable frame pointer"
    UNKNOWN_REGISTER = "the unwind rule needs a register whose value is lost"
    UNSUPPORTED = "unsupported DWARF expression in the unwind rule"
    UNREADABLE = "stack memory cannot be read"
    NOT_OUTWARD = "the caller's frame is not above this one (corrupt stack?)"
    MAX_FRAMES = "frame limit reached"


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a stack trace, innermost first."""

    addr: int  # rip for the first frame (and after a signal), else the return address
    cfa: int | None  # this frame's canonical frame address; None where it was not found
    how: FoundBy
    stop: StopReason | None = None  # set on the last frame: why nothing follows it


# -- DWARF expressions ---------------------------------------------------------------------


class _Stop(Exception):
    """Raised inside one step of the walk; becomes the last frame's ``stop``."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


def _uleb(code: bytes, pos: int) -> tuple[int, int]:
    try:
        return uleb128(code, pos)
    except IndexError:
        raise _Stop(StopReason.UNSUPPORTED) from None


def _sleb(code: bytes, pos: int) -> tuple[int, int]:
    try:
        return sleb128(code, pos)
    except IndexError:
        raise _Stop(StopReason.UNSUPPORTED) from None


def _signed(value: int) -> int:
    return value - (1 << 64) if value & (1 << 63) else value


_BINARY: Final[dict[int, Callable[[int, int], int]]] = {
    0x1A: lambda a, b: a & b,  # and
    0x1C: lambda a, b: a - b,  # minus
    0x1E: lambda a, b: a * b,  # mul
    0x21: lambda a, b: a | b,  # or
    0x22: lambda a, b: a + b,  # plus
    0x24: lambda a, b: a << b if b < 64 else 0,  # shl
    0x25: lambda a, b: a >> b,  # shr
    0x26: lambda a, b: _signed(a) >> min(b, 63),  # shra
    0x27: lambda a, b: a ^ b,  # xor
    0x29: lambda a, b: int(_signed(a) == _signed(b)),  # eq
    0x2A: lambda a, b: int(_signed(a) >= _signed(b)),  # ge
    0x2B: lambda a, b: int(_signed(a) > _signed(b)),  # gt
    0x2C: lambda a, b: int(_signed(a) <= _signed(b)),  # le
    0x2D: lambda a, b: int(_signed(a) < _signed(b)),  # lt
    0x2E: lambda a, b: int(_signed(a) != _signed(b)),  # ne
}
_CONSTANTS: Final = {  # DW_OP_const*: (size, signed)
    0x08: (1, False),
    0x09: (1, True),
    0x0A: (2, False),
    0x0B: (2, True),
    0x0C: (4, False),
    0x0D: (4, True),
    0x0E: (8, False),
    0x0F: (8, True),
}
_MAX_EXPR_STEPS: Final = 1000


def _evaluate(
    code: bytes, regs: Mapping[int, int], read_word: ReadWord, *, push: int | None = None
) -> int:
    """The value a DWARF expression of the unwind rules computes (a subset of DWARF 5 §2.5).

    What compilers and glibc write in CFI is covered: the PLT's CFA expression (registers,
    literals, arithmetic and comparison) and the signal frame's ``breg7 N; deref``. ``push``
    is the CFA, which register rules start with on the stack. Operations come in three
    groups: those that push an operand (``_operand``), those that work on the stack
    (``_operate``) and the jumps (``_jump``).
    """
    stack: list[int] = [] if push is None else [push]
    pos = steps = 0
    while pos < len(code):
        steps += 1
        if steps > _MAX_EXPR_STEPS:
            raise _Stop(StopReason.UNSUPPORTED)  # a branch loop
        op = code[pos]
        pos += 1
        if op == 0x96:  # nop
            continue
        if op in (0x2F, 0x28):  # skip, bra
            pos = _jump(op, code, pos, stack)
            continue
        operand = _operand(op, code, pos, regs)
        if operand is not None:
            value, pos = operand
            stack.append(value & _MASK64)
        else:
            pos = _operate(op, code, pos, stack, read_word)
    return _pop(stack)


def _operand(op: int, code: bytes, pos: int, regs: Mapping[int, int]) -> tuple[int, int] | None:
    """For an operation that pushes a value read from the expression or a register (the
    literals, constants and base registers): that value and where the next operation starts.
    None for any other operation."""
    if 0x30 <= op <= 0x4F:  # lit0..lit31
        return op - 0x30, pos
    if 0x70 <= op <= 0x8F:  # breg0..breg31
        offset, pos = _sleb(code, pos)
        return _register_value(regs, op - 0x70) + offset, pos
    if op == 0x92:  # bregx
        number, pos = _uleb(code, pos)
        offset, pos = _sleb(code, pos)
        return _register_value(regs, number) + offset, pos
    if op in _CONSTANTS:
        size, is_signed = _CONSTANTS[op]
        if pos + size > len(code):
            raise _Stop(StopReason.UNSUPPORTED)
        return int.from_bytes(code[pos : pos + size], "little", signed=is_signed), pos + size
    if op == 0x10:  # constu
        return _uleb(code, pos)
    if op == 0x11:  # consts
        return _sleb(code, pos)
    return None


def _operate(op: int, code: bytes, pos: int, stack: list[int], read_word: ReadWord) -> int:
    """Apply an operation on the stack (arithmetic, comparison, deref, stack moves); returns
    where the next operation starts. An operation not known here stops the walk."""
    if op in _BINARY:
        b, a = _pop(stack), _pop(stack)
        stack.append(_BINARY[op](a, b) & _MASK64)
    elif op == 0x23:  # plus_uconst
        value, pos = _uleb(code, pos)
        stack.append((_pop(stack) + value) & _MASK64)
    elif op == 0x06:  # deref
        stack.append(read_word(_pop(stack)) & _MASK64)
    elif op == 0x12:  # dup
        value = _pop(stack)
        stack += [value, value]
    elif op == 0x13:  # drop
        _pop(stack)
    elif op == 0x14:  # over
        if len(stack) < 2:
            raise _Stop(StopReason.UNSUPPORTED)
        stack.append(stack[-2])
    elif op == 0x16:  # swap
        b, a = _pop(stack), _pop(stack)
        stack += [b, a]
    elif op == 0x1F:  # neg
        stack.append(-_pop(stack) & _MASK64)
    elif op == 0x20:  # not
        stack.append(~_pop(stack) & _MASK64)
    else:
        raise _Stop(StopReason.UNSUPPORTED)
    return pos


def _jump(op: int, code: bytes, pos: int, stack: list[int]) -> int:
    """Where ``skip`` (always) or ``bra`` (when the popped value is not 0) goes on."""
    if pos + 2 > len(code):
        raise _Stop(StopReason.UNSUPPORTED)
    jump = int.from_bytes(code[pos : pos + 2], "little", signed=True)
    pos += 2
    if op == 0x2F or _pop(stack) != 0:
        pos += jump
        if not 0 <= pos <= len(code):
            raise _Stop(StopReason.UNSUPPORTED)
    return pos


def _pop(stack: list[int]) -> int:
    if not stack:
        raise _Stop(StopReason.UNSUPPORTED)
    return stack.pop()


def _register_value(regs: Mapping[int, int], number: int) -> int:
    value = regs.get(number)
    if value is None:
        raise _Stop(StopReason.UNKNOWN_REGISTER)
    return value


# -- the walk ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Cursor:
    """A frame about to be unwound: its address and the registers known in it."""

    pc: int
    regs: Mapping[int, int]  # by DWARF number
    how: FoundBy

    @property
    def is_exact(self) -> bool:
        """pc is the next instruction to run, not a return address (which follows a call)."""
        return self.how in (FoundBy.FIRST, FoundBy.SIGNAL)


@dataclass(frozen=True, slots=True)
class _Step:
    cfa: int | None
    caller: _Cursor | None  # None: the walk ends here
    stop: StopReason | None = None


def unwind(
    regs: Mapping[str, int],
    read_word: ReadWord,
    module_at: ModuleAt,
    translate_return: TranslateReturn | None = None,
    max_frames: int = 64,
) -> list[Frame]:
    """The frames of a stopped thread whose registers are ``regs``, innermost first.

    ``regs`` maps register names (``rip``, ``rsp``, ``rbp`` at least; the other callee-saved
    ones help) to values. ``read_word(addr)`` returns the 8 bytes at ``addr`` as an unsigned
    integer, raising TargetError (or OSError) where memory cannot be read.
    ``module_at(addr)`` returns the path of the file mapped at ``addr`` and its load bias, or
    None. ``translate_return(slot, value)`` is called with every return address read from the
    stack and the address of its slot, and returns the address to use instead (the real one,
    where ``value`` is a return trampoline).

    Never raises for a stack it cannot walk: the walk ends there and the last frame's
    ``stop`` says why.
    """
    if max_frames < 1:
        return []
    known = {n: regs[name] & _MASK64 for n, name in enumerate(DWARF_REGISTERS) if name in regs}
    cursor = _Cursor(known[_RIP], known, FoundBy.FIRST)
    frames: list[Frame] = []
    while True:
        try:
            step = _step(cursor, read_word, module_at, translate_return)
        except _Stop as stop:
            step = _Step(None, None, stop.reason)
        except (TargetError, OSError):
            step = _Step(None, None, StopReason.UNREADABLE)
        if step.caller is not None and len(frames) + 1 == max_frames:
            step = _Step(step.cfa, None, StopReason.MAX_FRAMES)
        frames.append(Frame(cursor.pc, step.cfa, cursor.how, step.stop))
        if step.caller is None:
            return frames
        cursor = step.caller


def _step(
    cursor: _Cursor,
    read_word: ReadWord,
    module_at: ModuleAt,
    translate_return: TranslateReturn | None,
) -> _Step:
    """Unwind one frame: its CFA and its caller, from the unwind table or the frame pointer."""
    # A return address follows the call: the call itself, and its unwind row, is one byte
    # back (it may even be the last instruction of the function, before another one starts).
    lookup = cursor.pc if cursor.is_exact else cursor.pc - 1
    where = module_at(lookup)
    if where is not None:
        path, bias = where
        fde = find_fde(path, lookup - bias)
        row = None if fde is None else fde.row_at(lookup - bias)
        if fde is not None and row is not None:
            return _step_cfi(cursor, fde, row, read_word, translate_return)
    step = _step_frame_pointer(cursor, read_word, translate_return)
    if step is not None:
        return step
    reason = StopReason.NO_MODULE if where is None else StopReason.NO_UNWIND_INFO
    return _Step(None, None, reason)


def _step_cfi(
    cursor: _Cursor,
    fde: Fde,
    row: Row,
    read_word: ReadWord,
    translate_return: TranslateReturn | None,
) -> _Step:
    regs = cursor.regs
    # Step 1: the CFA, which is the caller's stack pointer.
    if row.cfa_expr is not None:
        cfa = _evaluate(row.cfa_expr, {**regs, _RIP: cursor.pc}, read_word)
    else:
        if row.cfa_reg is None:
            raise _Stop(StopReason.NO_UNWIND_INFO)
        base = regs.get(row.cfa_reg)
        if base is None:
            raise _Stop(StopReason.UNKNOWN_REGISTER)
        cfa = (base + row.cfa_offset) & _MASK64
    # A caller's frame is above its callee's on the stack, except across a signal frame
    # (the handler may run on an alternate stack).
    sp = regs.get(_RSP)
    if not fde.is_signal_frame and sp is not None and cfa <= sp:
        return _Step(cfa, None, StopReason.NOT_OUTWARD)

    # Step 2: the return address, and where it was read from.
    rule = row.rules.get(fde.ra_column)
    if rule is None or rule[0] is Rule.UNDEFINED:
        return _Step(cfa, None, StopReason.OUTERMOST)
    ra, slot = _apply(rule, cfa, regs, read_word)
    if slot is not None and translate_return is not None:
        ra = translate_return(slot, ra)
    if ra == 0:
        return _Step(cfa, None, StopReason.OUTERMOST)

    # Step 3: the caller's registers: saved ones where the rules say, callee-saved ones
    # unchanged, the stack pointer at the CFA unless a rule says otherwise.
    caller: dict[int, int] = {}
    for number in {*_CALLEE_SAVED, *row.rules}:
        if number == fde.ra_column:
            continue
        reg_rule = row.rules.get(number, (Rule.SAME_VALUE, 0))
        if reg_rule[0] is Rule.SAME_VALUE:
            if number in regs:
                caller[number] = regs[number]
        elif reg_rule[0] is not Rule.UNDEFINED:
            try:
                caller[number] = _apply(reg_rule, cfa, regs, read_word)[0]
            except (_Stop, TargetError, OSError):
                continue  # lost in the caller; a later rule that needs it will say so
    caller.setdefault(_RSP, cfa)
    caller[_RIP] = ra
    how = FoundBy.SIGNAL if fde.is_signal_frame else FoundBy.CFI
    return _Step(cfa, _Cursor(ra, caller, how))


def _apply(
    rule: RegRule, cfa: int, regs: Mapping[int, int], read_word: ReadWord
) -> tuple[int, int | None]:
    """A register's value in the caller, and the address it was saved at (if in memory)."""
    kind, arg = rule
    if kind is Rule.OFFSET and isinstance(arg, int):
        slot = (cfa + arg) & _MASK64
        return read_word(slot), slot
    if kind is Rule.VAL_OFFSET and isinstance(arg, int):
        return (cfa + arg) & _MASK64, None
    if kind is Rule.REGISTER and isinstance(arg, int):
        value = regs.get(arg)
        if value is None:
            raise _Stop(StopReason.UNKNOWN_REGISTER)
        return value, None
    if kind is Rule.EXPRESSION and isinstance(arg, bytes):
        slot = _evaluate(arg, regs, read_word, push=cfa)
        return read_word(slot), slot
    if kind is Rule.VAL_EXPRESSION and isinstance(arg, bytes):
        return _evaluate(arg, regs, read_word, push=cfa), None
    raise _Stop(StopReason.UNSUPPORTED)


def _step_frame_pointer(
    cursor: _Cursor, read_word: ReadWord, translate_return: TranslateReturn | None
) -> _Step | None:
    """Unwind through the ``push rbp; mov rbp, rsp`` frame; None if rbp is not such a frame."""
    rbp = cursor.regs.get(_RBP)
    sp = cursor.regs.get(_RSP)
    found = frame_pointer_caller(rbp, sp, read_word, translate_return)
    if found is None:
        return None
    cfa, ra, saved_rbp = found
    if ra == 0:
        return _Step(cfa, None, StopReason.OUTERMOST)
    # Where this frame saved the other callee-saved registers is unknown: they are lost.
    caller = {_RBP: saved_rbp, _RSP: cfa, _RIP: ra}
    return _Step(cfa, _Cursor(ra, caller, FoundBy.FP))


def frame_pointer_caller(
    rbp: int | None, sp: int | None, read_word: ReadWord, translate_return: TranslateReturn | None
) -> tuple[int, int, int] | None:
    """(CFA, return address, caller's rbp) of a frame that keeps ``rbp`` as its frame
    pointer; None if ``rbp`` is not one (the fallback of both walkers where no unwind table
    covers an address).

    The frame pointer is trusted only if it is aligned and lies a little above the stack
    pointer; the saved ``rbp`` is at ``[rbp]`` and the return address at ``[rbp + 8]``.
    """
    if rbp is None or sp is None or rbp % 8 or not sp <= rbp < sp + _MAX_FP_FRAME:
        return None
    saved_rbp = read_word(rbp)
    slot = rbp + 8
    ra = read_word(slot)
    if translate_return is not None:
        ra = translate_return(slot, ra)
    return rbp + 16, ra, saved_rbp
