"""Values → text: ``ProbeSpec`` → probe line, ``Filter`` → filter expression.

Both renderings are canonical rather than copies of what was typed (the values do not keep
spellings; see ``types``), and both satisfy ``parse(render(x)) == x``:

* probe lines: one space between words, names only where the user gave them, ``+0`` offsets
  dropped, addresses and file offsets in hex, and every number inside an argument in the
  shorter of decimal and hex. That last rule matters: the kernel refuses an argument over 63
  characters, and the shortest spelling is never longer than the one that was parsed.
* filters: the parentheses the tree needs and no others, so a rendered filter is never more
  deeply nested than the text it came from (the parser bounds nesting).

Rendering the names the user left out would also round-trip, but would change what the line
means to a reader ("did I pick arg1?") and to the kernel's duplicate-probe check, so we don't.
"""

from __future__ import annotations

from kprobes.spec.lexical import format_number
from kprobes.spec.types import (
    AddressLocation,
    And,
    Comm,
    Dereference,
    FetchArg,
    FileOffset,
    FileOffsetLocation,
    Filter,
    FunctionArg,
    Immediate,
    ImmediateString,
    Location,
    MemoryAddress,
    MemorySymbol,
    Not,
    Or,
    Predicate,
    ProbeArg,
    ProbeSpec,
    Register,
    ReturnValue,
    StackAddress,
    StackEntry,
    SymbolLocation,
    TypeSpec,
)


def render(spec: ProbeSpec) -> str:
    """The probe line for ``spec``, in the syntax ``parse`` accepts (and the kernel, unless
    the location uses our ``LIB:SYM`` / ``PATH:SYM`` extensions)."""
    names = ""
    if spec.group is not None or spec.event is not None:
        group = f"{spec.group}/" if spec.group is not None else ""
        names = f":{group}{spec.event or ''}"
    if spec.is_delete:
        return f"-{names}"
    head = spec.command.value + (str(spec.maxactive) if spec.maxactive else "")
    words = [head + names]
    if spec.location is not None:
        words.append(render_location(spec.location, spec.has_return_suffix))
    words.extend(render_arg(arg) for arg in spec.args)
    return " ".join(words)


def _offset_suffix(offset: int) -> str:
    return f"+{offset}" if offset else ""


def _ref_ctr_suffix(ref: int | None) -> str:
    return "" if ref is None else f"(0x{ref:x})"


def render_location(loc: Location, has_return_suffix: bool = False) -> str:
    """``SYM+OFF``, ``MOD:SYM``, ``0xADDR``, ``PATH:0xOFF%return(0xREF)``..."""
    suffix = "%return" if has_return_suffix else ""
    match loc:
        case AddressLocation(address=address):
            return f"0x{address:x}"
        case FileOffsetLocation(path=path, offset=offset, ref_ctr_offset=ref):
            return f"{path}:0x{offset:x}{suffix}{_ref_ctr_suffix(ref)}"
        case SymbolLocation(symbol=symbol, offset=offset, module=module, ref_ctr_offset=ref):
            prefix = f"{module}:" if module is not None else ""
            return f"{prefix}{symbol}{_offset_suffix(offset)}{suffix}{_ref_ctr_suffix(ref)}"
    raise TypeError(f"not a location: {loc!r}")


def _signed_offset(value: int) -> str:
    return format_number(value) if value < 0 else "+" + format_number(value)


def render_fetch(fetch: FetchArg) -> str:
    """One fetch argument, without name or type."""
    match fetch:
        case Register(name=name):
            return f"%{name}"
        case MemoryAddress(address=address):
            return f"@{format_number(address)}"
        case MemorySymbol(symbol=symbol, offset=offset):
            return f"@{symbol}{_signed_offset(offset) if offset else ''}"
        case FileOffset(offset=offset):
            return f"@+{format_number(offset)}"
        case StackEntry(index=index):
            return f"$stack{index}"
        case StackAddress():
            return "$stack"
        case FunctionArg(index=index):
            return f"$arg{index}"
        case ReturnValue():
            return "$retval"
        case Comm():
            return "$comm"
        case Dereference(offset=offset, base=base, is_user=is_user):
            sign = "-" if offset < 0 else "+"
            user = "u" if is_user else ""
            return f"{sign}{user}{format_number(abs(offset))}({render_fetch(base)})"
        case Immediate(value=value):
            return f"\\{format_number(value)}"
        case ImmediateString(value=value):
            return f'\\"{value}"'
    raise TypeError(f"not a fetch argument: {fetch!r}")


def render_type(t: TypeSpec) -> str:
    """``u32``, ``string[2]``, ``b4@3/32``..."""
    if t.bitfield is not None:
        base = f"b{t.bitfield.width}@{t.bitfield.offset}/{t.name[1:]}"
    else:
        base = t.name
    return base if t.count is None else f"{base}[{t.count}]"


def render_arg(arg: ProbeArg) -> str:
    """``[NAME=]FETCHARG[:TYPE]``."""
    name = f"{arg.name}=" if arg.name is not None else ""
    typ = f":{render_type(arg.type)}" if arg.type is not None else ""
    return f"{name}{render_fetch(arg.fetch)}{typ}"


# --- filters ------------------------------------------------------------------------------------


def _render_predicate(pred: Predicate) -> str:
    if isinstance(pred.value, str):
        quote = "'" if '"' in pred.value else '"'
        value = f"{quote}{pred.value}{quote}"
    else:
        value = str(pred.value)
    return f"{pred.field} {pred.op.value} {value}"


def render_filter(f: Filter) -> str:
    """The filter text, with the parentheses its tree needs and no others, so that
    ``parse_filter(render_filter(f), fields) == f``."""
    match f:
        case Predicate():
            return _render_predicate(f)
        case Not(operand=operand):
            inner = render_filter(operand)
            return f"!({inner})" if isinstance(operand, And | Or) else f"!{inner}"
        case And(operands=operands):
            parts = (
                f"({render_filter(o)})" if isinstance(o, And | Or) else render_filter(o)
                for o in operands
            )
            return " && ".join(parts)
        case Or(operands=operands):
            return " || ".join(
                f"({render_filter(o)})" if isinstance(o, Or) else render_filter(o) for o in operands
            )
    raise TypeError(f"not a filter: {f!r}")
