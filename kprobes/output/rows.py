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
Where every value is plain, the line is also given as a template (``LineTemplate``): its
texts and, between them, the names of its fields, for a reader that fills the fields a
column at a time (process/fast/columns.py).

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
class LineTemplate:
    """One probe's line for a reader of columns: ``line(tid, cpu, ip, location)`` is the
    line of the events of thread ``tid`` on ``cpu`` at ``ip`` (the site, or a return's
    caller) named ``location``, as its texts with the names of its fields between them:
    ``(text, name, text, ..., text)``. A name is ``stamp`` (the event's microsecond, as
    ``format_timestamp`` rounds it, printed by the ``%`` format ``stamp`` over its seconds
    and microseconds: at most once, before any other field), ``ts`` (the timestamp,
    seconds) or ``v0``, ``v1``... (the values, ints), each printed by ``show[name]``."""

    line: Callable[[int, int, int, str], tuple[str, ...]]
    show: dict[str, Callable[[Any], str]]
    stamp: str | None = None


@dataclass(frozen=True, slots=True)
class LineSource:
    """One probe's line, as source for a loop over its events: ``expr`` is an expression
    (an f-string, newline included) over ``ts``, the values ``v0``, ``v1``... and
    ``o_context``; ``setup`` is a statement run once a batch, over ``ip`` and ``location``;
    ``context`` one run when the thread or the CPU changes, over ``tid`` and ``cpu`` (it
    sets ``o_context``, the columns they decide); ``names`` is what they read besides (every
    name starts with ``o_``); ``template`` the same line for a reader of columns, where
    every value is plain."""

    expr: str
    setup: str
    context: str
    names: dict[str, Any]
    template: LineTemplate | None = None


def _stamp(usecs: int) -> str:
    """``format_timestamp``'s ``f"{secs:5d}.{usec_rem:06d}"``, without format specs."""
    secs, usec_rem = divmod(usecs, 1_000_000)
    return f"{str(secs).rjust(5)}.{str(usec_rem + 1_000_000)[1:]}"


STAMP: Final = "%5d.%06d"  # ``format_timestamp``'s (the kernel's ``%5lu.%06lu``), by ``%``


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

    def line(self, line: str, head: str, template: LineTemplate | None = None) -> LineSource:
        setup = f"o_head = {head}; o_last = -1; o_text = ''"
        context = "o_context = o_who[tid] + o_cpus[cpu]"
        return LineSource(f'f"{line}\\n"', setup, context, self.names, template)


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
    place: Place = _entry_place
    if returns is not None:  # ``format_location`` of a return, made once per caller
        func = returns.func or f"0x{returns.func_ip:x}"
        locate = returns.locate
        heads = src.names["o_heads"] = _PerKey(lambda ip: f"{locate(ip) or f'0x{ip:x}'} <- {func}")
        head = "{o_heads[ip]}"
        place = _caller_place(heads)
    line = f"{{o_context}} {_TS}: {src.literal(event)}: ({head}){args}"
    template = _text_template(event, names, types, plain, src.names, place)
    return src.line(line, "location or f'0x{ip:x}'", template)


Place = Callable[[int, str], str]  # (ip, location) → the place as the line prints it


def _entry_place(ip: int, location: str) -> str:
    return location or f"0x{ip:x}"


def _caller_place(heads: dict[int, str]) -> Place:
    return lambda ip, _location: heads[ip]


_TEXT_SHOWS: Final[dict[Kind, Callable[[Any], str]]] = {
    Kind.UNSIGNED: int.__repr__,
    Kind.SIGNED: int.__repr__,
    Kind.HEX: hex,  # an unsigned int: 0x and lowercase digits, as 0x%x
    Kind.CHAR: chr,  # in quotes
}


def _fields(texts: Sequence[str]) -> tuple[str, ...]:
    """``v0``, the text after it, ``v1``... for the texts after each value."""
    return tuple(part for i, text in enumerate(texts) for part in (f"v{i}", text))


def _text_template(
    event: str,
    names: Sequence[str],
    types: Sequence[str],
    plain: Sequence[bool],
    columns: dict[str, Any],
    place: Place,
) -> LineTemplate | None:
    """``text_line``'s line as a template (the thread's and CPU's columns ``columns``'
    ``o_who`` and ``o_cpus``); None unless every value is a plain int."""
    show: dict[str, Callable[[Any], str]] = {}
    texts = [""]  # before each value, then the line's end
    for i, (name, t, p) in enumerate(zip(names, types, plain, strict=True)):
        fn = _TEXT_SHOWS.get(parse_type(t).kind) if p else None
        if fn is None:
            return None
        quote = "'" if fn is chr else ""
        texts[-1] += f" {name}={quote}"
        texts.append(quote)
        show[f"v{i}"] = fn
    texts[-1] += "\n"
    rest = _fields(texts[1:])
    who, cpus, first = columns["o_who"], columns["o_cpus"], texts[0]

    def line(tid: int, cpu: int, ip: int, location: str) -> tuple[str, ...]:
        head = f": {event}: ({place(ip, location)}){first}"
        return (f"{who[tid]}{cpus[cpu]} ", "stamp", head, *rest)

    return LineTemplate(line, show, STAMP)


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
        template = _json_template(names, types, plain, src.names, _json_place, "}}")
        return src.line(line.replace('"', '\\"'), head, template)
    locate = returns.locate  # each caller's head made once; the function's tail is fixed
    heads = src.names["o_heads"] = _PerKey(
        lambda ip: f', "ip": {ip}, "location": {dumps(locate(ip))}, "args": {{'
    )
    tail = f'}}, "return": true, "func": {dumps(returns.func)}, "func_ip": {returns.func_ip}}}'
    src.names["o_tail"] = tail
    template = _json_template(names, types, plain, src.names, _caller_place(heads), tail)
    line = '{o_start}{o_context}, "timestamp": {ts!r}{o_heads[ip]}' + args + "{o_tail}"
    return src.line(line.replace('"', '\\"'), head, template)


def _json_place(ip: int, location: str) -> str:
    return f', "ip": {ip}, "location": {json.dumps(location)}, "args": {{'


def _json_template(
    names: Sequence[str],
    types: Sequence[str],
    plain: Sequence[bool],
    columns: dict[str, Any],
    place: Place,
    tail: str,
) -> LineTemplate | None:
    """``json_line``'s line as a template (``place`` the text from the ip to the arguments,
    ``tail`` the text after them); None unless every value is a plain int."""
    show: dict[str, Callable[[Any], str]] = {"ts": float.__repr__}
    for i, (t, p) in enumerate(zip(types, plain, strict=True)):
        if not p or parse_type(t).kind not in (Kind.UNSIGNED, Kind.SIGNED, Kind.HEX):
            return None
        show[f"v{i}"] = int.__repr__
    keys = [f"{json.dumps(n)}: " for n in names]
    rest = _fields([f", {key}" for key in keys[1:]] + [tail + "\n"]) if names else ()
    first = keys[0] if names else tail + "\n"
    start, who, cpus = columns["o_start"], columns["o_who"], columns["o_cpus"]

    def line(tid: int, cpu: int, ip: int, location: str) -> tuple[str, ...]:
        head = f'{start}{who[tid]}{cpus[cpu]}, "timestamp": '
        return (head, "ts", place(ip, location) + first, *rest)

    return LineTemplate(line, show, None)
