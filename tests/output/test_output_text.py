"""The kernel's trace-file layout, checked with exact strings built from the kernel's formats."""

from __future__ import annotations

import time

import pytest

from kprobes.model import ArgValue, Event, EventArg
from kprobes.output.argtypes import FetchType, Kind, format_value, parse_type
from kprobes.output.text import (
    BufferCounts,
    format_event,
    format_header,
    format_timestamp,
    format_wallclock,
)


def entry(**changes: object) -> Event:
    fields: dict[str, object] = {
        "group": "kprobes",
        "event": "myprobe",
        "pid": 1447,
        "tid": 1447,
        "comm": "",
        "cpu": 1,
        "timestamp": 1038282.286875,
        "ip": 0xFFFFFFFF811A2B30,
        "location": "do_sys_open+0x0/0xd6",
        "args": (
            EventArg("dfd", "u32", 3),
            EventArg("filename", "x64", 0x7FFFD1EC4440),
            EventArg("flags", "x32", 0x8000),
            EventArg("mode", "u16", 0),
        ),
    }
    fields.update(changes)
    return Event(**fields)  # type: ignore[arg-type]


def test_entry_line_is_the_kernel_example_in_todays_layout() -> None:
    # Documentation/trace/kprobetrace.rst's example line, with the context printed by today's
    # trace_print_context(): "%16s-%-7d " and "[%03d] " then " %5lu.%06lu: ".
    assert format_event(entry()) == (
        "           <...>-1447    [001]  1038282.286875: myprobe: (do_sys_open+0x0/0xd6)"
        " dfd=3 filename=0x7fffd1ec4440 flags=0x8000 mode=0"
    )


def test_return_line_names_the_caller_and_the_function() -> None:
    ev = entry(
        event="myretprobe",
        comm="cat",
        location="sys_openat+0xc/0xe",
        is_return=True,
        func="do_sys_open",
        args=(EventArg("$retval", "s64", 0xFFFFFFFFFFFFFFFE),),
    )
    assert format_event(ev) == (
        "             cat-1447    [001]  1038282.286875: myretprobe:"
        " (sys_openat+0xc/0xe <- do_sys_open) $retval=-2"
    )


def test_a_thread_prints_its_own_id_and_tgid_on_request() -> None:
    ev = entry(pid=1000, tid=1003, comm="worker", cpu=12, timestamp=5.5, args=())
    assert format_event(ev) == (
        "          worker-1003    [012]      5.500000: myprobe: (do_sys_open+0x0/0xd6)"
    )
    assert format_event(ev, tgid=True) == (
        "          worker-1003    (   1000) [012]      5.500000: myprobe: (do_sys_open+0x0/0xd6)"
    )


def test_irq_flags_take_their_column_when_known() -> None:
    ev = entry(comm="bash", timestamp=2.0, args=())
    assert format_event(ev, irq_flags="d..1.") == (
        "            bash-1447    [001] d..1.     2.000000: myprobe: (do_sys_open+0x0/0xd6)"
    )


def test_unknown_cpu_and_missing_location_and_func() -> None:
    ev = entry(cpu=-1, location="", ip=0x401136, args=(), timestamp=0.0)
    assert format_event(ev).endswith("[???]      0.000000: myprobe: (0x401136)")
    ret = entry(location="", ip=0x401200, is_return=True, func="", func_ip=0x401136, args=())
    assert format_event(ret).endswith("myprobe: (0x401200 <- 0x401136)")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "    0.000000"),
        (1.0000005, "    1.000001"),  # ns2usecs(): (ns + 500) / 1000 rounds half up
        (1.0000004, "    1.000000"),
        (2.9999996, "    3.000000"),
        (123456.000001, "123456.000001"),
    ],
)
def test_timestamps_round_like_ns2usecs(seconds: float, text: str) -> None:
    assert format_timestamp(seconds) == text


@pytest.mark.parametrize(
    ("type_text", "value", "text"),
    [
        ("u8", -1, "255"),
        ("u16", 0x12345, "9029"),
        ("u32", 3, "3"),
        ("u64", 2**64 - 1, "18446744073709551615"),
        ("s8", 0xFF, "-1"),
        ("s16", 0x7FFF, "32767"),
        ("s32", -5, "-5"),
        ("s64", 2**63, "-9223372036854775808"),
        ("x8", 0x1FF, "0xff"),
        ("x16", -1, "0xffff"),
        ("x32", 0, "0x0"),
        ("x64", 0xDEADBEEF, "0xdeadbeef"),
        ("", 16, "0x10"),  # no type: the kernel's default x64
        ("char", 65, "'A'"),
        ("char", "z", "'z'"),
        ("string", "hello world", '"hello world"'),
        ("ustring", "/etc/passwd", '"/etc/passwd"'),
        ("symstr", "main+0x4/0x20", '"main+0x4/0x20"'),
        ("symbol", "main+0x4/0x20", "main+0x4/0x20"),
        ("symbol", 0xFFFF0000, "0xffff0000"),  # %pS of an address with no symbol
        ("b4@2/8", 0xF, "15"),  # a bitfield prints as its container's unsigned type
        ("b3@0/32", 0x1_0000_0005, "5"),
        ("u16[3]", (1, 2, 3), "{1,2,3}"),
        ("x8[2]", (10, None), "{0xa,(fault)}"),
        ("string[2]", ("a", "b"), '{"a","b"}'),
        ("s8[1]", (0x80,), "{-128}"),
        ("string", None, "(fault)"),
        ("u32", None, "(fault)"),
        ("u32[4]", None, "(fault)"),
    ],
)
def test_each_type_prints_like_the_kernels_print_function(
    type_text: str, value: ArgValue, text: str
) -> None:
    assert format_value(type_text, value) == text


def test_types_parse_with_width_and_array_length() -> None:
    assert parse_type("s16") == FetchType(Kind.SIGNED, 16)
    assert parse_type("x32[8]") == FetchType(Kind.HEX, 32, 8)
    assert parse_type("b1@7/64") == FetchType(Kind.UNSIGNED, 64)
    assert parse_type("%pd") == FetchType(Kind.STRING, 0)
    assert parse_type("f64").kind is Kind.RAW
    assert format_value("f64", 7) == "7"


def test_header_without_irq_info_lines_up_with_events() -> None:
    header = format_header(counts=BufferCounts(entries=2, written=5, cpus=4))
    assert header == (
        "# tracer: nop\n"
        "#\n"
        "# entries-in-buffer/entries-written: 2/5   #P:4\n"
        "#\n"
        "#           TASK-PID     CPU#     TIMESTAMP  FUNCTION\n"
        "#              | |         |         |         |\n"
    )
    line = format_event(entry(comm="bash", timestamp=12.5))
    titles = header.splitlines()[-2]
    assert titles.index("CPU#") == line.index("[")
    assert titles.index("PID") == line.index("1447")


def test_header_with_tgid() -> None:
    assert format_header(tgid=True).splitlines()[-2:] == [
        "#           TASK-PID       TGID    CPU#     TIMESTAMP  FUNCTION",
        "#              | |           |       |         |         |",
    ]
    line = format_event(entry(comm="bash"), tgid=True)
    titles = format_header(tgid=True).splitlines()[-2]
    assert titles.index("CPU#") == line.index("[")


@pytest.mark.parametrize("tgid", [False, True])
def test_header_with_irq_info_lines_up_with_the_flags(tgid: bool) -> None:
    header = format_header(irq_info=True, tgid=tgid).splitlines()
    line = format_event(entry(comm="bash", timestamp=12.5), irq_flags="d.h1.", tgid=tgid)
    titles, legend_first, legend_last = header[-2], header[2], header[-3]
    assert titles.index("CPU#") == line.index("[")
    assert titles.index("|||||") == line.index("d.h1.")
    # The legend's diagonal ends one column right of the five flag columns.
    assert legend_last.index("|||| /") == line.index("d.h1.")
    assert legend_first.endswith("_-----=> irqs-off/BH-disabled")
    if not tgid:
        assert header[2:] == [
            "#                                _-----=> irqs-off/BH-disabled",
            "#                               / _----=> need-resched",
            "#                              | / _---=> hardirq/softirq",
            "#                              || / _--=> preempt-depth",
            "#                              ||| / _-=> migrate-disable",
            "#                              |||| /     delay",
            "#           TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION",
            "#              | |         |   |||||     |         |",
        ]


# -- -T: the wall clock in place of the event clock's seconds ---------------------------------

# 2026-11-27 11:12:32.123456 UTC, in ns since the epoch, and the offset that puts entry()'s
# timestamp (1038282.286875 s of its clock) there.
WALL_NS = 1_795_777_952_123_456_000
OFFSET_NS = WALL_NS - 1_038_282_286_875_000


@pytest.fixture
def zone(monkeypatch: pytest.MonkeyPatch):
    """Set the local time zone for one test (``TZ``), and put the process's back after."""

    def set_zone(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield set_zone
    monkeypatch.undo()
    time.tzset()


def test_wall_clock_replaces_the_timestamp_column_with_the_local_time(zone) -> None:
    zone("UTC")
    assert format_event(entry(), wall_offset_ns=OFFSET_NS) == (
        "           <...>-1447    [001]  11:12:32.123456: myprobe: (do_sys_open+0x0/0xd6)"
        " dfd=3 filename=0x7fffd1ec4440 flags=0x8000 mode=0"
    )
    zone("IST-5:30")  # five and a half hours east of Greenwich
    assert format_wallclock(1038282.286875, OFFSET_NS) == "16:42:32.123456"


def test_wall_clock_rounds_to_the_microsecond_as_the_seconds_column_does(zone) -> None:
    zone("UTC")
    # 499 ns past the microsecond rounds down, 500 up, across a second's boundary too.
    assert format_wallclock(1038282.286875, OFFSET_NS + 499) == "11:12:32.123456"
    assert format_wallclock(1038282.286875, OFFSET_NS + 500) == "11:12:32.123457"
    assert format_wallclock(1038282.286875, OFFSET_NS + 876_544_000) == "11:12:33.000000"
