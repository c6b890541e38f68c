"""A probe's own line, printf style (output/printf.py): C's conversions, checked against the
``printf`` of coreutils where it has them, and every fault of a format at its column."""

from __future__ import annotations

import subprocess

import pytest

from kprobes.errors import SpecError
from kprobes.model import Event, EventArg
from kprobes.output.printf import bind_printf, parse_printf


def event(*args: EventArg, **fields: object) -> Event:
    base: dict[str, object] = {
        "group": "kprobes",
        "event": "p_work_0",
        "pid": 41,
        "tid": 42,
        "comm": "prog",
        "cpu": 1,
        "timestamp": 12.5,
        "ip": 0x1000,
        "location": "work+0x0/0x20",
        "args": args,
    }
    base.update(fields)
    return Event(**base)  # type: ignore[arg-type]


def line(fmt: str, names: list[str], ev: Event) -> str:
    """``fmt`` over ``names`` of ``ev``, its arguments typed as the event says."""
    text = f'"{fmt}", ' + ", ".join(names)
    fields = [(a.name, int(a.type[1:]) if a.type[1:].isdigit() else None) for a in ev.args]
    return bind_printf(parse_printf(text), fields, text)(ev)


def coreutils(fmt: str, *values: object) -> str:
    out = subprocess.run(
        ["/usr/bin/printf", fmt, *map(str, values)], capture_output=True, text=True, check=True
    )
    return out.stdout


@pytest.mark.parametrize(
    "fmt",
    [
        "[%d]",
        "[%5d]",
        "[%-5d|]",
        "[%05d]",
        "[%+d]",
        "[% d]",
        "[%.4d]",
        "[%x]",
        "[%X]",
        "[%o]",
        "[%#x]",  # Python's % writes 0x0 for 0 and 0o10 for 8: C does not
        "[%#06x]",
        "[%#-8X|]",
        "[%#.4x]",
        "[%#o]",
        "[%#6o]",
    ],
)
def test_integer_conversions_are_cs(fmt: str) -> None:
    for value in (0, 8, 42, 255):
        ev = event(EventArg("v", "u64", value))
        assert line(fmt, ["v"], ev) == coreutils(fmt, value)


def test_strings_widths_and_precision() -> None:
    ev = event(EventArg("s", "string", "hello"))
    for fmt in ("[%s]", "[%8s]", "[%-8s]", "[%.3s]"):
        assert line(fmt, ["s"], ev) == coreutils(fmt, "hello")


def test_integers_take_the_fetch_types_width_or_the_lengths() -> None:
    ev = event(EventArg("v", "s32", -1))
    assert line("%d %u %x", ["v"] * 3, ev) == "-1 4294967295 ffffffff"  # an int's, as C
    assert line("%hhx %hd %lx", ["v"] * 3, ev) == "ff -1 ffffffffffffffff"
    big = event(EventArg("v", "u64", 2**64 - 2))
    assert line("%d %lu %p", ["v"] * 3, big) == "-2 18446744073709551614 0xfffffffffffffffe"


def test_common_fields_chars_floats_and_percent() -> None:
    ev = event(EventArg("c", "char", ord("A")))
    text = (
        '"%s/%d/%d on %d at %.2f: %s in %s %c 100%%\\n", comm, pid, tid, cpu, time, probe, func, c'
    )
    assert bind_printf(parse_printf(text), [("c", 8)], text)(ev) == (
        "prog/41/42 on 1 at 12.50: p_work_0 in work A 100%"
    )


def test_a_value_that_cannot_take_its_conversion_prints_fault() -> None:
    ev = event(EventArg("p", "string", None), EventArg("n", "u64", None))
    assert line("[%s] [%9d]", ["p", "n"], ev) == "[(fault)] [  (fault)]"


def test_a_string_is_unquoted_and_an_array_prints_as_in_the_trace_line() -> None:
    ev = event(EventArg("a", "u8[3]", (1, 2, 3)), EventArg("s", "string", "x y"))
    assert line("%s %s", ["a", "s"], ev) == "{1,2,3} x y"


@pytest.mark.parametrize(
    ("text", "message", "column"),
    [
        (
            '"i=%q", i',
            "unknown conversion in the format (valid: d i u o x X c s p f e E g G, "
            "with flags -+ #0, a width, .precision, hh h l ll z j t)",
            3,
        ),
        ('"i=%d %d", i', "the format has 2 conversion(s) and 1 argument(s)", 6),
        ('"i=%d", i, j', "the format has 1 conversion(s) and 2 argument(s)", 11),
        ('"i=%d, i', "the format has no closing quote", 0),
        ('"i=%d" i', "expected ', NAME' after the format", 7),
        ('"a\\q"', "unknown escape in the format", 2),
        ('"i=%d", 3', "expected ', NAME' after the format", 6),
    ],
)
def test_a_bad_format_says_what_and_where(text: str, message: str, column: int) -> None:
    with pytest.raises(SpecError) as caught:
        parse_printf(text)
    assert (caught.value.message, caught.value.column, caught.value.text) == (message, column, text)


def test_an_unknown_name_is_refused_when_bound_with_its_column() -> None:
    text = 'p work i=%di "%d %d", i, nope'
    fmt = parse_printf(text, text.index('"'))
    with pytest.raises(SpecError) as caught:
        bind_printf(fmt, [("i", 64)], text)
    assert caught.value.message == (
        "unknown name 'nope' in the format (the probe's arguments: i; the common fields: "
        "tid, pid, comm, cpu, time, probe, func)"
    )
    assert caught.value.column == text.index("nope")


def test_an_alias_names_a_field() -> None:
    text = '"= %ld", $retval'
    render = bind_printf(parse_printf(text), [("ret", 64)], text, {"$retval": "ret"})
    assert render(event(EventArg("ret", "x64", 2**64 - 5))) == "= -5"
