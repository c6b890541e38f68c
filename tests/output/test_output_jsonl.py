"""JSON lines: one typed object per event, exact text and values."""

from __future__ import annotations

import json
import time

from kprobes.model import Event, EventArg
from kprobes.output.jsonl import event_to_json, format_json

ENTRY = Event(
    group="kp",
    event="open",
    pid=1000,
    tid=1001,
    comm="cat",
    cpu=2,
    timestamp=12.5,
    ip=0x401136,
    location="do_open+0x0/0x40",
    args=(
        EventArg("fd", "s32", 0xFFFFFFFF),
        EventArg("path", "string", "/etc/hosts"),
        EventArg("buf", "x8[3]", (1, None, 0x1FF)),
        EventArg("name", "string", None),
        EventArg("c", "char", 0x41),
    ),
)

RETURN = Event(
    group="kp",
    event="open_ret",
    pid=1000,
    tid=1001,
    comm="cat",
    cpu=-1,
    timestamp=12.75,
    ip=0x401250,
    location="main+0x20/0x80",
    args=(EventArg("ret", "u64", -1),),
    is_return=True,
    func="do_open",
    func_ip=0x401136,
)


def test_entry_event_as_one_line() -> None:
    assert format_json(ENTRY) == (
        '{"event": "kp/open", "pid": 1000, "tid": 1001, "comm": "cat", "cpu": 2,'
        ' "timestamp": 12.5, "ip": 4198710, "location": "do_open+0x0/0x40",'
        ' "args": {"fd": -1, "path": "/etc/hosts", "buf": [1, null, 255],'
        ' "name": null, "c": "A"}}'
    )


def test_return_event_carries_return_func_and_func_ip() -> None:
    obj = json.loads(format_json(RETURN))
    assert obj == {
        "event": "kp/open_ret",
        "pid": 1000,
        "tid": 1001,
        "comm": "cat",
        "cpu": None,
        "timestamp": 12.75,
        "ip": 0x401250,
        "location": "main+0x20/0x80",
        "args": {"ret": 2**64 - 1},
        "return": True,
        "func": "do_open",
        "func_ip": 0x401136,
    }


def test_entry_events_have_no_return_keys() -> None:
    obj = event_to_json(ENTRY)
    assert "return" not in obj and "func" not in obj


def test_one_line_even_with_newlines_and_non_ascii_in_strings() -> None:
    ev = Event(
        group="g",
        event="e",
        pid=1,
        tid=1,
        comm="x",
        cpu=0,
        timestamp=0.0,
        ip=0,
        location="f",
        args=(EventArg("s", "string", "a\nb\u00e9\udcff"),),
    )
    line = format_json(ev)
    assert "\n" not in line
    assert line.isascii()
    assert json.loads(line)["args"]["s"] == "a\nb\u00e9\udcff"


def test_wall_clock_adds_time_in_iso_8601_local_time(monkeypatch) -> None:
    # 12.5 s of the event clock is 2026-11-27 11:12:32.123456 UTC with this offset.
    offset = 1_795_777_952_123_456_000 - 12_500_000_000
    monkeypatch.setenv("TZ", "IST-5:30")
    time.tzset()
    try:
        obj = json.loads(format_json(ENTRY, wall_offset_ns=offset))
    finally:
        monkeypatch.undo()
        time.tzset()
    assert obj["time"] == "2026-11-27T16:42:32.123456+05:30"
    assert obj["timestamp"] == 12.5  # the event clock's seconds stay
    assert "time" not in event_to_json(ENTRY)
