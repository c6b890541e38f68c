"""The VM harness's pieces that run on the host without booting anything."""

from __future__ import annotations

import struct

from .harness import MODULES, _Cpio, build_initramfs, find_kernel


def read_cpio(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """name → (mode, data, rdev) of a newc archive."""
    entries = {}
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name_at = pos + 110
        name = data[name_at : name_at + namesize - 1].decode()
        body_at = name_at + namesize + (-(110 + namesize) % 4)
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, data[body_at : body_at + size], (fields[9], fields[10]))
        pos = body_at + size + (-size % 4)


def test_cpio_newc_round_trip() -> None:
    archive = _Cpio()
    archive.directory("bin")
    archive.file("bin/x", b"abcde", 0o755)
    archive.char_device("dev/console", 5, 1)
    entries = read_cpio(archive.finish())
    assert entries["bin"][0] == 0o040755
    assert entries["bin/x"] == (0o100755, b"abcde", (0, 0))
    assert entries["dev/console"][2] == (5, 1)


def test_initramfs_holds_busybox_init_and_the_modules_in_order(tmp_path: object) -> None:
    kernel = find_kernel()
    path = build_initramfs(kernel, tmp_path)  # type: ignore[arg-type]
    entries = read_cpio(path.read_bytes())
    assert entries["init"][1].startswith(b"#!/bin/busybox sh")
    assert entries["bin/busybox"][0] & 0o111
    order = entries["modules/order"][1].decode().split()
    assert order == [m.rsplit("/", 1)[1] + ".ko" for m in MODULES]
    for name in order:
        assert entries[f"modules/{name}"][1][:4] == b"\x7fELF"  # decompressed if need be
    assert struct.unpack("<4s", entries["bin/busybox"][1][:4])[0] == b"\x7fELF"
    assert build_initramfs(kernel, tmp_path) == path  # cached  # type: ignore[arg-type]
