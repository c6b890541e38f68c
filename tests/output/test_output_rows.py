"""output/rows.py: a probe's line compiled from its layout gives, for any values, the bytes
``format_event`` and ``format_json`` give for the same events (the fast reader's output is
held to the per-event formatters here, without a process; tests/test_trace_rows.py holds
it to them on a live program's records)."""

from __future__ import annotations

import random

import pytest

from kprobes.model import Event, EventArg
from kprobes.output.jsonl import format_json
from kprobes.output.rows import ReturnHead, compile_rows, json_line, text_line
from kprobes.output.text import format_event

NAMES = ("a", "b", "c", "d", "s", "arr", "f")
TYPES = ("x64", "u32", "s16", "char", "string", "u8[3]", "x8")
PLAIN = (True, True, True, True, False, False, False)
COMMS = {1: "target", 2: "", 3: 'we"ird\\ é', 4: "{x}"}


def _value(rng: random.Random, i: int) -> object:
    match TYPES[i]:
        case "x64":
            return rng.getrandbits(64)
        case "u32":
            return rng.getrandbits(32)
        case "s16":
            return rng.randrange(-(1 << 15), 1 << 15)
        case "char":
            return rng.randrange(256)
        case "string":
            return rng.choice([None, "", "hello", 'a "q" {b}', "é\n"])
        case "u8[3]":
            return rng.choice([None, (1, None, 3), (0, 255, 7)])
        case _:
            return rng.choice([None, 0, 255])


def _timestamp(rng: random.Random) -> float:
    secs = rng.choice([0, 1, 9, 83254, 99999, 123456])
    frac = rng.choice([0.0, 0.0000005, 0.9999995, 0.9999994999, 0.5, rng.random()])
    return secs + frac


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_rows_print_as_the_per_event_formatters_print(as_json: bool) -> None:
    rng = random.Random(3)
    comm = COMMS.__getitem__
    if as_json:
        line = json_line("grp/ev_1", 42, NAMES, TYPES, PLAIN, comm)
        assert line is not None
    else:
        line = text_line("ev_1", NAMES, TYPES, PLAIN, comm)
    fmt = compile_rows(line, len(NAMES))
    rows = []
    for _ in range(3000):
        ts = _timestamp(rng)
        rows.append(
            (
                rng.choice(list(COMMS)),
                rng.choice([0, 1, 17, -1]),
                ts,
                *(_value(rng, i) for i in range(len(NAMES))),
            )
        )
    rows.sort(key=lambda r: r[2])  # mostly in time order, as a ring's records are
    for ip, location in ((0x401000, "work+0x0/0x19"), (0x401000, "")):
        got = fmt(rows, ip, location)
        want = []
        for tid, cpu, ts, *values in rows:
            args = tuple(EventArg(n, t, v) for n, t, v in zip(NAMES, TYPES, values, strict=True))
            ev = Event("grp", "ev_1", 42, tid, comm(tid), cpu, ts, ip, location, args)  # type: ignore[arg-type]
            want.append((format_json(ev) if as_json else format_event(ev)) + "\n")
        assert got == "".join(want)


def test_two_arguments_of_one_name_are_left_to_the_per_event_path() -> None:
    assert json_line("g/e", 1, ("a", "a"), ("u8", "u8"), (True, True), str) is None


CALLERS = {0x401234: "main+0x34/0x80", 0x401300: "", 0x7F0000001000: 'we"ird+0x0/0x1'}


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("func", ["rec", ""], ids=["named", "unnamed"])
def test_rows_of_returns_print_as_the_per_event_formatters_print(as_json: bool, func: str) -> None:
    """Records of returns: each event's place is its own caller (``(caller <- func)``, and
    in JSON ``"return"``, ``"func"``, ``"func_ip"``)."""
    rng = random.Random(5)
    comm = COMMS.__getitem__
    returns = ReturnHead(func, 0x401100, CALLERS.__getitem__)
    if as_json:
        line = json_line("grp/ev_1", 42, NAMES, TYPES, PLAIN, comm, returns)
        assert line is not None
    else:
        line = text_line("ev_1", NAMES, TYPES, PLAIN, comm, returns)
    fmt = compile_rows(line, len(NAMES), each_ip=True)
    rows = [
        (
            rng.choice(list(COMMS)),
            rng.choice([0, 1, -1]),
            _timestamp(rng),
            rng.choice(list(CALLERS)),
            *(_value(rng, i) for i in range(len(NAMES))),
        )
        for _ in range(2000)
    ]
    got = fmt(rows, 0x401100, "rec+0x0/0x2e")
    want = []
    for tid, cpu, ts, ip, *values in rows:
        args = tuple(EventArg(n, t, v) for n, t, v in zip(NAMES, TYPES, values, strict=True))
        ev = Event(
            "grp", "ev_1", 42, tid, comm(tid), cpu, ts, ip, CALLERS[ip], args,  # type: ignore[arg-type]
            is_return=True, func=func, func_ip=0x401100, entry_timestamp=ts - 1e-6,
        )  # fmt: skip
        want.append((format_json(ev) if as_json else format_event(ev)) + "\n")
    assert got == "".join(want)
