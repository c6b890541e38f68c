"""Jprobes on a process: call a Python function with the probed function's arguments.

The kernel's jprobe jumps into a handler that has the probed function's own signature, so the
compiler fetches the arguments for it; ``jprobe_return()`` then traps back and the registers
and the top of the stack are restored from copies (the mirroring principle). Here the handler
is Python, so the arguments are fetched for it: where each one is comes from the SysV
calling convention (``arch/x86_64/abi.py``) applied to the parameter types, which come from
DWARF when the binary has it, else from the handler's annotations, else every argument is a
raw 64-bit integer. Returning from the handler is ``jprobe_return()``. The registers and the
stack above ``rsp`` are copied before the handler runs and put back after it, so whatever it
writes through the process (``proc.write``) cannot disturb the call.

Everything is decided once at registration (``plan_jprobe``); a hit reads the registers it
already has, one copy of the stack, and the xmm registers only when a float is passed.

Rejected: calling the handler with a register view and letting it fetch its own arguments
(that is a kprobe), and guessing types from the values (a pointer and a long look the same).
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import math
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kprobes.arch.x86_64.abi import (
    ArgClass,
    ArgLocation,
    ArgSpec,
    FieldSpec,
    assign_locations,
    gather,
)
from kprobes.arch.x86_64.regs import REG_INDEX
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Jprobe
from kprobes.errors import InternalError, ProbeRejected
from kprobes.linux import ptrace
from kprobes.symbols.dwarf import Param, ParamKind, get_signature
from kprobes.values import dataclass

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from kprobes.core.manager import ProbeManager
    from kprobes.process.engine.arming import ProbeLocation
    from kprobes.process.engine.tracee import Tracee

MAX_STACK_SIZE = 64  # bytes of stack mirrored, as the kernel's MAX_STACK_SIZE
STRING_MAX = 4096
_XMM_OFFSET = 160  # of xmm0 in the FXSAVE image


# A converter turns an argument's raw little-endian bytes into the Python value handed over.
Converter = Callable[[bytes, "Tracee"], Any]


@dataclass(frozen=True, slots=True)
class ArgPlan:
    name: str
    location: ArgLocation
    convert: Converter
    # Precomputed from location, so a hit reads words without looking names up: each part is
    # ("r", index into the register words) or ("x", offset of an xmm register in FXSAVE).
    parts: tuple[tuple[str, int], ...] = ()

    def raw(self, words: Any, fp: bytes | None, stack: bytes) -> bytes:
        """The argument's bytes, as ``abi.gather`` would assemble them."""
        loc = self.location
        if not self.parts:
            return gather(loc, _no_register, stack)
        out = bytearray()
        for kind, at in self.parts:
            if kind == "x":
                assert fp is not None
                out += fp[at : at + 8]
            else:
                out += int(words[at]).to_bytes(8, "little")
        return bytes(out[: loc.size]).ljust(loc.size, b"\0")


def _no_register(reg: str) -> bytes:
    raise InternalError(f"a stack argument asked for register {reg}")


def _parts(loc: ArgLocation) -> tuple[tuple[str, int], ...]:
    return tuple(
        ("x", _XMM_OFFSET + 16 * int(r[3:])) if r.startswith("xmm") else ("r", REG_INDEX[r])
        for r in loc.registers
    )


@dataclass(frozen=True, slots=True)
class JprobePlan:
    """How to fetch every argument of one jprobe's function, decided at registration."""

    args: tuple[ArgPlan, ...]
    stack_bytes: int  # how much of the stack to copy (arguments and the mirror)
    needs_fpregs: bool
    source: str  # "dwarf", "annotations" or "raw": where the types came from


# -- conversions -----------------------------------------------------------------------------


def _int(size: int, signed: bool) -> Converter:
    def convert(raw: bytes, _mem: Tracee) -> int:
        return int.from_bytes(raw[:size], "little", signed=signed)

    return convert


def _bool(raw: bytes, _mem: Tracee) -> bool:
    return raw[0] != 0


def _float(raw: bytes, _mem: Tracee) -> float:
    return float(struct.unpack_from("<f", raw)[0])


def _double(raw: bytes, _mem: Tracee) -> float:
    return float(struct.unpack_from("<d", raw)[0])


def _long_double(raw: bytes, _mem: Tracee) -> float:
    """An x87 80-bit extended value (64-bit mantissa with explicit integer bit)."""
    mantissa = int.from_bytes(raw[:8], "little")
    exp_sign = int.from_bytes(raw[8:10], "little")
    sign = -1.0 if exp_sign & 0x8000 else 1.0
    exponent = exp_sign & 0x7FFF
    if exponent == 0x7FFF:
        return sign * math.inf if mantissa << 1 == 0 else math.nan
    if exponent == 0 and mantissa == 0:
        return sign * 0.0
    return sign * math.ldexp(mantissa, (exponent or 1) - 16383 - 63)


def _string(as_bytes: bool) -> Converter:
    def convert(raw: bytes, mem: Tracee) -> str | bytes | None:
        ptr = int.from_bytes(raw[:8], "little")
        if ptr == 0:
            return None
        data = mem.read_string(ptr, STRING_MAX)
        return data if as_bytes else data.decode(errors="replace")

    return convert


def _raw_bytes(raw: bytes, _mem: Tracee) -> bytes:
    return bytes(raw)


def _ctypes_value(ctype: Any) -> Converter:
    def convert(raw: bytes, _mem: Tracee) -> Any:
        value = ctype.from_buffer_copy(raw.ljust(ctypes.sizeof(ctype), b"\0"))
        return value.value if isinstance(value, ctypes._SimpleCData) else value

    return convert


# -- types -----------------------------------------------------------------------------------

_SIGNED_CTYPES = (ctypes.c_byte, ctypes.c_short, ctypes.c_int, ctypes.c_long, ctypes.c_longlong)
_UNSIGNED_CTYPES = (
    ctypes.c_ubyte,
    ctypes.c_ushort,
    ctypes.c_uint,
    ctypes.c_ulong,
    ctypes.c_ulonglong,
    ctypes.c_size_t,
    ctypes.c_bool,
)


def _param_spec(param: Param) -> ArgSpec:
    kind = param.kind
    if kind is ParamKind.FLOAT or kind is ParamKind.DOUBLE:
        return ArgSpec.sse(param.size)
    if kind is ParamKind.LONG_DOUBLE:
        return ArgSpec.x87()
    if kind is ParamKind.STRUCT:
        fields = [FieldSpec(f.offset, f.size, _field_class(f.kind, f.size)) for f in param.fields]
        if not fields:  # larger than 16 bytes: DWARF gives no leaves, it is in memory anyway
            return ArgSpec(param.size, (ArgClass.MEMORY,), max(param.stack_align, 8))
        return ArgSpec.aggregate(param.size, fields, param.stack_align)
    if kind is ParamKind.UNKNOWN:
        return ArgSpec(param.size, (ArgClass.MEMORY,), max(param.stack_align, 8))
    return ArgSpec.integer(param.size or 8)


def _field_class(kind: ParamKind, size: int) -> ArgClass:
    if kind.is_sse:
        return ArgClass.SSE
    if kind is ParamKind.LONG_DOUBLE:
        return ArgClass.X87
    return ArgClass.INTEGER


def _param_converter(param: Param, annotation: Any) -> Converter:
    """DWARF decides the value; an annotation only chooses its Python form (``bytes`` for a
    ``char *``, a ctypes type or structure). ``int``/``float``/``bool`` say nothing more."""
    if annotation not in (inspect.Parameter.empty, int, float, bool):
        return _annotation_converter(annotation, param.size)[1]
    kind = param.kind
    if kind is ParamKind.SIGNED:
        return _int(param.size, True)
    if kind is ParamKind.BOOL:
        return _bool
    if kind is ParamKind.FLOAT:
        return _float
    if kind is ParamKind.DOUBLE:
        return _double
    if kind is ParamKind.LONG_DOUBLE:
        return _long_double
    if kind is ParamKind.CHAR_POINTER:
        return _string(as_bytes=False)
    if kind in (ParamKind.STRUCT, ParamKind.UNKNOWN):
        return _raw_bytes
    return _int(param.size or 8, False)  # UNSIGNED, POINTER


def _annotation_converter(annotation: Any, size: int = 8) -> tuple[ArgSpec, Converter]:
    """The calling-convention class and conversion an annotation asks for."""
    if annotation is int:
        return ArgSpec.integer(), _int(size, True)
    if annotation is bool:
        return ArgSpec.integer(), _bool
    if annotation is float:
        return ArgSpec.sse(8), _double
    if annotation is str:
        return ArgSpec.integer(), _string(as_bytes=False)
    if annotation is bytes:
        return ArgSpec.integer(), _string(as_bytes=True)
    if isinstance(annotation, type) and issubclass(annotation, ctypes._SimpleCData):
        n = ctypes.sizeof(annotation)
        if annotation is ctypes.c_char_p:
            return ArgSpec.integer(), _string(as_bytes=True)
        if annotation in (ctypes.c_float, ctypes.c_double):
            return ArgSpec.sse(n), _ctypes_value(annotation)
        if annotation is ctypes.c_longdouble:
            return ArgSpec.x87(), _long_double
        if annotation in _SIGNED_CTYPES or annotation in _UNSIGNED_CTYPES:
            return ArgSpec.integer(n), _ctypes_value(annotation)
        if annotation is ctypes.c_void_p:
            return ArgSpec.integer(), _int(8, False)
    if isinstance(annotation, type) and issubclass(annotation, (ctypes.Structure, ctypes.Union)):
        n = ctypes.sizeof(annotation)
        return ArgSpec.aggregate(n, _ctypes_leaves(annotation)), _ctypes_value(annotation)
    raise TypeError(f"cannot fetch an argument of type {annotation!r}")


def _ctypes_leaves(ctype: Any, base: int = 0) -> list[FieldSpec]:
    leaves: list[FieldSpec] = []
    for item in ctype._fields_:
        name, ftype = item[0], item[1]
        offset = base + getattr(ctype, name).offset
        if isinstance(ftype, type) and issubclass(ftype, (ctypes.Structure, ctypes.Union)):
            leaves += _ctypes_leaves(ftype, offset)
        elif isinstance(ftype, type) and issubclass(ftype, ctypes.Array):
            elem: Any = getattr(ftype, "_type_")  # noqa: B009 - typeshed hides it
            length: int = getattr(ftype, "_length_")  # noqa: B009
            for i in range(length):
                leaves += _ctypes_leaves_of_scalar(elem, offset + i * ctypes.sizeof(elem))
        else:
            leaves += _ctypes_leaves_of_scalar(ftype, offset)
    return leaves


def _ctypes_leaves_of_scalar(ftype: Any, offset: int) -> list[FieldSpec]:
    if isinstance(ftype, type) and issubclass(ftype, (ctypes.Structure, ctypes.Union)):
        return _ctypes_leaves(ftype, offset)
    size = ctypes.sizeof(ftype)
    if ftype in (ctypes.c_float, ctypes.c_double):
        return [FieldSpec(offset, size, ArgClass.SSE)]
    if ftype is ctypes.c_longdouble:
        return [FieldSpec(offset, size, ArgClass.X87)]
    return [FieldSpec(offset, size, ArgClass.INTEGER)]


# -- planning --------------------------------------------------------------------------------


def plan_jprobe(jp: Jprobe, module_path: str, link_addr: int, display: str) -> JprobePlan:
    """Decide how to fetch the arguments; ProbeRejected if ``jp.entry`` cannot take them."""
    entry = jp.entry
    if not callable(entry):
        raise ProbeRejected("a jprobe needs an entry function (entry=fn)", errno=errno.EINVAL)
    try:
        fn_sig = inspect.signature(entry)
    except (TypeError, ValueError) as exc:
        raise ProbeRejected(f"cannot inspect the jprobe handler {entry!r}: {exc}") from exc
    positional = [
        p
        for p in fn_sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_varargs = any(p.kind is p.VAR_POSITIONAL for p in fn_sig.parameters.values())
    name = getattr(entry, "__name__", repr(entry))

    signature = get_signature(module_path, addr=link_addr)
    specs: list[ArgSpec] = []
    converters: list[Converter] = []
    names: list[str] = []
    if signature is not None:
        source = "dwarf"
        params = signature.params
        try:
            fn_sig.bind(*range(len(params)))
        except TypeError as exc:
            spelled = ", ".join(f"{p.type_name} {p.name}".strip() for p in params)
            raise ProbeRejected(
                f"jprobe handler {name}{fn_sig} cannot take the {len(params)} arguments of "
                f"{display.split('+')[0]}({spelled}): {exc}",
                errno=errno.EINVAL,
            ) from exc
        for i, param in enumerate(params):
            annotation = (
                positional[i].annotation if i < len(positional) else inspect.Parameter.empty
            )
            try:
                converters.append(_param_converter(param, _resolve(annotation, entry)))
            except TypeError as exc:
                raise ProbeRejected(f"jprobe handler {name}: {exc}", errno=errno.EINVAL) from exc
            specs.append(_param_spec(param))
            names.append(param.name or f"arg{i + 1}")
    elif any(p.annotation is not inspect.Parameter.empty for p in positional):
        source = "annotations"
        for p in positional:
            if p.annotation is inspect.Parameter.empty:
                spec, convert = ArgSpec.integer(), _int(8, False)
            else:
                try:
                    spec, convert = _annotation_converter(_resolve(p.annotation, entry))
                except TypeError as exc:
                    raise ProbeRejected(
                        f"jprobe handler {name}, parameter {p.name}: {exc}", errno=errno.EINVAL
                    ) from exc
            specs.append(spec)
            converters.append(convert)
            names.append(p.name)
    else:
        source = "raw"
        count = len(positional) if positional or not has_varargs else 6
        for i in range(count):
            specs.append(ArgSpec.integer())
            converters.append(_int(8, False))
            names.append(positional[i].name if i < len(positional) else f"arg{i + 1}")
    returns = None
    if signature is not None and signature.returns is not None:
        returns = _param_spec(signature.returns)  # a big struct result takes rdi first
    locations = assign_locations(specs, returns=returns)
    args = tuple(
        ArgPlan(n, loc, c, _parts(loc))
        for n, loc, c in zip(names, locations, converters, strict=True)
    )
    stack_end = max(
        [MAX_STACK_SIZE]
        + [loc.stack_offset + loc.size for loc in locations if loc.stack_offset is not None]
    )
    needs_fp = any(r.startswith("xmm") for loc in locations for r in loc.registers)
    return JprobePlan(args, (stack_end + 7) & ~7, needs_fp, source)


def _resolve(annotation: Any, entry: Callable[..., Any]) -> Any:
    """String annotations (``from __future__ import annotations``) evaluated in fn's module."""
    if not isinstance(annotation, str):
        return annotation
    scope = dict(vars(ctypes))
    scope.update(getattr(entry, "__globals__", {}))
    try:
        return eval(annotation, scope)
    except Exception as exc:
        raise TypeError(f"cannot evaluate the annotation {annotation!r}: {exc}") from exc


# -- the hit ---------------------------------------------------------------------------------


def fetch_args(plan: JprobePlan, regs: Any, mem: Tracee, stack: bytes) -> list[Any]:
    fp: bytes | None = ptrace.getfpregs(regs.tid) if plan.needs_fpregs else None
    words = regs.words
    return [a.convert(a.raw(words, fp, stack), mem) for a in plan.args]


def pre_handler_for(
    jp: Jprobe, plan: JprobePlan, memory_of: Callable[[int], Tracee]
) -> Callable[[Kprobe, Any], None]:
    """The jprobe's entry kprobe handler: fetch, call, mirror back."""
    entry = jp.entry
    assert entry is not None
    size = plan.stack_bytes

    def pre_handler(_kp: Kprobe, regs: Any) -> None:
        mem = memory_of(regs.tid)
        sp = regs.rsp
        saved_regs = bytes(regs.buffer)
        stack = mem.read_some(sp, size)
        try:
            entry(*fetch_args(plan, regs, mem, stack))
        finally:
            # The mirroring principle: the call goes on exactly as it was entered.
            regs.buffer[:] = saved_regs
            if stack and mem.read_some(sp, len(stack)) != stack:
                mem.write(sp, stack)

    return pre_handler


def describe(plan: JprobePlan) -> Sequence[str]:
    """``name@location`` per argument, for error messages and debugging."""
    return [f"{a.name}@{'+'.join(map(str, a.location.parts))}" for a in plan.args]


def register_jprobes(
    jps: Sequence[Jprobe],
    manager: ProbeManager,
    resolve: Callable[[Kprobe], ProbeLocation],
    memory_of: Callable[[int], Tracee],
    batch: Callable[[], AbstractContextManager[None]],
) -> None:
    """Register jprobes, each with its plan and entry handler; a failure rolls back the
    ones already registered. ``memory_of(tid)``: the address space of a thread."""
    with batch():
        done: list[Jprobe] = []
        try:
            for jp in jps:
                if jp.is_registered:
                    raise ProbeRejected(f"{jp!r} is already registered", errno=errno.EINVAL)
                loc = resolve(jp.kp)
                plan = plan_jprobe(jp, loc.module_path, loc.addr - loc.bias, loc.display)
                jp.kp.pre_handler = pre_handler_for(jp, plan, memory_of)
                jp.plan = plan
                manager.register(jp.kp)
                done.append(jp)
        except BaseException:
            for jp in reversed(done):
                manager.unregister(jp.kp)
            raise
