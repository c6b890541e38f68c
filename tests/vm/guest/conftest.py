"""Fixtures of the kernel tests, run inside the VM (root, a stock kernel with kprobes)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kprobes.tracefs import Kernel

TRACEFS = Path("/sys/kernel/tracing")
DEBUG_KPROBES = Path("/sys/kernel/debug/kprobes")


def leftovers(group: str, instance: str) -> list[str]:
    left = []
    if any(f":{group}/" in line for line in (TRACEFS / "kprobe_events").read_text().splitlines()):
        left.append(f"kprobe_events lines of {group}")
    if (TRACEFS / "events" / group).exists():
        left.append(f"events/{group}")
    if (TRACEFS / "instances" / instance).exists():
        left.append(f"instances/{instance}")
    return left


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    """A Kernel session; afterwards nothing of it may be left, and the knobs are back."""
    assert os.environ.get("KPROBES_IN_VM") == "1", "guest tests run only inside the VM"
    k = Kernel()
    group, instance = k.group, k.instance
    try:
        yield k
    finally:
        k.close()
    assert leftovers(group, instance) == []
    assert (DEBUG_KPROBES / "enabled").read_text().strip() == "1"
    assert Path("/proc/sys/debug/kprobes-optimization").read_text().strip() == "1"
