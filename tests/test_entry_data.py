"""An asynchronous return probe's entry action: ``Kretprobe(entry_args=...)`` reads fetch-args
at each call's entry and hands them to the return's event as ``event.data`` (the C API's
``ri->data``, filled by the program, not by a handler at a trap).

tests/programs/rets.c's ``handle(struct req *r)`` changes ``r->len`` and ``r->name`` and
returns ``r->id`` plus the ``len`` it was given: what the entry read is gone at the return,
so a value read at the return, or another call's value, fails the checks. The trap tier
(the optimization off) is the reference; on the fast tier the entry writes a record of its
own, which the return's record names by its ticket.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support
from test_fast_returns import optimized, register_on_tier
from test_retprobes import run_to_exit, start

from kprobes import Kretprobe
from kprobes.errors import SpecError, UnsupportedOption
from kprobes.model import EntryData

pytestmark = pytest.mark.ptrace

ENTRY_ARGS = "id=+0($arg1):s64 len=+8($arg1):u32 name=+12($arg1):string"


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def traced(
    spawn: Any, tmp_path: Path, argv: list[Any], *, fast: bool, **probe: Any
) -> tuple[Kretprobe, list[Any]]:
    """``argv`` run to its end under a return probe on ``handle`` (or ``probe["symbol"]``)
    with an entry action, on the fast tier or on traps: the probe and its events."""
    proc, out = start(spawn, tmp_path, argv)
    events: list[Any] = []
    rp = Kretprobe(
        symbol=probe.pop("symbol", "handle"),
        optimize=True,
        async_handler=lambda _rp, ev: events.append(ev),
        maxactive=probe.pop("maxactive", 256),  # on traps: the default would miss nested calls
        **probe,
    )
    register_on_tier(proc, rp, fast=fast)
    run_to_exit(proc, timeout=120)
    assert out.read_bytes() == support.reference_output(argv)  # the program unchanged
    return rp, events


def check_requests(events: list[Any]) -> None:
    """Each return's data is its own call's entry: ret = id + len, name from id."""
    for ev in events:
        data = ev.data
        assert isinstance(data, EntryData), ev
        assert ev.arg("ret") == data["id"] + data["len"]
        t, i = divmod(data["id"], 1_000_000)
        assert data["len"] == i % 977 and data["name"] == f"t{t}-{i}"


@pytest.mark.parametrize("fast", [True, False], ids=["in-the-program", "on-traps"])
def test_each_return_gets_what_its_entry_read(spawn, rets, tmp_path, fast):
    rp, events = traced(
        spawn, tmp_path, [rets, "reqs", 3, 300], fast=fast,
        args="ret=$retval:s64", entry_args=ENTRY_ARGS,
    )  # fmt: skip
    assert len(events) == rp.nhit == 900 and rp.nmissed == rp.nmissed_data == 0
    check_requests(events)
    ids = sorted(ev.data["id"] for ev in events)
    assert ids == sorted(t * 1_000_000 + i for t in range(3) for i in range(300))
    assert list(events[0].data) == ["id", "len", "name"]
    assert [a.type for a in events[0].data.args] == ["s64", "u32", "string"]


def test_both_tiers_give_the_same_data_to_nested_calls(spawn, rets, tmp_path):
    """rec(30) recursing: 31 calls live at once on one thread, each return paired with its
    own entry (n at the entry, the stack pointer's word there), the same on both tiers."""

    def seen(fast: bool) -> list[tuple[Any, ...]]:
        _, events = traced(
            spawn, tmp_path, [rets, "rec", 30], fast=fast, symbol="rec",
            args="ret=$retval:u64", entry_args="n=%di k=$arg1:s8",
        )  # fmt: skip
        return [(ev.arg("ret"), dict(ev.data)) for ev in events]

    fast = seen(True)
    assert fast == [(k * (k + 1) // 2, {"n": k, "k": k}) for k in range(31)]
    assert fast == seen(False)


def test_threads_recursing_pair_every_return_with_its_entry(spawn, rets, tmp_path):
    rp, events = traced(
        spawn, tmp_path, [rets, "threads", 6, 20, 40], fast=True, symbol="rec",
        args="ret=$retval:u64", entry_args="n=%di",
    )  # fmt: skip
    n = 6 * 20 * 41
    assert len(events) == rp.nhit == n and rp.nmissed_data == 0
    assert all(ev.arg("ret") == ev.data["n"] * (ev.data["n"] + 1) // 2 for ev in events)


def test_an_entry_record_lost_to_a_full_ring_is_counted(spawn, rets, tmp_path):
    """A ring of 128 slots and four threads: records are dropped. A return whose entry's
    record was lost has no data, counted in ``nmissed_data``; every other is still its own
    call's (a ticket never names another call's record)."""
    argv = [rets, "reqs", 4, 4000]
    proc, out = start(spawn, tmp_path, argv)
    proc.records.ring_size = 8192
    events: list[Any] = []
    rp = Kretprobe(
        symbol="handle", optimize=True, async_handler=lambda _rp, ev: events.append(ev),
        args="ret=$retval:s64", entry_args=ENTRY_ARGS,
    )  # fmt: skip
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    run_to_exit(proc, timeout=120)
    assert out.read_bytes() == support.reference_output(argv)
    lost = [ev for ev in events if ev.data is None]
    assert rp.nmissed_data == len(lost)
    check_requests([ev for ev in events if ev.data is not None])
    assert len(events) + proc.dropped >= 16_000  # a return or its record, each call


def test_an_entry_action_needs_an_async_handler(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "reqs", 1, 3])
    rp = Kretprobe(symbol="handle", handler=lambda ri, regs: None, entry_args="n=%di")
    with pytest.raises(UnsupportedOption, match="entry_args='n=%di'"):
        proc.register_kretprobe(rp)
    proc.detach()


def test_a_wrong_entry_arg_names_its_column(spawn, rets, tmp_path):
    proc, _ = start(spawn, tmp_path, [rets, "reqs", 1, 3])
    rp = Kretprobe(
        symbol="handle", optimize=True, async_handler=print, entry_args="len=+8($arg1):u63"
    )
    with pytest.raises(SpecError):
        proc.register_kretprobe(rp)
    proc.detach()


def test_the_kernels_probes_refuse_an_entry_action():
    from kprobes.tracefs.options import check_options

    rp = Kretprobe(symbol="handle", async_handler=print, entry_args="n=%di")
    for target, is_kernel in (("Uprobes", False), ("Kernel", True)):
        with pytest.raises(UnsupportedOption, match="entry_args"):
            check_options(target, rp, is_kernel=is_kernel)
