"""Events formatted a batch at a time: the fast reader's text and JSON lines.

A target that decodes its records in batches (process/fast/batch.py) hands a probe's events
over as values ``tid``, ``cpu``, ``ts`` (the timestamp) and ``v0``, ``v1``... (the
fetch-args) with what is the same for all of them (the event's names, its process, its
arguments' names and types, its place) given once. Here each probe gets its line as source,
``LineSource``: an f-string over those values that the decoder's loop inlines (one
expression per event, no call, no row), giving the bytes ``text.format_event`` and
``jsonl.format_json`` would print for the same event. The columns that depend on the thread
and the CPU are made once per thread and CPU, the timestamp once per microsecond of a batch.
A value the producer says is plain (an int already cut to its type) is printed inline; any
other goes through ``argtypes``, as the per-event formatters do, so a fault, a string or an
array prints the same. ``compile_rows`` makes a line a function over rows, on its own.

Text from the probe (names, the place) enters through the namespace unless it is plain
identifier text. Rejected: building ``Event`` values and calling the per-event formatters
(three quarters of the time of ``trace`` went there); a formatter called per batch on a list
of rows (making and unpacking the rows cost a fifth of the time).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

from kprobes.output.argtypes import Kind, json_formatter, parse_type, text_formatter
from kprobes.output.text import UNKNOWN_COMM
from kprobes.values import dataclass

Rows = list[tuple[Any, ...]]
RowsFormatter = Callable[[Rows, int, str], str]  # (rows, ip, location) → the lines

_SAFE: Final = re.compile(r"[\w./+:=() -]*")  # text that may stand in the source as it is
# ``format_timestamp``: the microsecond, and its text made again only when it is not the
# event before's (a hot function's events share their microsecond by the dozen, and the
# text costs more than the rest of the line). ``round`` of a float is ``float.__round__``,
# called without the builtin's look-up of ``__round__`` (a timestamp is always a float).
_TS: Final = (
    "{(o_text if (o_us := (o_round(ts * 1000000000) + 500) // 1000) == o_last"
    " else (o_text := o_stamp(o_last := o_us)))}"
)


@dataclass(frozen=True, slots=True)
class ReturnHead:
    """The events are returns of ``func`` (at ``func_ip``): each one's place is its own
    caller, the line's ``ip``, named by ``locate`` (the ``location`` its ``Event`` would
    have): ``(caller+off/size <- func)``, and in JSON ``"return"``, ``"func"``,
    ``"func_ip"``."""

    func: str
    func_ip: int
    locate: Callable[[int], str]


@dataclass(frozen=True, slots=True)
class LineSource:
    """One probe's line, as source for a loop over its events: ``expr`` is an expression
    (an f-string, newline included) over ``ts``, the values ``v0``, ``v1``... and
    ``o_context``; ``setup`` is a statement run once a batch, over ``ip`` and ``location``;
    ``context`` one run when the thread or the CPU changes, over ``tid`` and ``cpu`` (it
    sets ``o_context``, the columns they decide); ``names`` is what they read besides (every
    name starts with ``o_``)."""

    expr: str
    setup: str
    context: str
    names: dict[str, Any]


def _stamp(usecs: int) -> str:
    """``format_timestamp``'s ``f"{secs:5d}.{usec_rem:06d}"``, without format specs."""
    secs, usec_rem = divmod(usecs, 1_000_000)
    return f"{str(secs).rjust(5)}.{str(usec_rem + 1_000_000)[1:]}"


class _PerKey(dict[int, str]):
    """A cache of the text of one column by its key (a thread, a CPU), made on first use."""

    def __init__(self, make: Callable[[int], str]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: int) -> str:
        text = self[key] = self._make(key)
        return text


class _Source:
    def __init__(self) -> None:
        self.names: dict[str, Any] = {
            "o_stamp": _stamp,
            "o_round": float.__round__,
        }

    def literal(self, text: str) -> str:
        """``text`` as a part of an f-string: as it is if it is safe, else a name."""
        if _SAFE.fullmatch(text):
            return text
        name = f"o_t{len(self.names)}"  # a name the namespace does not have yet
        self.names[name] = text
        return "{" + name + "}"

    def function(self, fn: Callable[[Any], str]) -> str:
        name = f"o_f{len(self.names)}"
        self.names[name] = fn
        return name

    def line(self, line: str, head: str) -> LineSource:
        setup = f"o_head = {head}; o_last = -1; o_text = ''"
        context = "o_context = o_who[tid] + o_cpus[cpu]"
        return LineSource(f'f"{line}\\n"', setup, context, self.names)


def compile_rows(line: LineSource, count: int, *, each_ip: bool = False) -> RowsFormatter:
    """The function that formats a list of rows ``(tid, cpu, ts, v0, ...)`` (``count``
    values) with ``line``: what a batch reader inlines, on its own. With ``each_ip`` a row
    is ``(tid, cpu, ts, ip, v0, ...)``: each event's own place (a return's caller)."""
    values = "".join(f"v{i}, " for i in range(count))
    ip = "ip, " if each_ip else ""
    source = (
        "def format_rows(rows, ip, location):\n"
        f"    {line.setup}\n"
        "    out = []\n"
        f"    for tid, cpu, ts, {ip}{values} in rows:\n"
        f"        {line.context}\n"
        f"        out.append({line.expr})\n"
        '    return "".join(out)\n'
    )
    names = dict(line.names)
    exec(compile(source, "<rows formatter>", "exec"), names)
    formatter: RowsFormatter = names["format_rows"]
    return formatter


def _text_value(src: _Source, i: int, type_text: str, plain: bool) -> str:
    kind = parse_type(type_text).kind
    if plain and kind in (Kind.UNSIGNED, Kind.SIGNED):
        return f"{{v{i}}}"
    if plain and kind is Kind.HEX:
        return f"{{hex(v{i})}}"  # an unsigned int: 0x and lowercase digits, as 0x%x
    if plain and kind is Kind.CHAR:
        return f"'{{chr(v{i})}}'"
    return f"{{{src.function(text_formatter(type_text))}(v{i})}}"


def text_line(
    event: str,
    names: Sequence[str],
    types: Sequence[str],
    plain: Sequence[bool],
    comm: Callable[[int], str],
    returns: ReturnHead | None = None,
) -> LineSource:
    """One probe's events as ``format_event`` lines (without ``-T`` or irq flags)."""
    src = _Source()
    src.names["o_who"] = _PerKey(lambda tid: f"{comm(tid) or UNKNOWN_COMM:>16}-{tid:<7} ")
    src.names["o_cpus"] = _PerKey(lambda cpu: f"[{cpu:03d}] " if cpu >= 0 else "[???] ")
    args = "".join(
        f" {src.literal(name)}={_text_value(src, i, t, p)}"
        for i, (name, t, p) in enumerate(zip(names, types, plain, strict=True))
    )
    head = "{o_head}"
    if returns is not None:  # ``format_location`` of a return, made once per caller
        func = returns.func or f"0x{returns.func_ip:x}"
        locate = returns.locate
        src.names["o_heads"] = _PerKey(lambda ip: f"{locate(ip) or f'0x{ip:x}'} <- {func}")
        head = "{o_heads[ip]}"
    line = f"{{o_context}} {_TS}: {src.literal(event)}: ({head}){args}"
    return src.line(line, "location or f'0x{ip:x}'")


def _json_value(src: _Source, i: int, type_text: str, plain: bool) -> str:
    kind = parse_type(type_text).kind
    if plain and kind in (Kind.UNSIGNED, Kind.SIGNED, Kind.HEX):
        return f"{{v{i}}}"
    return f"{{{src.function(json_formatter(type_text))}(v{i})}}"


def json_line(
    name: str,
    pid: int,
    names: Sequence[str],
    types: Sequence[str],
    plain: Sequence[bool],
    comm: Callable[[int], str],
    returns: ReturnHead | None = None,
) -> LineSource | None:
    """One probe ``name`` (GROUP/EVENT) of process ``pid``'s events as ``format_json``
    lines (without ``-T`` or stacks); None if two arguments have one name (one key of the
    JSON object: ``format_json`` keeps the last value, in the first one's place)."""
    if len(set(names)) < len(names):
        return None
    src = _Source()
    dumps = json.dumps
    src.names["o_start"] = f'{{"event": {dumps(name)}, "pid": {pid}, "tid": '
    src.names["o_who"] = _PerKey(lambda tid: f'{tid}, "comm": {dumps(comm(tid))}, "cpu": ')
    src.names["o_cpus"] = _PerKey(lambda cpu: str(cpu) if cpu >= 0 else "null")
    src.names["o_dumps"] = dumps
    args = ", ".join(
        f"{src.literal(dumps(n))}: {_json_value(src, i, t, p)}"
        for i, (n, t, p) in enumerate(zip(names, types, plain, strict=True))
    )
    head = 'f\', "ip": {ip}, "location": {o_dumps(location)}, "args": {{\''
    if returns is None:
        line = '{o_start}{o_context}, "timestamp": {ts!r}{o_head}' + args + "}}}}"
        return src.line(line.replace('"', '\\"'), head)
    locate = returns.locate  # each caller's head made once; the function's tail is fixed
    src.names["o_heads"] = _PerKey(
        lambda ip: f', "ip": {ip}, "location": {dumps(locate(ip))}, "args": {{'
    )
    tail = f'}}, "return": true, "func": {dumps(returns.func)}, "func_ip": {returns.func_ip}}}'
    src.names["o_tail"] = tail
    line = '{o_start}{o_context}, "timestamp": {ts!r}{o_heads[ip]}' + args + "{o_tail}"
    return src.line(line.replace('"', '\\"'), head)
