"""The Kernel target on a real kernel with kprobes (run inside the VM by tests/vm).

Kept lean: the guest runs under software emulation, where every Python line costs ten times
what it costs on the host.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Jprobe, Kretprobe
from kprobes.errors import (
    Blacklisted,
    ProbeRejected,
    SpecError,
    SymbolNotFound,
    TraceFsError,
    UnsupportedOption,
)
from kprobes.model import ArgValue, Event
from kprobes.tracefs import Kernel, parse_error_log

from .conftest import TRACEFS

AT_FDCWD = -100


def kernel_text(typ: str, value: ArgValue) -> str:
    if isinstance(value, tuple):
        return "{" + ",".join(kernel_text(typ.split("[")[0], v) for v in value) + "}"
    if value is None:
        return "(fault)"
    if typ == "string":
        return f'"{value}"'
    assert isinstance(value, int)
    return f"{value:#x}" if typ.startswith("x") else str(value)


_LINE = re.compile(
    r"^\s*(?P<comm>.+)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+"
    r"(?P<event>\w+):\s+\((?P<where>[^)]*)\)\s*(?P<args>.*)$"
)


def test_kprobe_and_kretprobe_on_do_sys_openat2(kernel: Kernel, tmp_path: Path) -> None:
    marker = str(tmp_path / "kprobes-marker")
    got: list[Event] = []
    kp = Kprobe(symbol="do_sys_openat2")
    rp = Kretprobe(symbol="do_sys_openat2")
    kernel.sink = got.append
    kernel.register_kprobe(kp, ["dfd=%di:s32", "name=+0(%si):ustring", "how=+0(%dx):x64", "$comm"])
    kernel.register_kretprobe(rp, ["ret=$retval:s64"])
    assert kp.addr is not None and kp.location is not None
    before = time.monotonic()
    fds = [os.open(marker, os.O_CREAT | os.O_WRONLY, 0o600) for _ in range(3)]
    after = time.monotonic()
    for fd in fds:
        os.close(fd)
    text = kernel.session.read("trace")  # the kernel's own rendering, before we consume
    kernel.run(timeout=0.5)
    mine = [e for e in got if e.pid == os.getpid()]
    entries = [e for e in mine if not e.is_return and e.arg("name") == marker]
    assert len(entries) == 3, got
    for entry in entries:
        assert entry.arg("dfd") == AT_FDCWD
        assert entry.location.startswith("do_sys_openat2+0x0/")
        assert entry.ip == kp.addr and entry.tid == threading.get_native_id()
        assert entry.comm == entry.arg("arg4")
        assert before <= entry.timestamp <= after
    returns = [e for e in mine if e.is_return and e.timestamp > entries[0].timestamp]
    assert [e.arg("ret") for e in returns[:3]] == fds
    assert all(e.func == "do_sys_openat2" and e.func_ip == kp.addr for e in returns)
    # Every one of our events, rendered like the kernel's text trace.
    matches = [m for m in map(_LINE.match, text.splitlines()) if m]
    for event in entries + returns[:3]:
        same = [
            m
            for m in matches
            if int(m["pid"]) == event.tid
            and m["event"] == event.event
            and abs(float(m["ts"]) - event.timestamp) < 2e-6
        ]
        assert len(same) == 1, (event, text[-2000:])
        assert same[0]["args"] == " ".join(
            f"{a.name}={kernel_text(a.type, a.value)}" for a in event.args
        )
        expected = f"{event.location} <- {event.func}" if event.is_return else event.location
        assert same[0]["where"] == expected
    kernel.update_counts()
    assert kp.nhit >= 3 and rp.nhit >= 3 and kp.nmissed == 0


def test_one_probe_object_as_on_every_target(kernel: Kernel, tmp_path: Path) -> None:
    """``Kprobe(async_handler=, args=)`` and ``register_kprobe(kp, event=)``, written as for
    Process or Uprobes (issue 19): the handler gets the Event, named as asked, with the
    probe's fetch-args."""
    marker = str(tmp_path / "kprobes-one-api")
    got: list[Event] = []
    kp = Kprobe(
        symbol="do_sys_openat2",
        async_handler=lambda probe, event: got.append(event),
        args="name=+0(%si):ustring",
    )
    kernel.register_kprobe(kp, event="opened")
    fds = [os.open(marker, os.O_CREAT | os.O_WRONLY, 0o600) for _ in range(3)]
    for fd in fds:
        os.close(fd)
    kernel.run(timeout=0.5)
    mine = [e for e in got if e.pid == os.getpid() and e.arg("name") == marker]
    assert len(mine) == 3, got
    assert {(e.group, e.event, e.regs) for e in mine} == {(kernel.group, "opened", None)}
    assert kernel.get_event_name(kp) == "opened"


def test_kretprobe_maxactive_and_misses(kernel: Kernel) -> None:
    rp = Kretprobe(symbol="vfs_read", maxactive=1)
    kernel.register_kretprobe(rp, ["ret=$retval:s64"])
    event = kernel.get_event_name(rp)
    assert f"r1:{kernel.group}/{event} vfs_read" in (TRACEFS / "kprobe_events").read_text()
    r, w = os.pipe()
    blocked = threading.Thread(target=os.read, args=(r, 1))
    blocked.start()  # holds the only instance while it sleeps in vfs_read
    time.sleep(0.3)
    for _ in range(5):
        with open("/proc/version", "rb") as f:
            f.read()
    os.write(w, b"x")
    blocked.join()
    os.close(r)
    os.close(w)
    kernel.run(timeout=0.2)
    assert rp.nmissed >= 5
    assert rp.nhit >= 1


def _wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _plan(kernel: Kernel, addr: int | None) -> str:
    return next(e.plan for e in kernel.list() if e.addr == addr)


def _optimized_probe(kernel: Kernel) -> Kprobe:
    """A probe in the middle of a function that the kernel jump-optimizes.

    The kernel says which offsets are instruction boundaries (EILSEQ otherwise) and whether
    the region can take a jump; a few functions' first bytes are tried in turn.
    """
    for symbol in ("vfs_read", "ksys_read", "vfs_write", "do_sys_openat2", "vfs_open"):
        for offset in range(8, 48):
            kp = Kprobe(symbol=symbol, offset=offset)
            try:
                kernel.register_kprobe(kp)
            except TraceFsError as exc:
                assert exc.errno in (errno.EILSEQ, errno.EINVAL), exc
                continue
            if _wait_for(lambda addr=kp.addr: _plan(kernel, addr) == "OPTIMIZED", 3):
                return kp
            kernel.unregister_kprobe(kp)
    raise AssertionError("no mid-function probe was optimized by the kernel")


def test_list_flags_optimization_and_enabled_knob(kernel: Kernel) -> None:
    entry = Kprobe(symbol="vfs_read")
    off = Kprobe(symbol="vfs_write", disabled=True)
    kernel.register_kprobes([entry, off])
    mid = _optimized_probe(kernel)
    by_addr = {e.addr: e for e in kernel.list()}
    assert by_addr[entry.addr].plan == "FTRACE" and by_addr[entry.addr].kind == "k"  # type: ignore[index]
    assert by_addr[off.addr].is_disabled  # type: ignore[index]
    assert by_addr[mid.addr].is_optimized and not by_addr[mid.addr].is_disabled  # type: ignore[index]
    assert {e.addr for e in kernel.list_mine()} >= {entry.addr, off.addr, mid.addr}

    # Appendix B: optimization off unoptimizes now; on again optimizes again (later).
    kernel.optimization = False
    assert kernel.optimization is False
    assert _plan(kernel, mid.addr) == ""
    kernel.optimization = True
    assert _wait_for(lambda: _plan(kernel, mid.addr) == "OPTIMIZED", 5)

    # Appendix A: the enabled knob disarms every probe (no events), keeping their states.
    kernel.enabled = False
    assert (Path("/sys/kernel/debug/kprobes/enabled")).read_text().strip() == "0"
    off_since = time.monotonic()
    Path("/proc/version").read_bytes()
    assert [e for e in kernel.read_events() if e.timestamp > off_since] == []
    kernel.enabled = True
    Path("/proc/version").read_bytes()
    assert any(e.pid == os.getpid() for e in kernel.read_events())
    assert next(e for e in kernel.list() if e.addr == off.addr).is_disabled
    kernel.enabled = False  # left off on purpose: closing the session puts it back


def test_refusals_say_why_and_leave_nothing(kernel: Kernel) -> None:
    listed = kernel.blacklist()
    assert listed
    name = next(
        e.reason
        for e in listed
        if re.fullmatch(r"\w+", e.reason) and len(kernel.kallsyms.lookup_all(e.reason)) == 1
    )
    with pytest.raises(Blacklisted, match="blacklist"):
        kernel.register_kprobe(Kprobe(symbol=name))
    with pytest.raises(SymbolNotFound, match="no kernel function"):
        kernel.register_kprobe(Kprobe(symbol="no_such_kernel_function"))
    with pytest.raises(ProbeRejected, match="'float'"):  # checked against the README
        kernel.register_kprobe(Kprobe(symbol="vfs_read"), ["x=%di:float"])
    with pytest.raises(SpecError, match="Unknown type is specified") as parsed:  # our grammar
        kernel.add("p vfs_read x=%di:float")
    assert parsed.value.column == len("p vfs_read x=%di:")
    # The kernel's own refusal: not an instruction boundary, with error_log's column.
    with pytest.raises(TraceFsError) as info:
        kernel.add("p:mid vfs_read+1")
    assert info.value.errno == errno.EILSEQ
    (log,) = parse_error_log(info.value.log_line)
    assert log.command[log.column :].startswith("vfs_read+1")
    assert not (TRACEFS / "events" / kernel.group).exists()
    assert kernel.group not in (TRACEFS / "kprobe_events").read_text()
    # Options the kernel cannot honour (issue 19): the target and the option are named, and
    # nothing is written (one session for both: the guest is slow to open one).
    before = (TRACEFS / "kprobe_events").read_text()

    def nothing(*_: object) -> None:
        return None

    refused = [
        (kernel.register_kprobe, Kprobe(symbol="vfs_read", optimize=True), "optimize=True"),
        (kernel.register_kretprobe, Kretprobe(symbol="vfs_read", entry_handler=nothing), "entry_"),
        (kernel.register_jprobe, Jprobe(symbol="vfs_read", entry=nothing), "entry on a Jprobe"),
    ]
    for register, probe, option in refused:
        with pytest.raises(UnsupportedOption, match=f"^Kernel cannot honour {re.escape(option)}"):
            register(probe)
        assert not probe.is_registered
    with pytest.raises(UnsupportedOption) as refusal:
        kernel.register_kprobes(
            [Kprobe(symbol="vfs_read"), Kprobe(symbol="vfs_read", optimize=True)]
        )
    assert refusal.value.errno == errno.EINVAL and refusal.value.target == "Kernel"
    assert kernel.iter_probes() == []
    assert (TRACEFS / "kprobe_events").read_text() == before
    assert not (TRACEFS / "events" / kernel.group).exists()
