"""Event format files and record decoding, on formats and records captured from a kernel."""

from __future__ import annotations

import struct

from kprobes.tracefs.eventformat import EventFormat, compile_decoder
from kprobes.tracefs.ringbuffer import scan_page
from tracefs.captured import PAGE_HEX, TYPES_FORMAT, WORK_FORMAT, WORK_RET_FORMAT
from tracefs.synth import record

PAGE = bytes.fromhex(PAGE_HEX).ljust(4096, b"\0")


def test_fields_and_types_of_every_fetch_type() -> None:
    fmt = EventFormat.parse(TYPES_FORMAT, group="tst")
    assert (fmt.id, fmt.group, fmt.name, fmt.is_return) == (2326, "tst", "e1", False)
    assert [f.name for f in fmt.arg_fields] == [
        "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "l", "m", "arg13", "arg14", "n",
    ]  # fmt: skip
    assert fmt.arg_types == (
        "u8", "s16", "x32", "x64", "string", "u32[3]", "string[2]", "u32", "string", "char",
        "string", "x64[2]", "x64", "x64", "s64",
    )  # fmt: skip
    f = fmt.field("f")
    assert (f.offset, f.size, f.count, f.elem_size) == (35, 12, 3, 4)
    g = fmt.field("g")
    assert (g.loc, g.count, g.size) == ("data_loc", 2, 8)


def test_decode_every_type_from_a_record() -> None:
    fmt = EventFormat.parse(TYPES_FORMAT)
    values = {
        "common_type": 2326, "common_pid": 4242, "__probe_ip": 0x55550000A000,
        "a": 200, "b": -3, "c": 0xDEADBEEF, "d": 1 << 60, "f": (1, 2, 3), "h": 5,
        "j": ord("Q"), "m": (7, 8), "arg13": 13, "arg14": 14, "n": -(1 << 40),
    }  # fmt: skip
    strings = {"e": "hello", "g": ["one", None], "i": "prog", "l": ""}
    data = b"\xff" * 20 + record(fmt, values, strings)  # decoded at an offset, as in a page
    tid, ip, func_ip, args = compile_decoder(fmt)(data, 20)
    assert (tid, ip, func_ip) == (4242, 0x55550000A000, 0)
    assert args == (
        200, -3, 0xDEADBEEF, 1 << 60, "hello", (1, 2, 3), ("one", None), 5, "prog", ord("Q"),
        "", (7, 8), 13, 14, -(1 << 40),
    )  # fmt: skip


def test_plain_numbers_take_the_fast_path() -> None:
    fmt = EventFormat.parse(WORK_RET_FORMAT)
    data = struct.pack("<HBBiQQq", 2327, 0, 0, 99, 0x1000, 0x2000, -5)
    assert compile_decoder(fmt)(data, 0) == (99, 0x2000, 0x1000, (-5,))


def test_symbols_are_described_by_the_callback() -> None:
    text = WORK_RET_FORMAT.replace("ret=%Ld", "ret=%pS")
    fmt = EventFormat.parse(text)
    assert fmt.arg_types == ("symbol",)
    data = struct.pack("<HBBiQQq", 2327, 0, 0, 99, 0x1000, 0x2000, 0x1234)
    decoded = compile_decoder(fmt, lambda a: f"sym+{a:#x}")(data, 0)
    assert decoded[3] == ("sym+0x1234",)


def test_captured_page_decodes_to_the_program_values() -> None:
    entry, ret = EventFormat.parse(WORK_FORMAT), EventFormat.parse(WORK_RET_FORMAT)
    decoders = {entry.id: compile_decoder(entry), ret.id: compile_decoder(ret)}
    decoded = []
    for _ts, start, _end in scan_page(PAGE).records:
        common_type = struct.unpack_from("<H", PAGE, start)[0]
        decoded.append(decoders[common_type](PAGE, start))
    work, caller = 0x556234A27179, 0x556234A27221
    assert decoded == [
        (2219, work, 0, (0, "hello world", (7, 0), "prog")),
        (2219, caller, work, (18,)),
        (2219, work, 0, (1, "hello world", (7, 0), "prog")),
        (2219, caller, work, (20,)),
    ]


def test_rel_loc_counts_from_the_end_of_the_word() -> None:
    text = WORK_FORMAT.replace("__data_loc char[] s;", "__rel_loc char[] s;")
    fmt = EventFormat.parse(text)
    assert fmt.field("s").loc == "rel_loc"
    data = bytearray(40 + 6)
    struct.pack_into("<HBBiQq", data, 0, 2326, 0, 0, 1, 0, 0)
    # The string sits at 40; the word is at 24, so its offset from the word's end is 12.
    struct.pack_into("<I", data, 24, (6 << 16) | (40 - 28))
    data[40:46] = b"hello\0"
    struct.pack_into("<I", data, 36, 0)  # arg4 faulted
    assert compile_decoder(fmt)(bytes(data), 0)[3][1] == "hello"
    assert compile_decoder(fmt)(bytes(data), 0)[3][3] is None
