"""The ring-buffer page decoder on byte tables: a page captured from a real kernel, and pages
built here with every record type (data short and long, padding, time extend, time stamp)."""

from __future__ import annotations

import struct

import pytest

from kprobes.tracefs.ringbuffer import (
    MISSED_EVENTS,
    MISSED_STORED,
    PADDING,
    TIME_EXTEND,
    TIME_STAMP,
    PageLayout,
    Record,
    iter_records,
    scan_page,
)
from tracefs.captured import HEADER_PAGE, PAGE_HEX
from tracefs.synth import header, large, page, small

PAGE = bytes.fromhex(PAGE_HEX).ljust(4096, b"\0")


def test_header_page_layout() -> None:
    layout = PageLayout.parse(HEADER_PAGE)
    assert layout == PageLayout(0, 8, 8, 16, 4080)
    assert layout.page_size == 4096


def test_header_page_of_a_bigger_subbuffer() -> None:
    text = HEADER_PAGE.replace("size:4080", "size:8176")
    assert PageLayout.parse(text).page_size == 8192


def test_captured_page() -> None:
    scan = scan_page(PAGE)
    # Four records: entry, return, entry, return; 60- and 32-byte payloads (type_len 15, 8).
    assert [(s, e - s) for _, s, e in scan.records] == [(20, 60), (84, 32), (120, 60), (184, 32)]
    base = 0x286DB94F00A
    assert [ts - base for ts, _, _ in scan.records] == [0, 19209, 20529, 21237]
    assert scan.lost == 0
    # Every record starts with common_type: 2326 (work) then 2327 (work_ret).
    types = [struct.unpack_from("<H", PAGE, s)[0] for _, s, _ in scan.records]
    assert types == [2326, 2327, 2326, 2327]


def test_short_and_long_data_records() -> None:
    p1 = b"A" * 8
    p2 = b"B" * 200  # above 112 bytes: type_len 0 with an explicit length
    body = small(10, p1) + large(5, p2) + small(1, b"C" * 4)
    scan = scan_page(page(1000, body))
    assert [(ts, page(1000, body)[s:e]) for ts, s, e in scan.records] == [
        (1010, p1),
        (1015, p2),
        (1016, b"C" * 4),
    ]


def test_time_extend_adds_a_long_delta() -> None:
    delta = (3 << 27) | 12345  # does not fit in 27 bits
    extend = header(TIME_EXTEND, delta & ((1 << 27) - 1)) + struct.pack("<I", delta >> 27)
    body = small(7, b"x" * 4) + extend + small(2, b"y" * 4)
    assert [ts for ts, _, _ in scan_page(page(100, body)).records] == [107, 107 + delta + 2]


def test_time_stamp_sets_the_absolute_time() -> None:
    absolute = (5 << 27) | 99
    stamp = header(TIME_STAMP, absolute & ((1 << 27) - 1)) + struct.pack("<I", absolute >> 27)
    body = small(7, b"x" * 4) + stamp + small(3, b"y" * 4)
    assert [ts for ts, _, _ in scan_page(page(100, body)).records] == [107, absolute + 3]


def test_padding_is_skipped_and_adds_no_time() -> None:
    # A discarded event: padding with a non-zero delta; array[0] counts the bytes after the
    # header word, itself included (rb_event_discard), like a long data record's length.
    discarded = header(PADDING, 50) + struct.pack("<I", 16) + b"\0" * 12
    body = small(1, b"a" * 4) + discarded + small(2, b"b" * 4)
    records = scan_page(page(0, body)).records
    assert [ts for ts, _, _ in records] == [1, 3]
    assert page(0, body)[records[1][1] : records[1][2]] == b"b" * 4


def test_null_padding_ends_the_page() -> None:
    body = small(1, b"a" * 4) + header(PADDING, 0) + small(2, b"b" * 4)
    assert len(scan_page(page(0, body)).records) == 1


def test_missed_events_with_and_without_a_count() -> None:
    body = small(1, b"a" * 4)
    counted = page(0, body, flags=MISSED_EVENTS | MISSED_STORED, tail=struct.pack("<Q", 42))
    assert scan_page(counted).lost == 42
    assert scan_page(page(0, body, flags=MISSED_EVENTS)).lost == -1
    assert len(scan_page(counted).records) == 1


def test_commit_bounds_the_scan() -> None:
    body = small(1, b"a" * 4)
    # Stale bytes after the commit must not be read as records.
    stale = page(0, body)[:24] + small(1, b"z" * 4) + b"\0" * (4096 - 32)
    assert len(scan_page(stale).records) == 1


@pytest.mark.parametrize("layout", [PageLayout(), PageLayout.parse(HEADER_PAGE)])
def test_iter_records_matches_scan(layout: PageLayout) -> None:
    assert list(iter_records(PAGE, layout)) == [
        Record(ts, s, e) for ts, s, e in scan_page(PAGE, layout).records
    ]
