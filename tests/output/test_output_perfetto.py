"""The Perfetto (Chrome JSON) trace, parsed back and checked for structure and durations."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from kprobes.errors import InternalError
from kprobes.model import Event, EventArg
from kprobes.output.perfetto import (
    PerfettoWriter,
    WriterState,
    entry_function,
    return_function,
)


def ev(
    t: float,
    tid: int,
    event: str,
    location: str,
    *args: EventArg,
    func: str = "",
    comm: str = "",
    pid: int = 100,
) -> Event:
    return Event(
        group="kp",
        event=event,
        pid=pid,
        tid=tid,
        comm=comm or {100: "app", 101: "worker"}.get(tid, "x"),
        cpu=0,
        timestamp=t,
        ip=0x401000,
        location=location,
        args=args,
        is_return=bool(func),
        func=func,
        func_ip=0x401000 if func else 0,
    )


# main calls foo(2), which recurses into foo(1); a worker thread enters foo and never returns.
EVENTS = [
    ev(1.000000, 100, "main_entry", "main+0x0/0x80", EventArg("argc", "u32", 1)),
    ev(1.000010, 100, "foo_entry", "foo+0x0/0x20", EventArg("n", "s32", 2)),
    ev(1.000020, 100, "foo_entry", "foo+0x0/0x20", EventArg("n", "s32", 1)),
    ev(1.000025, 100, "foo_mid", "foo+0x8/0x20", EventArg("p", "x64", 0xDEAD)),
    ev(1.000030, 100, "foo_ret", "foo+0x14/0x20", EventArg("ret", "s64", 1), func="foo"),
    ev(1.000040, 101, "foo_entry", "foo+0x0/0x20", EventArg("n", "s32", 7)),
    ev(1.000045, 101, "bar_ret", "foo+0x4/0x20", func="bar"),
    ev(1.000050, 100, "foo_ret", "main+0x10/0x80", EventArg("ret", "s64", 2), func="foo"),
    ev(1.000060, 100, "baz_entry", "baz+0x0/0x10"),
    ev(1.000070, 100, "foo_mid", "foo+0x8/0x20", comm="renamed"),
]


def run(events: list[Event], **kwargs: Any) -> tuple[dict[str, Any], PerfettoWriter]:
    out = io.StringIO()
    with PerfettoWriter(out, **kwargs) as writer:
        for e in events:
            writer.write(e)
    return json.loads(out.getvalue()), writer


def of_phase(doc: dict[str, Any], ph: str) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == ph]


def test_document_shape_and_metadata() -> None:
    doc, writer = run(EVENTS)
    assert doc["displayTimeUnit"] == "ns"
    assert writer.state is WriterState.CLOSED
    meta = {(e["name"], e["pid"], e["tid"], e["args"]["name"]) for e in of_phase(doc, "M")}
    assert meta == {
        ("process_name", 100, 100, "app"),
        ("thread_name", 100, 100, "app"),
        ("thread_name", 100, 101, "worker"),
        ("thread_name", 100, 100, "renamed"),  # a comm change is announced again
    }
    for e in doc["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= e.keys()


def test_entry_and_return_pairs_become_slices_with_their_durations() -> None:
    doc, writer = run(EVENTS)
    slices = {(e["tid"], e["ts"]): e for e in of_phase(doc, "X")}
    assert {k: (e["name"], e["dur"]) for k, e in slices.items()} == {
        (100, 1000020.0): ("foo", 10.0),  # the inner call returns first
        (100, 1000010.0): ("foo", 40.0),
        (101, 1000040.0): ("foo", 30.0),  # never returned: ends at the last timestamp
    }
    inner = slices[(100, 1000020.0)]
    assert inner["cat"] == "kp"
    assert inner["args"]["entry"] == {
        "event": "kp/foo_entry",
        "location": "foo+0x0/0x20",
        "args": {"n": 1},
    }
    assert inner["args"]["return"] == {
        "event": "kp/foo_ret",
        "location": "foo+0x14/0x20",
        "args": {"ret": 1},
        "func": "foo",
    }
    unfinished = slices[(101, 1000040.0)]
    assert unfinished["args"]["unfinished"] is True and "return" not in unfinished["args"]
    assert (writer.slices, writer.unfinished) == (3, 1)


def test_everything_unpaired_is_a_thread_instant() -> None:
    doc, writer = run(EVENTS)
    instants = sorted((e["ts"], e["tid"], e["name"]) for e in of_phase(doc, "i"))
    assert instants == [
        (1000000.0, 100, "main_entry"),  # main never returns, nor is seen returning
        (1000025.0, 100, "foo_mid"),  # not at a function's start
        (1000045.0, 101, "bar_ret"),  # a return with no entry
        (1000060.0, 100, "baz_entry"),
        (1000070.0, 100, "foo_mid"),
    ]
    assert all(e["s"] == "t" for e in of_phase(doc, "i"))
    mid = next(e for e in of_phase(doc, "i") if e["ts"] == 1000025.0)
    assert mid["args"] == {
        "event": "kp/foo_mid",
        "location": "foo+0x8/0x20",
        "args": {"p": "0xdead"},
    }
    assert writer.instants == 5


def test_declared_return_functions_stream_other_entries_at_once() -> None:
    out = io.StringIO()
    writer = PerfettoWriter(out, return_funcs={"foo"})
    for e in EVENTS[:4]:
        writer.write(e)
    # main is not declared: written immediately; the two foo calls are the only open calls.
    assert writer.open_calls == 2
    assert '"main_entry"' in out.getvalue()
    for e in EVENTS[4:]:
        writer.write(e)
    writer.close()
    doc = json.loads(out.getvalue())
    assert len(of_phase(doc, "X")) == 3


def test_slices_are_written_as_calls_return() -> None:
    out = io.StringIO()
    writer = PerfettoWriter(out)
    for e in EVENTS[:5]:
        writer.write(e)
    assert out.getvalue().startswith('{"traceEvents": [\n')
    assert out.getvalue().count('"ph": "X"') == 1
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(InternalError):
        writer.write(EVENTS[5])


def test_empty_trace_is_valid() -> None:
    doc, _ = run([])
    assert doc == {"traceEvents": [], "displayTimeUnit": "ns"}


def test_function_names_for_pairing() -> None:
    assert entry_function(EVENTS[0]) == "main"
    assert entry_function(EVENTS[3]) is None
    assert entry_function(ev(0, 1, "e", "ext4_sync_file+0x0/0x40 [ext4]")) == "ext4_sync_file"
    assert entry_function(ev(0, 1, "e", "operator+(A, B)+0x0/0x10")) == "operator+(A, B)"
    assert entry_function(ev(0, 1, "e", "0x401136")) == "0x401136"
    assert entry_function(ev(0, 1, "e", "")) == "0x401000"
    assert entry_function(EVENTS[4]) is None
    assert return_function(ev(0, 1, "r", "x+0x4/0x8", func="ext4_sync_file [ext4]")) == (
        "ext4_sync_file"
    )
