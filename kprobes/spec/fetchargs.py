"""One probe argument, ``[NAME=]FETCHARG[:TYPE]``, parsed the way trace_probe.c parses it.

The kernel compiles each argument into at most ``FETCH_INSN_MAX`` (16) fetch instructions: one
load (register, stack, immediate...), one per dereference, a store, an optional bitfield and
array step, and the end marker. We build a tree instead, but count the same instructions while
parsing, so an argument the kernel would refuse as "too much nested" is refused here too,
at the same place. The checks run in the kernel's order (name, length, type, fetch, then the
type/fetch combination), so the first error reported is the one the kernel's ``error_log``
would show.

What the argument may use depends on the probe (``ArgContext``): ``$retval`` only on return
probes, ``$argN`` only at a symbol's entry, ``@+OFFSET`` only for uprobes, ``@SYM`` and the
``symbol``/``symstr``/``%pd`` types only for kernel-style probes.

Rejected alternative: a regular expression per argument. Nesting (``+8(+0(%di))``) is
recursive, and the kernel's error columns need the position of each part.
"""

from __future__ import annotations

import enum

from kprobes.errors import SpecError
from kprobes.spec.lexical import (
    U32_MAX,
    Word,
    is_good_name,
    parse_signed,
    parse_unsigned,
    spec_error,
)
from kprobes.spec.types import (
    TYPE_NAMES,
    Bitfield,
    Comm,
    Dereference,
    FetchArg,
    FileOffset,
    FunctionArg,
    Immediate,
    ImmediateString,
    MemoryAddress,
    MemorySymbol,
    ProbeArg,
    Register,
    ReturnValue,
    StackAddress,
    StackEntry,
    TypeSpec,
)
from kprobes.values import dataclass

MAX_ARG_NAME_LEN = 32
MAX_ARGSTR_LEN = 63
MAX_ARRAY_LEN = 63
"""``TYPE[N]`` needs N < 64, as kprobetrace.rst says (trace_probe.c itself lets 64 through)."""
FETCH_INSN_MAX = 16
PARAM_MAX_STACK = 2048
"""``THREAD_SIZE / sizeof(long)`` on x86-64: the largest ``$stackN`` / ``$argN`` N."""

REGISTERS = frozenset(
    {"ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip", "flags", "cs", "ss", "orig_ax"}
    | {f"r{n}" for n in range(8, 16)}
)
"""``regoffset_table`` of arch/x86/kernel/ptrace.c on x86-64."""

RESERVED_FIELD_NAMES = frozenset(
    {
        "common_type",
        "common_flags",
        "common_preempt_count",
        "common_pid",
        "common_tgid",
        "__probe_ip",
        "__probe_ret_ip",
        "__probe_func",
    }
)

_DENTRY_DEREFS = {"%pd": 2, "%pD": 3}
"""``X:%pd`` is ``+0(+d_name.name(X)):string``; ``%pD`` goes through ``f_path.dentry`` first."""
_DENTRY_EXPANSION = {"%pd": len("+0x0(+0x28()):string"), "%pD": len("+0x0(+0x28(+0x40())):string")}
"""How much longer the kernel's expansion of ``X:%pd`` is than ``X`` (2-digit offsets)."""

KPROBE_ONLY_TYPES = ("symbol", "symstr", "%pd", "%pD")


def valid_types(*, is_uprobe: bool) -> str:
    """The types an argument may have, as the kernel's README lists them (``TYPE_NAMES``,
    less those of kprobes only on a uprobe), for the hint of an unknown type."""
    names = ["char", "string", "ustring"]
    if not is_uprobe:
        names += ["symbol", "symstr", "%pd/%pD"]
    integers = ", ".join(f"{sign}8/16/32/64" for sign in "sux")
    return (
        f"valid types: {integers}, {', '.join(names)}, "
        "b<width>@<offset>/<container> (a bitfield), TYPE[N] (an array)"
    )


_SYMBOL_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_.")
_SYMBOL_CHARS = _SYMBOL_START | frozenset("0123456789$@")


def is_symbol(name: str) -> bool:
    """A symbol as we accept it: ELF symbol characters, not starting with a digit."""
    return bool(name) and name[0] in _SYMBOL_START and all(c in _SYMBOL_CHARS for c in name)


@dataclass(frozen=True, slots=True)
class ArgContext:
    """What the probe allows its arguments to fetch."""

    is_return: bool
    is_uprobe: bool
    allows_function_args: bool


class _Op(enum.Enum):
    """The kernel's ``fetch_op`` of an argument's last load: decides which stores may follow."""

    REG = enum.auto()
    STACK = enum.auto()
    STACKP = enum.auto()
    RETVAL = enum.auto()
    IMM = enum.auto()
    COMM = enum.auto()
    ARG = enum.auto()
    DATA = enum.auto()
    DEREF = enum.auto()
    UDEREF = enum.auto()


def _last_op(fetch: FetchArg) -> _Op:
    match fetch:
        case Register():
            return _Op.REG
        case StackEntry():
            return _Op.STACK
        case StackAddress():
            return _Op.STACKP
        case ReturnValue():
            return _Op.RETVAL
        case Immediate():
            return _Op.IMM
        case Comm():
            return _Op.COMM
        case FunctionArg():
            return _Op.ARG
        case ImmediateString():
            return _Op.DATA
        case Dereference(is_user=True):
            return _Op.UDEREF
        case _:
            return _Op.DEREF


class _ArgParser:
    """Parses one argument word; ``ops`` counts the kernel's fetch instructions."""

    def __init__(self, text: str, ctx: ArgContext) -> None:
        self.text = text
        self.ctx = ctx
        self.last_column = 0  # where the kernel's ctx->offset points after the fetch

    def error(self, message: str, column: int, hint: str = "") -> SpecError:
        return spec_error(message, column, self.text, hint)

    def unknown_type(self, column: int, why: str = "") -> SpecError:
        """The kernel's "Unknown type is specified", with the types this probe may use."""
        valid = valid_types(is_uprobe=self.ctx.is_uprobe)
        return self.error("Unknown type is specified", column, f"{why}; {valid}" if why else valid)

    def parse(self, word: Word, index: int, used: set[str]) -> ProbeArg:
        s, col = word.text, word.column
        # Step 1: the name, checked against reserved and earlier names.
        eq = s.find("=")
        if eq >= 0:
            name: str | None = s[:eq]
            if eq > MAX_ARG_NAME_LEN:
                raise self.error("Argument name is too long", col)
            if eq == 0:
                raise self.error("Argument name is not specified", col)
            if not is_good_name(s[:eq]):
                raise self.error("Argument name must follow the same rules as C identifiers", col)
            body, bcol = s[eq + 1 :], col + eq + 1
        else:
            name, body, bcol = None, s, col
        effective = name if name is not None else f"arg{index + 1}"
        if effective in used or effective in RESERVED_FIELD_NAMES:
            raise self.error("This argument name is already used", col)
        # Step 2: the length of the expression.
        if len(body) > MAX_ARGSTR_LEN:
            raise self.error("Argument expression is too long", bcol)
        if not body:
            raise self.error("No argument expression", bcol)
        # Step 3: the type, split at the first ':'.
        colon = body.find(":")
        fetch_text = body if colon < 0 else body[:colon]
        type_text = None if colon < 0 else body[colon + 1 :]
        tcol = bcol + colon + 1
        typ, bitfield_ok = self._type(type_text, tcol, fetch_text, bcol)
        if (
            typ is not None
            and len(fetch_text) + _DENTRY_EXPANSION.get(typ.name, 0) > MAX_ARGSTR_LEN
        ):
            raise self.error("Argument expression is too long", bcol)
        # Step 4: the fetch itself, then what the type does with it.
        self.last_column = bcol
        fetch, ops = self._fetch(fetch_text, bcol)
        self._finalize(fetch, ops, typ, bitfield_ok, tcol, bcol)
        used.add(effective)
        return ProbeArg(fetch=fetch, name=name, type=typ)

    # --- types --------------------------------------------------------------------------

    def _type(
        self, t: str | None, tcol: int, fetch_text: str, bcol: int
    ) -> tuple[TypeSpec | None, bool]:
        """``parse_probe_arg_type()``; returns the type and whether its bitfield is sound."""
        count: int | None = None
        base = t
        if t is not None:
            lb = t.find("[")
            if lb >= 0:
                rb = t.find("]", lb)
                if rb < 0:
                    raise self.error("Array is not closed", tcol + len(t))
                if rb != len(t) - 1:
                    raise self.error("Array has wrong suffix", tcol + rb + 1)
                count = parse_unsigned(t[lb + 1 : rb], limit=U32_MAX)
                if not count:
                    raise self.error("Invalid array size", tcol + lb + 1)
                if count > MAX_ARRAY_LEN:
                    raise self.error("Array number is too big", tcol + lb + 1)
                base = t[:lb]
        if fetch_text in ("$comm", "$COMM") or fetch_text.startswith('\\"'):
            if count is not None or (base is not None and base != "string"):
                raise self.error(
                    "$comm and immediate-string only accepts string type",
                    tcol if t is not None else bcol,
                )
            return (None if t is None else TypeSpec("string")), True
        if base is None:
            return None, True
        if base in TYPE_NAMES:
            if self.ctx.is_uprobe and base in KPROBE_ONLY_TYPES:
                raise self.unknown_type(tcol, f"{base} is for kprobes only")
            if base in _DENTRY_DEREFS and count is not None:
                raise self.unknown_type(tcol, f"{base} cannot be an array")
            return TypeSpec(base, count), True
        if base.startswith("b"):
            return self._bitfield(base, count, tcol)
        raise self.unknown_type(tcol)

    def _bitfield(self, t: str, count: int | None, tcol: int) -> tuple[TypeSpec, bool]:
        """``b<width>@<offset>/<container>``: a bad container is an unknown type; a bad
        width or offset is a bad bitfield, reported after the fetch as the kernel does."""
        head, slash, container_text = t.partition("/")
        container = parse_unsigned(container_text) if slash else None
        if container not in (8, 16, 32, 64):
            raise self.unknown_type(tcol, "a bitfield's container is 8, 16, 32 or 64 bits")
        width_text, at, offset_text = head[1:].partition("@")
        width = parse_unsigned(width_text)
        offset = parse_unsigned(offset_text)
        if not at or not width or offset is None or width + offset > container:
            return TypeSpec(f"u{container}", count), False
        return TypeSpec(f"u{container}", count, Bitfield(width, offset)), True

    # --- fetches ------------------------------------------------------------------------

    def _fetch(self, s: str, col: int) -> tuple[FetchArg, int]:
        """``parse_probe_arg()``: the fetch and the number of instructions it needs."""
        head = s[:1]
        if head == "$":
            return self._variable(s, col), 1
        if head == "%":
            if s[1:] in REGISTERS:
                return Register(s[1:]), 1
            raise self.error("Invalid register name", col)
        if head == "@":
            return self._memory(s, col)
        if head in ("+", "-"):
            return self._dereference(s, col)
        if head == "\\":
            return self._immediate(s, col), 1
        if head and head in _SYMBOL_START and head != ".":
            raise self.error("BTF is not available or not supported", col)
        raise self.error("Invalid fetch argument", col)

    def _variable(self, s: str, col: int) -> FetchArg:
        """``parse_probe_vars()``: ``$retval``, ``$stack[N]``, ``$comm``, ``$argN``."""
        var = s[1:]
        if var == "retval":
            if not self.ctx.is_return:
                raise self.error("$retval is not available on probe", col)
            return ReturnValue()
        if var.startswith("stack"):
            digits = var[5:]
            if not digits:
                return StackAddress()
            n = parse_unsigned(digits, base=10) if digits[0].isdigit() else None
            if n is None:
                raise self.error("Invalid $-variable specified", col)
            if not self.ctx.is_uprobe and n > PARAM_MAX_STACK:
                raise self.error("Invalid stack number", col)
            return StackEntry(n)
        if var in ("comm", "COMM"):
            return Comm()
        if var.startswith("arg") and var[3:4].isdigit():
            n = parse_unsigned(var[3:], base=10)
            if n is None:
                raise self.error("Invalid $-variable specified", col)
            if n == 0 or n > PARAM_MAX_STACK:
                raise self.error("Invalid argument number", col)
            if not self.ctx.allows_function_args:
                raise self.error("$arg* can be used only on function entry or exit", col)
            return FunctionArg(n)
        raise self.error("Invalid $-variable specified", col)

    def _memory(self, s: str, col: int) -> tuple[FetchArg, int]:
        """``@ADDR`` (load + deref), ``@+OFFSET`` (file offset + deref), ``@SYM[+-OFF]``
        (symbol holder + immediate + deref)."""
        rest = s[1:]
        if rest[:1].isdigit():
            addr = parse_unsigned(rest)
            if addr is None:
                raise self.error("Invalid memory address", col)
            return MemoryAddress(addr), 2
        if rest.startswith("+"):
            if not self.ctx.is_uprobe:
                raise self.error("File offset is not available with kprobe", col)
            offset = parse_unsigned(rest[1:]) if rest[1:2].isdigit() else None
            if offset is None:
                raise self.error("Invalid file offset value", col)
            return FileOffset(offset), 2
        if self.ctx.is_uprobe:
            raise self.error("Symbol is not available with uprobe", col)
        cut = min((i for i in (rest.find("+"), rest.find("-")) if i >= 0), default=len(rest))
        symbol, offset_text = rest[:cut], rest[cut:]
        offset = parse_signed(offset_text) if offset_text[1:2].isdigit() else None
        if not is_symbol(symbol) or (offset_text and offset is None):
            raise self.error("Invalid memory address", col)
        return MemorySymbol(symbol, offset or 0), 3

    def _dereference(self, s: str, col: int) -> tuple[FetchArg, int]:
        """``+|-[u]OFF(BASE)``: BASE is whatever lies up to the last ``)``."""
        start = 2 if s[1:2] == "u" else 1
        lp = s.find("(", start)
        if lp < 0:
            raise self.error("Dereference needs a brace", col)
        digits = s[start:lp]
        sign = "-" if s[0] == "-" else ""
        offset = parse_signed(sign + digits) if digits[:1].isdigit() else None
        if offset is None:
            raise self.error("Invalid dereference offset", col)
        inner_col = col + lp + 1
        rest = s[lp + 1 :]
        rp = rest.rfind(")")
        if rp < 0:
            raise self.error("Dereference brace is not closed", inner_col + len(rest))
        if rp != len(rest) - 1:
            raise self.error("Invalid fetch argument", inner_col + rp + 1)
        base, ops = self._fetch(rest[:rp], inner_col)
        if isinstance(base, Comm | ImmediateString):
            raise self.error("$comm can not be dereferenced", inner_col)
        ops += 1
        if ops > FETCH_INSN_MAX - 1:
            raise self.error("Dereference is too much nested", inner_col)
        self.last_column = inner_col
        return Dereference(offset, base, start == 2), ops

    def _immediate(self, s: str, col: int) -> FetchArg:
        """``\\IMM`` (``str_to_immediate()``) or ``\\"STRING"``."""
        if s[1:2] == '"':
            content = s[2:]
            if not content.endswith('"'):
                raise self.error("String is not closed with '\"'", col + len(s))
            return ImmediateString(content[:-1])
        digits = s[1:]
        value: int | None = None
        if digits[:1].isdigit():
            value = parse_unsigned(digits)
        elif digits[:1] in ("-", "+") and digits[1:2].isdigit():
            value = parse_signed(digits if digits[0] == "-" else digits[1:])
        if value is None:
            raise self.error("Invalid immediate value", col + 1)
        return Immediate(value)

    # --- the type applied to the fetch -------------------------------------------------

    def _finalize(
        self,
        fetch: FetchArg,
        ops: int,
        typ: TypeSpec | None,
        bitfield_ok: bool,
        tcol: int,
        bcol: int,
    ) -> None:
        """``finalize_fetch_insn()``: which stores the type needs, and whether they fit."""
        last = _last_op(fetch)
        name = typ.name if typ is not None else None
        count = typ.count if typ is not None else None
        if name in _DENTRY_DEREFS:
            if isinstance(fetch, Comm | ImmediateString):
                raise self.error("$comm can not be dereferenced", bcol)
            ops += _DENTRY_DEREFS[name]
            if ops > FETCH_INSN_MAX - 1:
                raise self.error("Dereference is too much nested", bcol)
            last, name = _Op.DEREF, "string"
        if name is None and isinstance(fetch, Comm | ImmediateString):
            name = "string"
        is_array_store = True
        if name in ("string", "ustring", "symstr"):
            if name == "symstr":
                if last not in (_Op.REG, _Op.STACK, _Op.RETVAL, _Op.ARG, _Op.DEREF):
                    raise self.error("Symbol String doesn't accept data/userdata", tcol)
                is_array_store = False
            elif last not in (_Op.DEREF, _Op.UDEREF, _Op.IMM, _Op.COMM, _Op.DATA):
                raise self.error("String accepts only memory argument", tcol)
            if name == "symstr" or last in (_Op.IMM, _Op.COMM, _Op.DATA) or count:
                ops += 1
        elif last in (_Op.DEREF, _Op.UDEREF):
            is_array_store = last == _Op.DEREF
        else:
            ops += 1
            is_array_store = False
        if ops > FETCH_INSN_MAX - 1:
            raise self.error("Dereference is too much nested", self.last_column)
        if typ is not None and (typ.bitfield is not None or not bitfield_ok):
            ops += 1
            if not bitfield_ok or ops > FETCH_INSN_MAX - 1:
                raise self.error("Invalid bitfield", tcol)
        if count is not None:
            if not is_array_store:
                raise self.error("String accepts only memory argument", tcol)
            ops += 1
            if ops > FETCH_INSN_MAX - 1:
                raise self.error("Dereference is too much nested", self.last_column)


def parse_arg(text: str, word: Word, index: int, used: set[str], ctx: ArgContext) -> ProbeArg:
    """Parse the ``index``-th argument word of ``text``; adds its name to ``used``."""
    return _ArgParser(text, ctx).parse(word, index, used)
