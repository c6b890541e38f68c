"""Ring-buffer pages to ``Event`` values in one pass: the kernel targets' hot path.

``ringbuffer.scan_page`` and ``eventformat.compile_decoder`` say what a page and a record hold
one plain step at a time (a list of record positions, then a tuple of values per record, then
an ``Event``); they stay as the reference the tests hold this module to. Done that way, an
event cost ~10 µs of Python, twenty times what the kernel spends on a uprobe hit. Here the
same work is one loop per page and one call per record:

* ``decode_pages`` walks each page's record headers (the layouts are in ``ringbuffer``'s
  docstring), reads a data record's ``common_type`` in the same unpack as its header, and
  hands the record to the builder of its event (or to a watcher, for other events of the
  instance, such as ``task_newtask``);
* a **builder** is compiled per registered event from its format file: one ``struct`` unpack
  of exactly the fields it needs, string and array conversions inline, and the ``Event`` and
  its ``EventArg`` named tuples made directly with ``tuple.__new__``.

For a uprobe with ``n=%di:s64 s=+0(%si):string`` the builder reads::

    def build(page, start, ts, cpu):
        tid, ip, a0, a1, = unpack(page, start)      # struct "<4xiQqI"
        func_ip = 0
        who = who_get(tid)                          # (pid, comm), False, or None: not known yet
        if not who:
            ...                                     # who_miss(tid); False: drop the event
        n = a1 >> 16                                # the string's __data_loc word
        if n:
            ...                                     # a1 = page[...].decode(...)
        else:
            a1 = None                               # the kernel's (fault)
        comm = who[1]
        return new(Event, (group, event, who[0], tid, comm, cpu, ts / 1e9, ip, location,
                           (new(EventArg, (n0, t0, a0)), new(EventArg, (n1, t1, a1)), ),
                           False, func, func_ip, 0.0, None, None, None))

Builders are generated Python source, as ``collections.namedtuple`` and ``dataclasses`` make
their ``__new__`` and ``__init__``. Only names chosen here and integer offsets are written into
the source; everything that comes from the kernel's format file or the registration (argument
names and types, the event's name and place) enters through the function's namespace. Rejected:
a generic builder calling one closure per argument, which measured 25% slower per event on the
same pages (docs/decisions.md has the figures).

The cyclic garbage collector is paused while a batch is decoded. Each event is a few new
tuples and no cycles, so the collections it would trigger only re-examine the growing batch
again and again (on 4,000 pages they cost more than the decoding itself); the new objects are
examined once, when it resumes.
"""

from __future__ import annotations

import gc
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Final, Literal

from kprobes.model import Event, EventArg
from kprobes.tracefs.eventformat import PROBE_FIELDS, EventFormat, Field, record_struct
from kprobes.tracefs.ringbuffer import (
    COMMIT_MASK,
    MISSED_EVENTS,
    MISSED_STORED,
    PADDING,
    TIME_EXTEND,
    PageLayout,
)
from kprobes.values import dataclass

# A record's builder: (page, start of the record's data, timestamp ns, cpu) → its Event, or
# None when the event's thread is not one the target keeps.
Builder = Callable[[bytes, int, int, int], Event | None]
# A handler for the records of another event enabled in the instance: (page, start).
Watcher = Callable[[bytes, int], None]
# Who a thread is, as events show it: (pid, comm); False = a thread whose events are dropped.
Who = tuple[int, str]
WhoEntry = Who | Literal[False]

_HEADER_AND_TYPE = struct.Struct("<IH").unpack_from  # a record header and its common_type
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_TS_MSB: Final = 0xF << 59
_BY_TIME = attrgetter("timestamp")


@dataclass(frozen=True, slots=True)
class EventPlan:
    """What one registered event's builder puts in every ``Event`` besides the record."""

    group: str
    event: str
    location: str  # entry probes: the probed place; return probes look the return address up
    is_return: bool
    func: str  # return probes: the function that returned
    arg_names: tuple[str, ...]
    arg_types: tuple[str, ...]
    comm_index: int = -1  # the argument that fetched $comm (the event's comm), or -1


@dataclass(frozen=True, slots=True)
class Lookups:
    """The target's caches a builder reads, and the slow paths it calls when they miss."""

    who: dict[int, WhoEntry]  # thread id → who it is (filled by who_miss)
    who_miss: Callable[[int], WhoEntry]
    places: dict[int, str]  # return address → "sym+off/size" (filled by place_miss)
    # (address, tid, the probed function's address, event) → "sym+off/size"
    place_miss: Callable[[int, int, int, str], str]
    symbolize: Callable[[int], str] | None = None  # for %pS arguments; None: keep the number


def _string_lines(var: str, word: str, rel_base: int | None, indent: str) -> list[str]:
    """Source turning the __data_loc/__rel_loc ``word`` into a str (None for "(fault)")."""
    base = f" + {rel_base}" if rel_base is not None else ""
    return [
        f"{indent}n = {word} >> 16",
        f"{indent}if n:",
        f"{indent}    b = start{base} + ({word} & 0xFFFF)",
        # The kernel stores the string with its NUL, counted in the length; a NUL before it
        # (never written by the kernel's string fetches) still ends the string.
        f"{indent}    raw = page[b : b + n - 1]",
        f"{indent}    if 0 in raw:",
        f"{indent}        raw = raw[: raw.index(0)]",
        f"{indent}    {var} = raw.decode('utf-8', 'replace')",
        f"{indent}else:",
        f"{indent}    {var} = None",
    ]


def builder_source(
    fmt: EventFormat, plan: EventPlan, *, symbolize: bool = False
) -> tuple[str, str]:
    """The source of ``fmt``'s builder, and the ``struct`` format it unpacks with.

    Apart from ``build``'s own locals the source names only: ``unpack``, ``new``, ``Event``,
    ``EventArg``, ``who_get``, ``who_miss``, ``place_get``, ``place_miss``, ``symbolize``,
    ``group``, ``event``, ``location``, ``func`` and ``nK``/``tK`` (argument K's name and type),
    all bound in ``compile_builder``.
    """
    arg_fields = fmt.arg_fields
    if len(arg_fields) != len(plan.arg_names):
        raise ValueError(f"{fmt.name}: {len(arg_fields)} argument fields, {plan.arg_names}")
    wanted_names = {"common_pid", *PROBE_FIELDS, *(f.name for f in arg_fields)}

    def wanted(f: Field) -> bool:
        return f.name in wanted_names

    layout, slots = record_struct(fmt, wanted)
    if "common_pid" not in slots:
        raise ValueError(f"{fmt.name}: the format has no common_pid")
    ip_field = "__probe_ret_ip" if "__probe_ret_ip" in slots else "__probe_ip"
    lines = ["def build(page, start, ts, cpu):"]
    unpacked = ", ".join(_unpacked_names(arg_fields, slots, ip_field))
    lines.append(f"    {unpacked}, = unpack(page, start)")
    if ip_field not in slots:
        lines.append("    ip = 0")
    if "__probe_func" not in slots:
        lines.append("    func_ip = 0")
    lines += [
        "    who = who_get(tid)",
        "    if not who:",
        "        if who is None:",
        "            who = who_miss(tid)",
        "        if not who:",
        "            return None",
    ]
    lines += _argument_lines(arg_fields, plan.arg_types, slots, symbolize)
    lines += _event_lines(plan, len(arg_fields))
    return "\n".join(lines) + "\n", layout


def _unpacked_names(
    arg_fields: Sequence[Field], slots: Mapping[str, slice], ip_field: str
) -> list[str]:
    """The names the unpacked values are given, in struct order ("" for one not used)."""
    targets = [""] * sum(s.stop - s.start for s in slots.values())
    targets[slots["common_pid"].start] = "tid"
    if ip_field in slots:
        targets[slots[ip_field].start] = "ip"
    if "__probe_func" in slots:
        targets[slots["__probe_func"].start] = "func_ip"
    for k, f in enumerate(arg_fields):
        where = slots.get(f.name)
        if where is None:
            continue
        if f.count:
            for j in range(where.stop - where.start):
                targets[where.start + j] = f"a{k}_{j}"
        else:
            targets[where.start] = f"a{k}"
    return targets


def _argument_lines(
    arg_fields: Sequence[Field],
    arg_types: Sequence[str],
    slots: Mapping[str, slice],
    symbolize: bool,
) -> list[str]:
    """Source turning each argument's unpacked value(s) into its value, as ``aK``."""
    lines: list[str] = []
    for k, (f, typ) in enumerate(zip(arg_fields, arg_types, strict=True)):
        var = f"a{k}"
        where = slots.get(f.name)
        if where is None:
            lines.append(f"    {var} = None")  # a field struct cannot read
        elif f.loc:
            relative = f.loc == "rel_loc"
            count = where.stop - where.start
            words = [f"{var}_{j}" for j in range(count)] if f.count else [var]
            for j, word in enumerate(words):
                rel_base = f.offset + 4 * j + 4 if relative else None
                lines += _string_lines(word, word, rel_base, "    ")
            if f.count:
                lines.append(f"    {var} = ({', '.join(words)},)")
        elif f.count:
            items = ", ".join(f"{var}_{j}" for j in range(where.stop - where.start))
            lines.append(f"    {var} = ({items},)")
        elif typ == "symbol" and symbolize:
            lines.append(f"    {var} = symbolize({var})")
    return lines


def _event_lines(plan: EventPlan, arg_count: int) -> list[str]:
    """Source making the ``Event``: a return probe's location, the comm, then the value."""
    lines: list[str] = []
    if plan.is_return:
        lines += [
            "    location = place_get(ip)",
            "    if location is None:",
            "        location = place_miss(ip, tid, func_ip, event)",
        ]
    if plan.comm_index >= 0:
        comm_var = f"a{plan.comm_index}"
        lines.append(f"    comm = {comm_var} if {comm_var}.__class__ is str else who[1]")
    else:
        lines.append("    comm = who[1]")
    args = "".join(f"new(EventArg, (n{k}, t{k}, a{k})), " for k in range(arg_count))
    lines.append(
        "    return new(Event, (group, event, who[0], tid, comm, cpu, ts / 1e9, ip, location, "
        f"({args}), {plan.is_return}, func, func_ip, 0.0, None, None, None))"
    )
    return lines


def compile_builder(fmt: EventFormat, plan: EventPlan, lookups: Lookups) -> Builder:
    """The function that turns one of ``fmt``'s records into the ``Event`` ``plan`` describes."""
    source, layout = builder_source(fmt, plan, symbolize=lookups.symbolize is not None)
    namespace: dict[str, object] = {
        "unpack": struct.Struct(layout).unpack_from,
        "new": tuple.__new__,
        "Event": Event,
        "EventArg": EventArg,
        "who_get": lookups.who.get,
        "who_miss": lookups.who_miss,
        "place_get": lookups.places.get,
        "place_miss": lookups.place_miss,
        "symbolize": lookups.symbolize,
        "group": plan.group,
        "event": plan.event,
        "location": plan.location,
        "func": plan.func,
    }
    for k, (name, typ) in enumerate(zip(plan.arg_names, plan.arg_types, strict=True)):
        namespace[f"n{k}"] = name
        namespace[f"t{k}"] = typ
    code = compile(source, f"<builder {plan.group}/{plan.event}>", "exec")
    exec(code, namespace)
    build: Builder = namespace["build"]  # type: ignore[assignment]
    return build


def decode_pages(
    pages: Iterable[tuple[int, bytes]],
    layout: PageLayout,
    builders: dict[int, Builder],
    watchers: dict[int, Watcher] | None = None,
) -> tuple[list[Event], int]:
    """The events of ``pages`` ((cpu, page) as ``CpuBuffers.read_pages`` gives them), oldest
    first, and the count of events the kernel lost before them (-1 added per page that says
    it lost some but not how many).

    A record whose ``common_type`` has a builder becomes its event; one with a watcher is
    handed to it, in page order, before the records after it are decoded; others are skipped.
    """
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        events, lost, needs_merge = _walk_pages(pages, layout, builders, watchers or {})
        if needs_merge:
            # Each CPU's events are in order; merge them (a stable sort: ties keep page order).
            events.sort(key=_BY_TIME)
    finally:
        if collecting:
            gc.enable()
    return events, lost


def _walk_pages(
    pages: Iterable[tuple[int, bytes]],
    layout: PageLayout,
    builders: dict[int, Builder],
    watchers: dict[int, Watcher],
) -> tuple[list[Event], int, bool]:
    """``decode_pages``'s one pass: the events of each page in page order, the count lost,
    and whether they came from more than one CPU (then they are yet to be merged).

    The loop over a page's records is the hot path and stays inline, in this one function:
    a function call per record would be paid by every event. Only what a page rarely holds
    (a count of lost events, a time record) is handed to a function.
    """
    events: list[Event] = []
    append = events.append
    get_builder = builders.get
    get_watcher = watchers.get
    ts_at, commit_at, data_at = layout.timestamp_offset, layout.commit_offset, layout.data_offset
    read_commit = _U64 if layout.commit_size == 8 else _U32
    lost = 0
    cpus_seen = -1  # the one cpu with events so far; -2 once there are two
    for cpu, page in pages:
        before = len(events)
        ts = _U64(page, ts_at)[0]
        commit = read_commit(page, commit_at)[0]
        size = commit & COMMIT_MASK
        if commit & MISSED_EVENTS:
            lost += _missed(page, commit, data_at + size)
        end = min(data_at + size, len(page))
        if end + 2 > len(page):
            page += b"\0\0"  # a header is read with the two bytes after it
        last = end - 4  # the last place a record header can start
        pos = data_at
        while pos <= last:
            header, common_type = _HEADER_AND_TYPE(page, pos)
            type_len = header & 0x1F
            if 0 < type_len <= 28:  # data of type_len * 4 bytes
                ts += header >> 5
                start = pos + 4
                pos = start + (type_len << 2)
            elif type_len == 0:  # data with its length in the next word
                length = _U32(page, pos + 4)[0]
                if length < 4:
                    break  # corrupt; never produced by the kernel
                ts += header >> 5
                start = pos + 8
                pos += 4 + length
                common_type = page[start] | page[start + 1] << 8
            elif type_len == PADDING:
                if header >> 5 == 0:
                    break  # the rest of the page is padding
                pos += 4 + _U32(page, pos + 4)[0]
                continue
            else:  # TIME_EXTEND or TIME_STAMP: two words, no data
                ts = _time_record(page, pos, header, ts)
                pos += 8
                continue
            build = get_builder(common_type)
            if build is not None:
                event = build(page, start, ts, cpu)
                if event is not None:
                    append(event)
            else:
                watcher = get_watcher(common_type)
                if watcher is not None:
                    watcher(page, start)
        if len(events) > before and cpus_seen != cpu:
            cpus_seen = cpu if cpus_seen == -1 else -2
    return events, lost, cpus_seen == -2


def _missed(page: bytes, commit: int, data_end: int) -> int:
    """The count of events the kernel lost before a page whose commit word says it lost some:
    the count stored after the data, or -1 when there is none."""
    if commit & MISSED_STORED and data_end + 8 <= len(page):
        count: int = _U64(page, data_end)[0]
        return count
    return -1


def _time_record(page: bytes, pos: int, header: int, ts: int) -> int:
    """The time after the TIME_EXTEND (a delta) or TIME_STAMP (the absolute time) at ``pos``."""
    value: int = (_U32(page, pos + 4)[0] << 27) | header >> 5
    if header & 0x1F == TIME_EXTEND:
        return ts + value
    return value | (ts & _TS_MSB)
