"""The kprobes API of the reference document (§4.1, §4.4-4.8, §5, Appendix A) on live processes.

Every test probes a real program built from tests/programs and checks exact results: hit
counts, the program's output against an unprobed run, and the program's memory read through
/proc/PID/mem (not through kprobes) to prove that registration failures, unregistration and
disabling leave no patched byte behind.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes import errors

pytestmark = pytest.mark.ptrace

N = 50  # calls of work() in "target N"
ARMED = (0xCC, 0xE9)  # first byte of an armed probe: int3, or jmp when jump-optimized


def run_to_exit(proc: Any, timeout: float = 30) -> None:
    assert proc.run(timeout=timeout), f"program {proc.pid} did not exit within {timeout} s"


def start(
    spawn: Callable[..., Any], tmp_path: Path, argv: list[Any], **kw: Any
) -> tuple[Any, Path]:
    """Spawn ``argv`` traced with its stdout in a file; returns (proc, output path)."""
    out = tmp_path / f"stdout.{len(list(tmp_path.iterdir()))}"
    with open(out, "wb") as f:
        proc = spawn(argv, stdout=f, **kw)
    return proc, out


@pytest.fixture
def target(build: Callable[[str], Path]) -> Path:
    return build("target")


@pytest.fixture
def expected(target: Path) -> bytes:
    out = support.reference_output([target, N])
    assert out.endswith(b"compute=22\nshow hello kprobes\nasm1=7 asm0=5 data=1\n")
    return out


def kpt_asm_insns(target: Path) -> dict[int, str]:
    """kpt_asm's instructions by offset, from objdump (the layout target.c documents)."""
    insns = dict(support.function_insns(target, "kpt_asm"))
    assert sorted(insns) == [0, 1, 0xB, 0x12, 0x15, 0x18, 0x1B, 0x20, 0x23, 0x25, 0x29, 0x2A]
    return insns


# ---------------------------------------------------------------------------------------------
# Registration and resolution


def test_symbol_resolves_to_the_loaded_address_and_is_armed(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    want = support.runtime_address(proc.pid, target, "work")
    assert kp.addr == want
    assert kp.symbol == "work" and kp.offset == 0
    assert support.raw_read(proc.pid, want, 1)[0] in ARMED
    run_to_exit(proc)
    assert proc.exit_code == 0
    assert kp.nhit == N
    assert kp.nmissed == 0
    assert out.read_bytes() == expected


def test_fixed_address_executable(spawn, build, tmp_path, expected):
    exe = build("target-nopie")
    proc, out = start(spawn, tmp_path, [exe, N])
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    assert kp.addr == support.symbol(exe, "work").value
    run_to_exit(proc)
    assert kp.nhit == N
    assert out.read_bytes() == expected


def test_symbol_offset_forms_agree(spawn, target, tmp_path):
    kpt_asm_insns(target)
    proc, _ = start(spawn, tmp_path, [target, N])
    base = support.runtime_address(proc.pid, target, "kpt_asm")
    plus = kprobes.Kprobe(symbol="kpt_asm+0xb")
    split = kprobes.Kprobe(symbol="kpt_asm", offset=0x12)
    absolute = kprobes.Kprobe(addr=base + 0x15)
    proc.register_kprobes([plus, split, absolute])
    assert (plus.addr, split.addr, absolute.addr) == (base + 0xB, base + 0x12, base + 0x15)
    run_to_exit(proc)
    assert (plus.nhit, split.nhit, absolute.nhit) == (2, 2, 2)


def test_handlers_see_the_thread_and_the_probe_address(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    seen: list[tuple[int, int, int]] = []

    def pre(p: Any, regs: Any) -> None:
        seen.append((regs.ip, regs.rip, regs.tid))

    kp = kprobes.Kprobe(symbol="work", pre_handler=pre)
    proc.register_kprobe(kp)
    run_to_exit(proc)
    assert seen == [(kp.addr, kp.addr, proc.pid)] * N


def test_handler_reads_arguments(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    args: list[int] = []
    kp = kprobes.Kprobe(symbol="work", pre_handler=lambda p, regs: args.append(regs.rdi))
    proc.register_kprobe(kp)
    run_to_exit(proc)
    assert args == list(range(N))


# ---------------------------------------------------------------------------------------------
# Errors: each with its errno, and nothing left patched


# case -> (Kprobe arguments given a function name -> run-time address, exception, errnos)
REJECTED: dict[str, tuple[Callable[[Callable[[str], int]], dict[str, Any]], type, set[int]]] = {
    "unknown symbol": (
        lambda at: {"symbol": "no_such_function_kpt"},
        errors.SymbolNotFound,
        {errno.ENOENT},
    ),
    "unknown library": (
        lambda at: {"symbol": "libnosuchkpt:work"},
        errors.SymbolNotFound,
        {errno.ENOENT},
    ),
    "inside movabs": (
        lambda at: {"symbol": "kpt_asm", "offset": 2},
        errors.NotABoundary,
        {errno.EILSEQ},
    ),
    "inside movabs by address": (
        lambda at: {"addr": at("kpt_asm") + 9},
        errors.NotABoundary,
        {errno.EILSEQ},
    ),
    "both symbol and addr": (
        lambda at: {"symbol": "work", "addr": at("work")},
        errors.ProbeRejected,
        {errno.EINVAL},
    ),
    "neither symbol nor addr": (lambda at: {}, errors.ProbeRejected, {errno.EINVAL}),
    "iretq": (
        lambda at: {"symbol": "kpt_iret", "offset": 1},
        errors.NotRelocatable,
        {errno.EINVAL, errno.EOPNOTSUPP},
    ),
    "someone else's int3": (
        lambda at: {"symbol": "kpt_int3", "offset": 1},
        errors.ProbeRejected,
        {errno.EINVAL, errno.EOPNOTSUPP},
    ),
    "data, not code": (lambda at: {"addr": at("message")}, errors.ProbeRejected, {errno.EINVAL}),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_rejected_registration(spawn, target, tmp_path, expected, case):
    make_kwargs, exc_type, errnos = REJECTED[case]
    # Not pending: a library the program has not mapped is an error at once (ENOENT).
    proc, out = start(spawn, tmp_path, [target, N], pending=False)
    text_before = support.exe_text(proc.pid, target)
    asm = support.runtime_address(proc.pid, target, "kpt_asm")
    seen_before = proc.read(asm, 0x2B)
    kwargs = make_kwargs(lambda name: support.runtime_address(proc.pid, target, name))
    with pytest.raises(exc_type) as info:
        proc.register_kprobe(kprobes.Kprobe(**kwargs))
    assert isinstance(info.value, errors.ProbeError)
    assert info.value.errno in errnos
    assert support.exe_text(proc.pid, target) == text_before
    assert proc.read(asm, 0x2B) == seen_before
    assert proc.list() == []
    run_to_exit(proc)
    assert proc.exit_code == 0
    assert out.read_bytes() == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pre_handler": lambda p, regs: None},  # a pre_handler reads regs itself
        {"optimize": True},  # a count: no record to put the values in
    ],
    ids=["with a pre_handler", "a count"],
)
def test_args_without_an_async_handler_are_refused(spawn, target, tmp_path, expected, kwargs):
    """Fetch-args are evaluated for an async_handler's records only: anywhere else they
    would be evaluated for nobody, so they are refused, not ignored (issue 19)."""
    proc, out = start(spawn, tmp_path, [target, N])
    text_before = support.exe_text(proc.pid, target)
    good = kprobes.Kprobe(symbol="compute")
    kp = kprobes.Kprobe(symbol="work", args="x=%di:s64", **kwargs)
    with pytest.raises(errors.UnsupportedOption) as info:
        proc.register_kprobes([good, kp])
    assert str(info.value).startswith(
        "Process cannot honour args='x=%di:s64' on a Kprobe: fetch-args are evaluated for the "
        "records of an async_handler"
    ), str(info.value)
    assert info.value.errno == errno.EINVAL
    assert (info.value.target, info.value.option) == ("Process", "args")
    assert not good.is_registered and not kp.is_registered and proc.list() == []
    assert support.exe_text(proc.pid, target) == text_before
    run_to_exit(proc)
    assert out.read_bytes() == expected


def test_registers_without_an_async_handler_are_refused(spawn, target, tmp_path, expected):
    """``with_regs=True`` asks for a copy of the registers in an async_handler's records:
    with a pre_handler (which reads the live ones) it would be for nobody."""
    proc, out = start(spawn, tmp_path, [target, N])
    kp = kprobes.Kprobe(symbol="work", pre_handler=lambda p, regs: None, with_regs=True)
    with pytest.raises(errors.UnsupportedOption) as info:
        proc.register_kprobe(kp)
    assert str(info.value).startswith(
        "Process cannot honour with_regs=True on a Kprobe: registers are copied for the "
        "records of an async_handler"
    ), str(info.value)
    assert not kp.is_registered and proc.list() == []
    run_to_exit(proc)
    assert out.read_bytes() == expected


def test_register_twice_is_rejected(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    with pytest.raises(errors.ProbeRejected) as info:
        proc.register_kprobe(kp)
    assert info.value.errno == errno.EINVAL
    assert len(proc.list()) == 1
    run_to_exit(proc)
    assert kp.nhit == N


def test_register_kprobes_rolls_back(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    text_before = support.exe_text(proc.pid, target)
    good = [kprobes.Kprobe(symbol=s) for s in ("work", "compute", "kpt_asm")]
    bad = kprobes.Kprobe(symbol="kpt_asm", offset=5)
    after = kprobes.Kprobe(symbol="show")
    with pytest.raises(errors.NotABoundary) as info:
        proc.register_kprobes([*good, bad, after])
    assert info.value.errno == errno.EILSEQ
    assert support.exe_text(proc.pid, target) == text_before
    assert proc.list() == []
    # The rolled-back probes are unregistered: they can be registered again.
    proc.register_kprobe(good[1])
    run_to_exit(proc)
    assert [kp.nhit for kp in good] == [0, 1, 0]
    assert out.read_bytes() == expected


# ---------------------------------------------------------------------------------------------
# Unregistration, aggregate probes


def test_unregister_restores_every_byte(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    text_before = support.exe_text(proc.pid, target)
    kps = [kprobes.Kprobe(symbol="kpt_asm", offset=off) for off in kpt_asm_insns(target)]
    kps.append(kprobes.Kprobe(symbol="work"))
    proc.register_kprobes(kps)
    assert support.exe_text(proc.pid, target) != text_before
    proc.unregister_kprobe(kps[-1])
    proc.unregister_kprobes(kps[:-1])
    assert support.exe_text(proc.pid, target) == text_before
    assert proc.list() == []
    run_to_exit(proc)
    assert [kp.nhit for kp in kps] == [0] * len(kps)
    assert out.read_bytes() == expected


def test_unregister_kprobes_skips_a_probe_that_was_never_registered(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    text_before = support.exe_text(proc.pid, target)
    a, b = kprobes.Kprobe(symbol="work"), kprobes.Kprobe(symbol="compute")
    stranger = kprobes.Kprobe(symbol="show")
    proc.register_kprobes([a, b])
    proc.unregister_kprobes([a, stranger, b])
    assert support.exe_text(proc.pid, target) == text_before
    assert proc.list() == []
    run_to_exit(proc)
    assert (a.nhit, b.nhit, stranger.nhit) == (0, 0, 0)


def test_aggregate_probes_both_run(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    calls: list[str] = []
    first = kprobes.Kprobe(symbol="work", pre_handler=lambda p, r: calls.append("first"))
    second = kprobes.Kprobe(
        symbol="work",
        pre_handler=lambda p, r: calls.append("second"),
        post_handler=lambda p, r, f: calls.append("second-post"),
    )
    proc.register_kprobes([first, second])
    assert first.addr == second.addr
    assert [e.addr for e in proc.list()] == [first.addr, first.addr]
    run_to_exit(proc)
    assert (first.nhit, second.nhit) == (N, N)
    assert sorted(calls) == sorted(["first", "second", "second-post"] * N)
    assert out.read_bytes() == expected


def test_unregistering_one_of_an_aggregate_keeps_the_other(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    addr = support.runtime_address(proc.pid, target, "work")
    first, second = kprobes.Kprobe(symbol="work"), kprobes.Kprobe(addr=addr)
    proc.register_kprobes([first, second])
    proc.unregister_kprobe(first)
    assert support.raw_read(proc.pid, addr, 1)[0] in ARMED
    assert [e.addr for e in proc.list()] == [addr]
    run_to_exit(proc)
    assert (first.nhit, second.nhit) == (0, N)
    assert proc.exit_code == 0


def test_unregister_last_of_an_aggregate_restores_bytes(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    addr = support.runtime_address(proc.pid, target, "work")
    original = support.raw_read(proc.pid, addr, 8)
    kps = [kprobes.Kprobe(symbol="work") for _ in range(3)]
    proc.register_kprobes(kps)
    proc.unregister_kprobes(kps)
    assert support.raw_read(proc.pid, addr, 8) == original
    run_to_exit(proc)
    assert [kp.nhit for kp in kps] == [0, 0, 0]


# ---------------------------------------------------------------------------------------------
# disable / enable, registering disabled, the global knob


def test_disable_and_enable(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    work = support.runtime_address(proc.pid, target, "work")
    original = support.raw_read(proc.pid, work, 8)
    kp = kprobes.Kprobe(symbol="work")
    other = kprobes.Kprobe(symbol="compute")
    proc.register_kprobes([kp, other])
    proc.disable_kprobe(kp)
    assert support.raw_read(proc.pid, work, 8) == original
    assert {e.addr: e.is_disabled for e in proc.list()} == {kp.addr: True, other.addr: False}
    proc.enable_kprobe(kp)
    assert support.raw_read(proc.pid, work, 1)[0] in ARMED
    proc.disable_kprobe(other)
    run_to_exit(proc)
    assert (kp.nhit, other.nhit) == (N, 0)
    assert out.read_bytes() == expected


def test_register_disabled(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    work = support.runtime_address(proc.pid, target, "work")
    original = support.raw_read(proc.pid, work, 8)
    kp = kprobes.Kprobe(symbol="work", disabled=True)
    proc.register_kprobe(kp)
    assert kp.addr == work
    assert support.raw_read(proc.pid, work, 8) == original
    (entry,) = proc.list()
    assert entry.is_disabled
    assert "[DISABLED]" in str(entry)
    proc.enable_kprobe(kp)
    assert not proc.list()[0].is_disabled
    run_to_exit(proc)
    assert kp.nhit == N


def test_disabled_probe_never_runs(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    calls: list[int] = []
    kp = kprobes.Kprobe(symbol="work", disabled=True, pre_handler=lambda p, r: calls.append(1))
    proc.register_kprobe(kp)
    run_to_exit(proc)
    assert (kp.nhit, calls) == (0, [])
    assert out.read_bytes() == expected


def test_enabled_knob_keeps_each_probes_own_state(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    work = support.runtime_address(proc.pid, target, "work")
    compute = support.runtime_address(proc.pid, target, "compute")
    # compute() is 5 bytes long and work() follows it: read only each one's first instruction.
    originals = {
        work: support.raw_read(proc.pid, work, 3),
        compute: support.raw_read(proc.pid, compute, 4),
    }
    a = kprobes.Kprobe(symbol="work")
    b = kprobes.Kprobe(symbol="compute")
    proc.register_kprobes([a, b])
    proc.disable_kprobe(b)
    assert proc.enabled is True
    proc.enabled = False
    assert proc.enabled is False
    assert {x: support.raw_read(proc.pid, x, len(b)) for x, b in originals.items()} == originals
    assert {e.addr: e.is_disabled for e in proc.list()} == {work: False, compute: True}
    proc.enabled = True
    assert support.raw_read(proc.pid, work, 1)[0] in ARMED
    assert support.raw_read(proc.pid, compute, 4) == originals[compute]
    run_to_exit(proc)
    assert (a.nhit, b.nhit) == (N, 0)
    assert out.read_bytes() == expected


def test_enabled_knob_off_for_a_whole_run(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    proc.enabled = False
    run_to_exit(proc)
    assert kp.nhit == 0
    assert out.read_bytes() == expected


def test_probe_registered_while_knob_is_off_stays_disarmed(spawn, target, tmp_path):
    proc, _ = start(spawn, tmp_path, [target, N])
    work = support.runtime_address(proc.pid, target, "work")
    original = support.raw_read(proc.pid, work, 8)
    proc.enabled = False
    kp = kprobes.Kprobe(symbol="work")
    proc.register_kprobe(kp)
    assert support.raw_read(proc.pid, work, 8) == original
    proc.enabled = True
    run_to_exit(proc)
    assert kp.nhit == N


# ---------------------------------------------------------------------------------------------
# list(): Appendix A's format


def test_list_format(spawn, target, tmp_path):
    insns = kpt_asm_insns(target)
    assert insns[0x12].startswith("mov") and insns[0x15].startswith("add")
    proc, _ = start(spawn, tmp_path, [target, N])
    base = support.runtime_address(proc.pid, target, "kpt_asm")
    push = kprobes.Kprobe(symbol="kpt_asm")  # push %rbx, no post handler: boosted
    movabs = kprobes.Kprobe(symbol="kpt_asm", offset=1, disabled=True)  # boostable
    load = kprobes.Kprobe(addr=base + 0x12)  # mov (%rbx),%rcx: boostable
    stepped = kprobes.Kprobe(symbol="kpt_asm+0x15", post_handler=lambda p, r, f: None)
    call = kprobes.Kprobe(symbol="kpt_asm+0x1b")  # call rel32: emulated
    proc.register_kprobes([call, stepped, load, movabs, push])
    entries = sorted(proc.list(), key=lambda e: e.addr)
    lines = [str(e) for e in entries]
    assert lines[0] == f"{base:016x}  k  kpt_asm+0x0  [target]  [boost]"
    assert lines[1] == f"{base + 1:016x}  k  kpt_asm+0x1  [target]  [DISABLED]  [boost]"
    assert lines[2] == f"{base + 0x12:016x}  k  kpt_asm+0x12  [target]  [boost]"
    # With a post handler the copy cannot jump straight back: it is stepped.
    assert lines[3] in (
        f"{base + 0x15:016x}  k  kpt_asm+0x15  [target]  [step]",
        f"{base + 0x15:016x}  k  kpt_asm+0x15  [target]  [singlestep]",
    )
    assert lines[4] == f"{base + 0x1B:016x}  k  kpt_asm+0x1b  [target]  [emulate]"
    assert [e.kind for e in entries] == ["k"] * 5
    assert [e.addr - base for e in entries] == [0, 1, 0x12, 0x15, 0x1B]
    assert [e.plan for e in entries] == ["boost", "boost", "boost", entries[3].plan, "emulate"]
    assert [e.is_disabled for e in entries] == [False, True, False, False, False]
    assert not any(e.is_gone for e in entries)
    run_to_exit(proc)
    after = sorted(proc.list(), key=lambda e: e.addr)
    assert str(after[0]) == f"{base:016x}  k  kpt_asm+0x0  [target]  [GONE]  [boost]"
    assert str(after[1]) == (
        f"{base + 1:016x}  k  kpt_asm+0x1  [target]  [GONE]  [DISABLED]  [boost]"
    )
    assert all(e.is_gone for e in after)
    assert (push.nhit, movabs.nhit, load.nhit, stepped.nhit, call.nhit) == (2, 0, 2, 2, 2)


# ---------------------------------------------------------------------------------------------
# Blacklist


def test_injected_pages_are_blacklisted(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    # A rip-relative add with a post handler: this one needs an out-of-line copy.
    assert dict(support.function_insns(target, "work"))[3].startswith("add")
    kp = kprobes.Kprobe(symbol="work+0x3", post_handler=lambda p, r, f: None)
    proc.register_kprobe(kp)
    injected = support.anonymous_exec_mappings(proc.pid)
    assert injected, "no executable anonymous mapping after registration"
    listed = proc.blacklist()
    text_before = support.exe_text(proc.pid, target)
    for m in injected:
        assert any(e.start <= m.start and m.end <= e.end for e in listed), (m, listed)
        for addr in (m.start, m.end - 1):
            page_before = support.raw_read(proc.pid, m.start, m.end - m.start)
            with pytest.raises(errors.Blacklisted) as info:
                proc.register_kprobe(kprobes.Kprobe(addr=addr))
            assert info.value.errno == errno.EINVAL
            assert support.raw_read(proc.pid, m.start, m.end - m.start) == page_before
    assert support.exe_text(proc.pid, target) == text_before
    assert len(proc.list()) == 1
    run_to_exit(proc)
    assert kp.nhit == N
    assert out.read_bytes() == expected


def test_user_blacklist(spawn, target, tmp_path):
    kpt_asm_insns(target)
    proc, _ = start(spawn, tmp_path, [target, N])
    base = support.runtime_address(proc.pid, target, "kpt_asm")
    proc.add_blacklist(base + 0xB, base + 0x18, reason="kpt test range")
    assert any(
        (e.start, e.end, e.reason) == (base + 0xB, base + 0x18, "kpt test range")
        for e in proc.blacklist()
    )
    text_before = support.exe_text(proc.pid, target)
    for off in (0xB, 0x12, 0x15):
        with pytest.raises(errors.Blacklisted) as info:
            proc.register_kprobe(kprobes.Kprobe(symbol="kpt_asm", offset=off))
        assert info.value.errno == errno.EINVAL
    assert support.exe_text(proc.pid, target) == text_before
    # Just outside the range on both sides is fine.
    edges = [kprobes.Kprobe(symbol="kpt_asm", offset=1), kprobes.Kprobe(symbol="kpt_asm+0x18")]
    proc.register_kprobes(edges)
    run_to_exit(proc)
    assert [kp.nhit for kp in edges] == [2, 2]


# ---------------------------------------------------------------------------------------------
# Memory access and handlers that change the program


def test_read_write_read_string(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    seen: dict[str, Any] = {}

    def pre(p: Any, regs: Any) -> None:
        s = regs.rdi
        seen["string"] = proc.read_string(s)
        seen["short"] = proc.read_string(s, max_len=5)
        seen["bytes"] = proc.read(s, 14)
        proc.write(s, b"HELLO")

    kp = kprobes.Kprobe(symbol="show", pre_handler=pre)
    proc.register_kprobe(kp)
    message = support.runtime_address(proc.pid, target, "message")
    assert proc.read_string(message) == b"hello kprobes"
    assert proc.read(message, 5) == b"hello"
    run_to_exit(proc)
    assert seen == {
        "string": b"hello kprobes",
        "short": b"hello",
        "bytes": b"hello kprobes\0",
    }
    assert out.read_bytes() == expected.replace(b"show hello", b"show HELLO")


def test_write_outside_handlers(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    message = support.runtime_address(proc.pid, target, "message")
    proc.write(message + 6, b"KPROBE")
    assert proc.read_string(message) == b"hello KPROBEs"
    assert support.raw_read(proc.pid, message, 14) == b"hello KPROBEs\0"
    run_to_exit(proc)
    assert out.read_bytes() == expected.replace(b"hello kprobes", b"hello KPROBEs")


def test_fault_injection_by_changing_registers(spawn, target, tmp_path, expected):
    """At the entry of compute(): return 42 at once (the document's 'inject faults')."""
    proc, out = start(spawn, tmp_path, [target, N])

    def pre(p: Any, regs: Any) -> bool:
        ret = int.from_bytes(proc.read(regs.sp, 8), "little")
        regs.rax = 42
        regs.ip = ret
        regs.sp += 8
        return True

    kp = kprobes.Kprobe(symbol="compute", pre_handler=pre)
    proc.register_kprobe(kp)
    run_to_exit(proc)
    assert kp.nhit == 1
    assert proc.exit_code == 0
    assert out.read_bytes() == expected.replace(b"compute=22", b"compute=42")


def test_changing_an_argument(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])

    def pre(p: Any, regs: Any) -> None:
        regs.rdi = 10  # compute(10) = 31

    proc.register_kprobe(kprobes.Kprobe(symbol="compute", pre_handler=pre))
    run_to_exit(proc)
    assert out.read_bytes() == expected.replace(b"compute=22", b"compute=31")


def test_post_handler_sees_the_next_instruction(spawn, target, tmp_path, expected):
    insns = kpt_asm_insns(target)
    assert insns[0x1B].startswith("call")
    assert insns[0x23].startswith("je")
    proc, out = start(spawn, tmp_path, [target, N])
    base = support.runtime_address(proc.pid, target, "kpt_asm")
    leaf = support.runtime_address(proc.pid, target, "kpt_leaf")
    data = support.runtime_address(proc.pid, target, "kpt_data")
    pre_ips: list[tuple[int, int]] = []
    post: list[tuple[int, int, int, int]] = []

    def on_pre(p: Any, regs: Any) -> None:
        pre_ips.append((p.addr - base, regs.ip - base))

    def on_post(p: Any, regs: Any, flags: int) -> None:
        top = int.from_bytes(proc.read(regs.sp, 8), "little")
        post.append((p.addr - base, regs.ip, regs.rbx, top))

    offsets = (0x1, 0xB, 0x1B, 0x23)
    kps = [
        kprobes.Kprobe(symbol="kpt_asm", offset=o, pre_handler=on_pre, post_handler=on_post)
        for o in offsets
    ]
    proc.register_kprobes(kps)
    run_to_exit(proc)
    assert pre_ips == [(o, o) for o in offsets] * 2
    by_offset: dict[int, list[tuple[int, int, int]]] = {}
    for off, ip, rbx, top in post:
        by_offset.setdefault(off, []).append((ip, rbx, top))
    # movabs: the next instruction.
    assert [ip for ip, _, _ in by_offset[0x1]] == [base + 0xB] * 2
    # rip-relative lea: the next instruction, and rbx holds kpt_data's real address.
    assert [(ip, rbx) for ip, rbx, _ in by_offset[0xB]] == [(base + 0x12, data)] * 2
    # call: the callee, with the return address (the instruction after the call) on top.
    assert [(ip, top) for ip, _, top in by_offset[0x1B]] == [(leaf, base + 0x20)] * 2
    # je: kpt_asm(1) falls through, kpt_asm(0) jumps.
    assert [ip for ip, _, _ in by_offset[0x23]] == [base + 0x25, base + 0x29]
    assert out.read_bytes() == expected


# ---------------------------------------------------------------------------------------------
# fault_handler


def test_fault_handler_handles_a_raising_pre_handler(spawn, target, tmp_path, expected):
    proc, out = start(spawn, tmp_path, [target, N])
    faults: list[tuple[Any, int]] = []

    def pre(p: Any, regs: Any) -> None:
        raise ValueError("handler bug")

    def fault(p: Any, regs: Any, trapnr: int) -> bool:
        faults.append((p, regs.ip))
        return True

    kp = kprobes.Kprobe(symbol="work", pre_handler=pre, fault_handler=fault)
    proc.register_kprobe(kp)
    run_to_exit(proc)
    assert faults == [(kp, kp.addr)] * N
    assert proc.exit_code == 0
    assert out.read_bytes() == expected


def test_unhandled_handler_exception_propagates_and_program_survives(
    spawn, target, tmp_path, expected
):
    proc, out = start(spawn, tmp_path, [target, N])
    hits: list[int] = []

    def pre(p: Any, regs: Any) -> None:
        hits.append(regs.rdi)
        if len(hits) == 10:
            raise ValueError("handler bug at the 10th hit")

    declined: list[int] = []
    kp = kprobes.Kprobe(
        symbol="work", pre_handler=pre, fault_handler=lambda p, r, t: declined.append(t)
    )
    proc.register_kprobe(kp)
    with pytest.raises(ValueError, match="10th hit"):
        proc.run(timeout=30)
    assert len(declined) == 1
    proc.detach()
    # A byte left patched would kill the program with SIGTRAP at its next call of work().
    status = support.wait_child(proc.pid, timeout=20)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert hits == list(range(10))
    assert out.read_bytes() == expected


# ---------------------------------------------------------------------------------------------
# Libraries: ifunc, shared-library and path forms


def test_libc_ifunc_resolves_to_the_selected_implementation(spawn, build, tmp_path):
    exe = build("ifunc")
    proc, out = start(spawn, tmp_path, [exe, 25])
    marker_hits: list[int] = []
    kp = kprobes.Kprobe(symbol="libc:strlen", pre_handler=lambda p, r: marker_hits.append(r.rdi))
    proc.register_kprobe(kp)
    run_to_exit(proc)
    first, total = out.read_text().splitlines()
    m = re.fullmatch(r"strlen=(0x[0-9a-f]+) marker=(0x[0-9a-f]+)", first)
    assert m is not None, first
    assert kp.addr == int(m.group(1), 16)
    assert marker_hits.count(int(m.group(2), 16)) == 25
    assert total == "total=325"
    entry = next(e for e in proc.list() if e.addr == kp.addr)
    assert "[libc.so.6]" in str(entry)


def test_libc_function_through_the_plt(spawn, target, tmp_path, expected):
    """The program calls printf() through its PLT: "libc:printf" is libc's own function."""
    proc, out = start(spawn, tmp_path, [target, N])
    libc = support.libc_path(target)
    where: list[int] = []

    def first_hit(p: kprobes.Kprobe, regs: Any) -> None:
        if not where:
            where.append(support.runtime_address(proc.pid, libc, "printf", dynamic=True))

    kp = kprobes.Kprobe(symbol="libc:printf", pre_handler=first_hit)
    proc.register_kprobe(kp)
    assert kp.is_pending  # spawned: stopped before the loader mapped libc
    run_to_exit(proc)
    assert where == [kp.addr]
    assert kp.nhit == expected.count(b"\n")  # one printf per line
    assert out.read_bytes() == expected


@pytest.mark.parametrize("form", ["library", "path"])
def test_shared_library_probe(spawn, build, tmp_path, form):
    exe = build("uselib")
    lib = exe.parent / "libkpt.so"
    spec = "libkpt:lib_work" if form == "library" else f"{lib}:lib_work"
    proc, out = start(spawn, tmp_path, [exe, 30])
    args: list[int] = []
    seen: list[tuple[int, str]] = []

    def pre(p: kprobes.Kprobe, regs: Any) -> None:
        if not args:
            (entry,) = proc.list()
            seen.append((support.runtime_address(proc.pid, lib, "lib_work"), str(entry)))
        args.append(regs.rdi)

    kp = kprobes.Kprobe(symbol=spec, pre_handler=pre)
    proc.register_kprobe(kp)
    (pending,) = proc.list()
    assert str(pending) == f"0000000000000000  k  {spec}  [PENDING]"
    run_to_exit(proc)
    ((addr, listed),) = seen
    assert kp.addr == addr
    assert listed.startswith(f"{addr:016x}  k  lib_work+0x0  [libkpt.so]")
    assert args == list(range(30))
    assert out.read_bytes() == b"lib sum=2205\n"


# ---------------------------------------------------------------------------------------------
# Attach to a running process, detach, and it carries on


@pytest.mark.parametrize("ending", ["close", "detach"])
def test_attach_then_detach(attach, popen, build, tmp_path, ending):
    """``close()`` is the ending of every target; ``detach()`` is the same call."""
    exe = build("ticker")
    out = tmp_path / "ticker.out"
    n = 150
    with open(out, "wb") as f:
        child = popen([exe, n, 10000], stdout=f)
    support.wait_for_lines(out, 3, timeout=10)
    text_before = support.exe_text(child.pid, exe)
    proc = attach(child.pid)
    assert proc.pid == child.pid and proc.exit_code is None
    args: list[int] = []
    kp = kprobes.Kprobe(symbol="work", pre_handler=lambda p, r: args.append(r.rdi))
    proc.register_kprobe(kp)
    assert proc.run(timeout=0.5) is False  # still running
    getattr(proc, ending)()
    assert support.exe_text(child.pid, exe) == text_before
    assert not proc.is_alive
    proc.close()  # either way, once: the other name does nothing more
    proc.detach()
    assert child.wait(timeout=30) == 0
    # Every call between the first and the last hit was seen, in order.
    assert len(args) >= 3
    assert args == list(range(args[0], args[0] + len(args)))
    assert kp.nhit == len(args)
    lines = out.read_text().splitlines()
    assert lines == [f"tick {i} {i * i + 1}" for i in range(n)] + [
        f"done {sum(i * i + 1 for i in range(n))}"
    ]


def test_attach_and_trace_to_exit(attach, popen, build, tmp_path):
    exe = build("ticker")
    out = tmp_path / "ticker.out"
    n = 40
    with open(out, "wb") as f:
        child = popen([exe, n, 5000], stdout=f)
    support.wait_for_lines(out, 2, timeout=10)
    args: list[int] = []
    with attach(child.pid) as proc:
        kp = kprobes.Kprobe(symbol="work", pre_handler=lambda p, r: args.append(r.rdi))
        proc.register_kprobe(kp)
        assert proc.run(timeout=30)
        assert proc.exit_code == 0
    # Every call from the first hit to the end was seen.
    assert args and args == list(range(args[0], n))
    assert kp.nhit == len(args)
    assert len(support.file_lines(out)) == n + 1


def test_attach_errors(build, popen):
    with pytest.raises(errors.TargetError):
        kprobes.attach(_unused_pid())
    with pytest.raises(errors.TargetError):
        kprobes.attach(os.getpid())  # a process cannot trace itself
    if Path("/proc/2/comm").read_text().strip() == "kthreadd":
        with pytest.raises(errors.TargetError):
            kprobes.attach(2)  # kernel threads cannot be traced
    with pytest.raises(errors.TargetError):
        kprobes.spawn([str(build("target")) + ".does-not-exist"])
    with pytest.raises(errors.TargetError):
        kprobes.spawn([str(Path(__file__))])  # not an ELF program


def _unused_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait(timeout=10)
    time.sleep(0.01)
    return p.pid


def test_public_api_names():
    for name in ("spawn", "attach", "Kprobe", "errors"):
        assert name in kprobes.__all__
    assert issubclass(errors.SymbolNotFound, errors.ProbeRejected)
    assert issubclass(errors.NotABoundary, errors.ProbeRejected)
    assert issubclass(errors.Blacklisted, errors.ProbeRejected)
    assert issubclass(errors.NotRelocatable, errors.ProbeRejected)
    assert issubclass(errors.ProbeRejected, errors.ProbeError)
    assert issubclass(errors.TargetError, errors.ProbeError)
