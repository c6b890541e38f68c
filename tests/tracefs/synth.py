"""Ring-buffer pages and event records built here, laid out as the kernel lays them out
(kernel/trace/ring_buffer.c for pages, the event's format file for records)."""

from __future__ import annotations

import struct

from kprobes.tracefs.eventformat import EventFormat


def header(type_len: int, delta: int) -> bytes:
    return struct.pack("<I", (delta << 5) | type_len)


def page(ts: int, body: bytes, *, flags: int = 0, tail: bytes = b"", size: int = 4096) -> bytes:
    """A page: timestamp, commit (the body's length | flags), the body, ``tail``, zeros."""
    data = body + tail
    return (struct.pack("<QQ", ts, len(body) | flags) + data).ljust(size, b"\0")


def small(delta: int, payload: bytes) -> bytes:
    """A data record of up to 112 bytes: its length in the header's type_len."""
    assert len(payload) % 4 == 0 and 0 < len(payload) <= 112
    return header(len(payload) // 4, delta) + payload


def large(delta: int, payload: bytes) -> bytes:
    """A data record with its length in a word of its own (type_len 0)."""
    return header(0, delta) + struct.pack("<I", len(payload) + 4) + payload


def data_record(delta: int, payload: bytes) -> bytes:
    """A data record as the kernel writes ``payload``: padded to 4 bytes, small if it fits."""
    payload += b"\0" * (-len(payload) % 4)
    return small(delta, payload) if len(payload) <= 112 else large(delta, payload)


def record(fmt: EventFormat, values: dict[str, object], strings: dict[str, object]) -> bytes:
    """A record laid out by ``fmt``: fixed fields packed at their offsets, strings after."""
    end = max(f.offset + f.size for f in fmt.fields)
    buf = bytearray(end)
    tail = bytearray()

    def loc(text: str | None) -> int:
        if text is None:
            return end + len(tail)  # length 0: the kernel's (fault)
        raw = text.encode() + b"\0"
        word = (len(raw) << 16) | (end + len(tail))
        tail.extend(raw)
        return word

    for f in fmt.fields:
        if f.name in strings:
            texts = strings[f.name]
            words = [loc(t) for t in (texts if isinstance(texts, list) else [texts])]
            struct.pack_into(f"<{len(words)}I", buf, f.offset, *words)
        elif f.name in values:
            v = values[f.name]
            code = {1: "B", 2: "H", 4: "I", 8: "Q"}[f.elem_size]
            if f.is_signed:
                code = code.lower()
            items = v if isinstance(v, tuple) else (v,)
            struct.pack_into(f"<{len(items)}{code}", buf, f.offset, *items)
    return bytes(buf + tail)
