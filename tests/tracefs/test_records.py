"""The one-pass decoder (``records.py``) held to the plain reference path: ``scan_page`` for the
page, ``compile_decoder`` for the record, ``Event(...)`` for the value. Pages captured from a
kernel, pages built here with every record type, records of every fetch type, and generated
ones (hypothesis)."""

from __future__ import annotations

import gc
import struct
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kprobes.model import Event, EventArg
from kprobes.tracefs.eventformat import EventFormat, compile_decoder
from kprobes.tracefs.records import (
    EventPlan,
    Lookups,
    WhoEntry,
    builder_source,
    compile_builder,
    decode_pages,
)
from kprobes.tracefs.ringbuffer import (
    MISSED_EVENTS,
    MISSED_STORED,
    PADDING,
    TIME_EXTEND,
    TIME_STAMP,
    PageLayout,
    scan_page,
)
from tracefs.captured import PAGE_HEX, TYPES_FORMAT, WORK_FORMAT, WORK_RET_FORMAT
from tracefs.synth import data_record, header, page, record, small

PAGE = bytes.fromhex(PAGE_HEX).ljust(4096, b"\0")
LAYOUT = PageLayout()
ENTRY, RETURN = EventFormat.parse(WORK_FORMAT), EventFormat.parse(WORK_RET_FORMAT)
TYPES = EventFormat.parse(TYPES_FORMAT)


class Threads:
    """The target's side of the lookups, counting its slow-path calls."""

    def __init__(self, who: Callable[[int], WhoEntry] = lambda tid: (tid + 10000, "prog")) -> None:
        self.who: dict[int, WhoEntry] = {}
        self.places: dict[int, str] = {}
        self.answer = who
        self.misses: list[int] = []
        self.place_misses: list[int] = []

    def who_miss(self, tid: int) -> WhoEntry:
        self.misses.append(tid)
        self.who[tid] = self.answer(tid)
        return self.who[tid]

    def place_miss(self, ip: int, tid: int, func_ip: int, event: str) -> str:
        self.place_misses.append(ip)
        self.places[ip] = f"caller+{ip & 0xFFF:#x}/0x1000"
        return self.places[ip]

    def lookups(self, symbolize: Callable[[int], str] | None = None) -> Lookups:
        return Lookups(self.who, self.who_miss, self.places, self.place_miss, symbolize)


def plan(fmt: EventFormat, *, comm_index: int = -1) -> EventPlan:
    return EventPlan(
        group="grp",
        event=fmt.name,
        location="" if fmt.is_return else "work+0x0/0x40",
        is_return=fmt.is_return,
        func="work" if fmt.is_return else "",
        arg_names=tuple(f.name for f in fmt.arg_fields),
        arg_types=fmt.arg_types,
        comm_index=comm_index,
    )


def reference(
    pages: list[tuple[int, bytes]],
    formats: list[EventFormat],
    threads: Threads,
    symbolize: Callable[[int], str] | None = None,
    **comm_index: int,
) -> list[Event]:
    """The events of ``pages`` the plain way, one step at a time."""
    by_id = {
        fmt.id: (
            plan(fmt, comm_index=comm_index.get(fmt.name, -1)),
            compile_decoder(fmt, symbolize),
        )
        for fmt in formats
    }
    timed: list[tuple[int, Event]] = []
    for cpu, data in pages:
        for ts, start, _end in scan_page(data).records:
            found = by_id.get(struct.unpack_from("<H", data, start)[0])
            if found is None:
                continue
            p, decode = found
            tid, ip, func_ip, values = decode(data, start)
            who = threads.answer(tid)
            if not who:
                continue
            pid, comm = who
            if p.comm_index >= 0 and isinstance(values[p.comm_index], str):
                comm = str(values[p.comm_index])
            location = f"caller+{ip & 0xFFF:#x}/0x1000" if p.is_return else p.location
            names, types = p.arg_names, p.arg_types
            args = tuple(EventArg(n, t, v) for n, t, v in zip(names, types, values, strict=True))
            event = Event(p.group, p.event, pid, tid, comm, cpu, ts / 1e9, ip, location, args,
                          p.is_return, p.func, func_ip)  # fmt: skip
            timed.append((ts, event))
    if len({cpu for cpu, _ in pages}) > 1:
        timed.sort(key=lambda te: te[0])
    return [event for _, event in timed]


def decode(
    pages: list[tuple[int, bytes]],
    formats: list[EventFormat],
    threads: Threads,
    symbolize: Callable[[int], str] | None = None,
    **comm_index: int,
) -> tuple[list[Event], int]:
    lookups = threads.lookups(symbolize)
    builders = {
        fmt.id: compile_builder(fmt, plan(fmt, comm_index=comm_index.get(fmt.name, -1)), lookups)
        for fmt in formats
    }
    return decode_pages(pages, LAYOUT, builders)


def test_captured_page_decodes_like_the_reference() -> None:
    threads = Threads()
    events, lost = decode([(1, PAGE)], [ENTRY, RETURN], threads)
    assert lost == 0
    assert events == reference([(1, PAGE)], [ENTRY, RETURN], Threads())
    work, caller = 0x556234A27179, 0x556234A27221
    assert [(e.event, e.ip, e.func_ip, e.is_return) for e in events] == [
        ("work", work, 0, False),
        ("work_ret", caller, work, True),
    ] * 2
    assert events[0].args == (
        EventArg("x", "s64", 0),
        EventArg("s", "string", "hello world"),
        EventArg("arr", "u32[2]", (7, 0)),
        EventArg("arg4", "string", "prog"),
    )
    assert events[1].location == "caller+0x221/0x1000" and events[1].func == "work"
    assert (events[0].pid, events[0].tid, events[0].comm) == (2219 + 10000, 2219, "prog")
    # Each thread and each return address is looked up once, then cached.
    assert threads.misses == [2219] and threads.place_misses == [caller]


def test_a_fetched_comm_is_the_events_comm() -> None:
    def threads() -> Threads:
        return Threads(who=lambda tid: (tid, "saved_cmdlines"))

    events, _ = decode([(0, PAGE)], [ENTRY], threads(), work=3)  # arg4 fetched $comm
    assert [e.comm for e in events] == ["prog", "prog"]
    assert events == reference([(0, PAGE)], [ENTRY], threads(), work=3)


def test_every_fetch_type_like_the_reference() -> None:
    values = {
        "common_type": TYPES.id, "common_pid": 4242, "__probe_ip": 0x55550000A000,
        "a": 200, "b": -3, "c": 0xDEADBEEF, "d": 1 << 60, "f": (1, 2, 3), "h": 5,
        "j": ord("Q"), "m": (7, 8), "arg13": 13, "arg14": 14, "n": -(1 << 40),
    }  # fmt: skip
    strings = {"e": "hello", "g": ["one", None], "i": "prög ✓", "l": ""}
    data = page(1000, data_record(5, record(TYPES, values, strings)))
    events, _ = decode([(0, data)], [TYPES], Threads())
    assert events == reference([(0, data)], [TYPES], Threads())
    assert [a.value for a in events[0].args] == [
        200, -3, 0xDEADBEEF, 1 << 60, "hello", (1, 2, 3), ("one", None), 5, "prög ✓",
        ord("Q"), "", (7, 8), 13, 14, -(1 << 40),
    ]  # fmt: skip
    assert events[0].timestamp == 1005 / 1e9


def test_rel_loc_strings_and_symbols() -> None:
    fmt = EventFormat.parse(
        WORK_FORMAT.replace("__data_loc char[] s;", "__rel_loc char[] s;").replace("x=%Ld", "x=%pS")
    )
    assert fmt.arg_types[0] == "symbol"
    body = bytearray(40 + 6)
    struct.pack_into("<HBBiQq", body, 0, fmt.id, 0, 0, 1, 0, 0x1234)
    struct.pack_into("<I", body, 24, (6 << 16) | (40 - 28))  # from the end of the word at 24
    body[40:46] = b"hello\0"
    data = page(0, data_record(1, bytes(body)))
    for symbolize in (None, lambda a: f"sym+{a:#x}"):
        events, _ = decode([(0, data)], [fmt], Threads(), symbolize)
        assert events == reference([(0, data)], [fmt], Threads(), symbolize)
        assert events[0].arg("x") == (0x1234 if symbolize is None else "sym+0x1234")
        assert events[0].arg("s") == "hello" and events[0].arg("arg4") is None


def test_a_nul_inside_a_string_ends_it() -> None:
    body = bytearray(record(ENTRY, {"common_type": ENTRY.id, "common_pid": 1}, {"s": "ab"}))
    word = struct.unpack_from("<I", body, 24)[0]
    body[word & 0xFFFF : (word & 0xFFFF) + 3] = b"a\0b"  # as if the kernel copied "a\0b\0"
    data = page(0, data_record(1, bytes(body)))
    (event,) = decode([(0, data)], [ENTRY], Threads())[0]
    assert event.arg("s") == "a" == reference([(0, data)], [ENTRY], Threads())[0].arg("s")


def entry_record(x: int, pid: int = 7) -> bytes:
    return record(ENTRY, {"common_type": ENTRY.id, "common_pid": pid, "x": x}, {"s": "s"})


def test_every_record_type_of_a_page() -> None:
    extend = (3 << 27) | 12345
    stamp = (5 << 27) | 99
    long_string = "L" * 200  # a record over 112 bytes: its length in a word of its own
    big = record(ENTRY, {"common_type": ENTRY.id, "common_pid": 7, "x": 3}, {"s": long_string})
    body = (
        data_record(10, entry_record(1))
        + header(TIME_EXTEND, extend & ((1 << 27) - 1)) + struct.pack("<I", extend >> 27)
        + data_record(2, entry_record(2))
        + header(PADDING, 50) + struct.pack("<I", 16) + b"\0" * 12  # a discarded event
        + data_record(1, big)
        + small(4, struct.pack("<HHi", 9999, 0, 7))  # another event's record: skipped
        + header(TIME_STAMP, stamp & ((1 << 27) - 1)) + struct.pack("<I", stamp >> 27)
        + data_record(3, entry_record(4))
        + header(PADDING, 0)  # the rest of the page is padding
        + data_record(3, entry_record(5))
    )  # fmt: skip
    data = page(1000, body)
    events, lost = decode([(0, data)], [ENTRY], Threads())
    assert events == reference([(0, data)], [ENTRY], Threads())
    assert [e.arg("x") for e in events] == [1, 2, 3, 4]
    assert events[2].arg("s") == long_string
    assert [round(e.timestamp * 1e9) for e in events] == [
        1010, 1012 + extend, 1013 + extend, stamp + 3,
    ]  # fmt: skip
    assert lost == 0


def test_lost_events_with_and_without_a_count() -> None:
    body = data_record(1, entry_record(1))
    counted = page(0, body, flags=MISSED_EVENTS | MISSED_STORED, tail=struct.pack("<Q", 42))
    uncounted = page(0, body, flags=MISSED_EVENTS)
    events, lost = decode([(0, counted), (0, uncounted), (0, page(0, body))], [ENTRY], Threads())
    assert lost == 42 - 1 and len(events) == 3


def test_a_page_committed_to_its_last_byte() -> None:
    # A header and a record's type are read together: two bytes past a header that ends the
    # page's data.
    body = b"".join(data_record(1, entry_record(i)) for i in range(84))
    body += data_record(1, struct.pack("<HHi", 9999, 0, 1) + b"\1" * 32) + header(PADDING, 0)
    assert len(body) == 4080
    data = page(0, body)
    events, _ = decode([(0, data)], [ENTRY], Threads())
    assert events == reference([(0, data)], [ENTRY], Threads())
    assert len(events) == 84


def test_cpus_are_merged_by_time_and_ties_keep_page_order() -> None:
    cpu0 = page(100, data_record(0, entry_record(0)) + data_record(10, entry_record(2)))
    cpu1 = page(105, data_record(0, entry_record(1)) + data_record(5, entry_record(3)))
    pages = [(0, cpu0), (1, cpu1)]
    events, _ = decode(pages, [ENTRY], Threads())
    assert events == reference(pages, [ENTRY], Threads())
    assert [(e.arg("x"), e.cpu) for e in events] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    # 110 on both CPUs: cpu0's page came first.


def test_threads_not_kept_are_dropped_and_asked_once() -> None:
    records = [data_record(1, entry_record(i, pid=100 + i % 2)) for i in range(6)]
    threads = Threads(who=lambda tid: (tid, "keep") if tid == 100 else False)
    events, _ = decode([(0, page(0, b"".join(records)))], [ENTRY], threads)
    assert [e.arg("x") for e in events] == [0, 2, 4]
    assert threads.misses == [100, 101]


def test_watchers_see_their_records_in_page_order() -> None:
    seen: list[tuple[int, int]] = []
    announce = small(1, struct.pack("<HHii", 77, 0, 5, 555))  # common_type 77, child 555
    body = data_record(1, entry_record(1, pid=555)) + announce
    body += data_record(1, entry_record(2, pid=555))
    threads = Threads()
    builders = {ENTRY.id: compile_builder(ENTRY, plan(ENTRY), threads.lookups())}

    def watcher(data: bytes, start: int) -> None:
        seen.append(struct.unpack_from("<ii", data, start + 4))
        threads.who[555] = (555, "renamed")

    events, _ = decode_pages([(0, page(0, body))], LAYOUT, builders, {77: watcher})
    assert seen == [(5, 555)]
    assert [(e.arg("x"), e.pid, e.comm) for e in events] == [
        (1, 10555, "prog"),
        (2, 555, "renamed"),
    ]


def test_the_collector_is_paused_only_while_decoding() -> None:
    data = page(0, data_record(1, entry_record(1)))
    assert gc.isenabled()
    paused = []
    threads = Threads(who=lambda tid: paused.append(gc.isenabled()) or (tid, "p"))
    decode([(0, data)], [ENTRY], threads)
    assert paused == [False] and gc.isenabled()
    truncated = data[:40]  # a record cut short: struct fails inside the builder
    with pytest.raises(struct.error):
        decode([(0, truncated + b"\0" * 4)], [ENTRY], Threads())
    assert gc.isenabled()
    gc.disable()
    try:
        decode([(0, data)], [ENTRY], Threads())
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_names_from_the_format_never_become_source() -> None:
    # Argument names that are Python keywords or the builder's own names still decode.
    fmt = EventFormat.parse(
        WORK_FORMAT.replace(" x;", " lambda;").replace("x=%Ld", "lambda=%Ld")
        .replace(" s;", " page;").replace("s=", "page=")
        .replace(" arr[];", " who[];").replace("arr=", "who=")
    )  # fmt: skip
    assert [f.name for f in fmt.arg_fields] == ["lambda", "page", "who", "arg4"]
    source, _ = builder_source(fmt, plan(fmt))
    assert "lambda" not in source and "who[]" not in source
    values = {"common_type": fmt.id, "common_pid": 3, "lambda": 5, "who": (1, 2)}
    data = page(0, data_record(1, record(fmt, values, {"page": "p", "arg4": "q"})))
    (event,) = decode([(0, data)], [fmt], Threads())[0]
    assert [(a.name, a.value) for a in event.args] == [
        ("lambda", 5), ("page", "p"), ("who", (1, 2)), ("arg4", "q"),
    ]  # fmt: skip


# -- generated pages -----------------------------------------------------------------------------

_texts = st.one_of(st.none(), st.text(max_size=40))
_entries = st.fixed_dictionaries(
    {
        "pid": st.integers(1, 2**31 - 1),
        "x": st.integers(-(2**63), 2**63 - 1),
        "s": _texts,
        "arr": st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
        "arg4": _texts,
    }
)
_kinds = st.one_of(
    st.tuples(st.just("entry"), st.integers(0, 2**27 - 1), _entries),
    st.tuples(st.just("extend"), st.integers(0, 2**40), st.none()),
    st.tuples(st.just("pad"), st.integers(1, 2**27 - 1), st.integers(0, 30)),
    st.tuples(st.just("other"), st.integers(0, 2**27 - 1), st.integers(0, 100)),
)


def _pieces(items: list[tuple[str, int, object]]) -> Iterator[bytes]:
    for kind, delta, extra in items:
        if kind == "entry":
            assert isinstance(extra, dict)
            values = {"common_type": ENTRY.id, "common_pid": extra["pid"], "x": extra["x"]}
            values["arr"] = extra["arr"]
            yield data_record(
                delta, record(ENTRY, values, {"s": extra["s"], "arg4": extra["arg4"]})
            )
        elif kind == "extend":
            yield header(TIME_EXTEND, delta & ((1 << 27) - 1)) + struct.pack("<I", delta >> 27)
        elif kind == "pad":
            assert isinstance(extra, int)
            yield header(PADDING, delta) + struct.pack("<I", 4 + 4 * extra) + b"\0" * 4 * extra
        else:
            assert isinstance(extra, int)
            yield data_record(delta, struct.pack("<HHi", 9999, 0, 1) + b"\1" * extra)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_kinds, max_size=25), min_size=1, max_size=3), st.integers(0, 2**50))
def test_generated_pages_decode_like_the_reference(
    cpus: list[list[tuple[str, int, object]]], start: int
) -> None:
    pages = []
    for cpu, items in enumerate(cpus):
        body = b""
        for piece in _pieces(items):
            if len(body) + len(piece) <= 4080:
                body += piece
        pages.append((cpu, page(start, body)))
    events, _ = decode(pages, [ENTRY], Threads())
    assert events == reference(pages, [ENTRY], Threads())
