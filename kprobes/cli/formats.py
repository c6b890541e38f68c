"""``trace``'s probe lines that end with their own output line, bcc ``trace``'s way:

    kprobes trace -c ./prog 'p work i=%di:s64 "work(%d) in %s", i, comm'
    kprobes trace -c ./prog 'p work "work(%ld)", arg1'           # bcc's arg1: %di
    kprobes trace -c ./prog 'r work "work returned %ld", $retval'

The probe line is what comes before the first word that opens with ``"`` (the kernel's
immediate string ``name=\\"text"`` opens with a backslash, so it stays in the probe); the rest
is the format and its names (output/printf.py). The peers' names a probe does not fetch are
fetched for the format: bcc's and bpftrace's ``arg1``..``arg6`` (the SysV registers) and
``$retval``/``retval`` on a return probe. Everything is checked here, before the program is
touched: a fault is one line with its column in the probe line as given.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kprobes.cli.session import parse_spec
from kprobes.errors import SpecError
from kprobes.model import Event
from kprobes.output.printf import COMMON_FIELDS, bind_printf, parse_printf
from kprobes.spec import ProbeSpec, ReturnValue, TypeSpec

_FORMAT_START = re.compile(r'(?:^|\s)(")')
# bcc's argN: the function's Nth argument, in the SysV AMD64 calling convention's registers.
_ARG_REGISTERS = {f"arg{n}": reg for n, reg in enumerate(("di", "si", "dx", "cx", "r8", "r9"), 1)}
_RETVAL_NAMES = ("$retval", "retval")

Printer = Callable[[Event], str]


def parse_traced(text: str) -> tuple[ProbeSpec, Printer | None]:
    """A probe line of ``trace``, and the printer of its own line if it ends with one."""
    m = _FORMAT_START.search(text)
    if m is None:
        return parse_spec(text), None
    probe_text = text[: m.start(1)].rstrip()
    fmt = parse_printf(text, m.start(1))
    spec = parse_spec(probe_text)
    names = spec.arg_names
    retval = next(
        (n for n, a in zip(names, spec.args, strict=True) if isinstance(a.fetch, ReturnValue)),
        None,
    )
    more: dict[str, str] = {}  # fetch-args added for the format, by name
    for c in fmt.conversions:
        if c.name in names or c.name in COMMON_FIELDS or c.name in more:
            continue
        if c.name in _RETVAL_NAMES and retval is None:
            if not spec.is_return:
                raise SpecError(
                    f"{c.name} is what a return probe sees: not on an entry probe",
                    column=c.column,
                    text=text,
                )
            retval = "__retval"
            more[retval] = "$retval"
        elif c.name in _ARG_REGISTERS:
            more[c.name] = "%" + _ARG_REGISTERS[c.name]
    if more:
        added = " ".join(f"{name}={fetch}" for name, fetch in more.items())
        spec = parse_spec(f"{probe_text} {added}")
    aliases = dict.fromkeys(_RETVAL_NAMES, retval) if retval is not None else {}
    fields = [(name, _bits(t)) for name, t in spec.fields]
    try:
        return spec, bind_printf(fmt, fields, text, aliases)
    except SpecError as exc:
        hint = "arg1..arg6 are the function's arguments, $retval a return probe's value"
        raise SpecError(exc.message, column=exc.column, text=text, hint=hint) from exc


def _bits(t: TypeSpec) -> int | None:
    """The width an integer conversion cuts a fetched value to, without a length: its
    type's (None: not an integer)."""
    if t.is_string or t.is_array or t.name == "symbol":
        return None
    return t.element_size * 8
