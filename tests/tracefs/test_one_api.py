"""One API over every target (issue 19, item 4): the same probe object, the same register
call and the same probe line give the same events on ``Process`` (jump-optimized and on
traps) and on the kernel's uprobes (``Uprobes``), and what one target cannot honour is
refused on it the same way.

The program is the tracefs tests' (conftest.py): ``work(i, names[i % 2], &rec)`` N times.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest

import kprobes
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeError, SymbolNotFound, UnsupportedOption
from kprobes.model import Event
from kprobes.tracefs import Uprobes
from tracefs.conftest import TRACEFS, Waiting

pytestmark = pytest.mark.tracefs

N = 5
ARGS = "x=%di:s64 s=+0(%si):string a=+0(%dx):s32 b=+8(%dx):s64"
EXPECTED = [(i, ("hello world", "second name")[i % 2], 7, 99) for i in range(N)]


def _values(events: list[Event]) -> list[tuple[Any, ...]]:
    return [tuple(a.value for a in e.args) for e in events]


def _run_process(prog: Waiting, register: Callable[[kprobes.Process], None]) -> None:
    """Attach to the waiting program, register, let it run to its end under us."""
    with kprobes.attach(prog.pid) as proc:
        register(proc)
        assert prog.proc.stdin is not None
        prog.proc.stdin.write(b"go\n")
        prog.proc.stdin.flush()
        assert proc.run(timeout=60), "the program did not end"
    prog.proc.wait(timeout=30)
    assert prog.proc.returncode == 0


@pytest.mark.parametrize("target", ["Process optimized", "Process on traps", "Uprobes"])
def test_one_probe_object_the_same_events_on_every_target(
    start: Callable[..., Waiting], target: str
) -> None:
    """``Kprobe(async_handler=, args=)`` and ``register_kprobe(kp, event=)``: the handler
    gets an ``Event`` named as asked, with the line's values, whichever target."""
    prog = start(N)
    got: list[Event] = []
    seen: list[Kprobe] = []

    def on_event(kp: Kprobe, event: Event) -> None:
        seen.append(kp)
        got.append(event)

    kp = Kprobe(
        symbol="work",
        optimize=target == "Process optimized",
        async_handler=on_event,
        args=ARGS,
    )
    if target == "Uprobes":
        with Uprobes(pid=prog.pid) as u:
            u.register_kprobe(kp, event="work_in")
            prog.go()
            assert u.run(timeout=30)
    else:

        def register(proc: kprobes.Process) -> None:
            proc.register_kprobe(kp, event="work_in")
            (row,) = proc.list()
            assert row.is_optimized == (target == "Process optimized"), row

        _run_process(prog, register)
    assert _values(got) == EXPECTED
    assert {e.event for e in got} == {"work_in"}
    assert {(e.pid, e.tid, e.comm) for e in got} == {(prog.pid, prog.pid, "prog")}
    assert {e.location.split("/")[0] for e in got} == {"work+0x0"}
    # Registers only when asked (with_regs=True, Process's alone); kprobes.Hit is Event's
    # old name.
    assert all(e.regs is None for e in got)
    assert all(isinstance(e, kprobes.Hit) for e in got)
    assert seen == [kp] * N and kp.nhit == N
    times = [e.timestamp for e in got]
    assert times == sorted(times)


def test_process_records_carry_a_read_only_copy_of_the_registers(
    start: Callable[..., Waiting],
) -> None:
    """On Process an async_handler's event has ``regs`` (the arguments as the program
    passed them) when it asks with ``with_regs=True``, on the optimized tier and at a trap
    alike; the kernel's targets refuse it (test_options.py)."""
    prog = start(N)
    got: list[Event] = []
    kps = [
        Kprobe(
            symbol="work",
            optimize=True,
            async_handler=lambda _k, e: got.append(e),
            with_regs=True,
        ),
        Kprobe(symbol="work", async_handler=lambda _k, e: got.append(e), with_regs=True),
    ]
    _run_process(prog, lambda proc: proc.register_kprobes(kps))
    assert len(got) == 2 * N
    assert all(e.regs is not None for e in got)
    assert sorted(e.regs.rdi for e in got if e.regs is not None) == sorted(list(range(N)) * 2)
    assert {e.event for e in got} == {"p_work_0"}


LINES = ("p:entry work " + ARGS, "r:leave work ret=$retval:s64")


@pytest.mark.parametrize("target", ["Process", "Uprobes"])
def test_add_a_probe_line_on_every_target(start: Callable[..., Waiting], target: str) -> None:
    """``add(line, handler)``: the entry's handler gets ``(kp, event)``, the return's
    ``(ri, event)``; the same values on both targets."""
    prog = start(N)
    entries: list[Event] = []
    returns: list[tuple[Any, Event]] = []

    def on_entry(kp: Any, event: Event) -> None:
        assert isinstance(kp, Kprobe)
        entries.append(event)

    def on_return(ri: Any, event: Event) -> None:
        returns.append((ri, event))

    probes: list[Any] = []

    def add(target_: Any) -> None:
        probes.append(target_.add(LINES[0], on_entry))
        probes.append(target_.add(LINES[1], on_return))

    if target == "Uprobes":
        with Uprobes(pid=prog.pid) as u:
            add(u)
            prog.go()
            assert u.run(timeout=30)
    else:
        _run_process(prog, add)
    assert isinstance(probes[0], Kprobe) and isinstance(probes[1], Kretprobe)
    assert _values(entries) == EXPECTED
    assert {e.event for e in entries} == {"entry"}
    assert [e.event for _ri, e in returns] == ["leave"] * N
    # work(i, s, r) = 2i + strlen(s) + 7 + 99 + 'p' + 2
    lengths = (len("hello world"), len("second name"))
    assert [e.arg("ret") for _ri, e in returns] == [
        2 * i + lengths[i % 2] + 7 + 99 + ord("p") + 2 for i in range(N)
    ]
    assert all(e.is_return and e.func == "work" for _ri, e in returns)
    assert all(ri.ret_addr == e.ip for ri, e in returns)


def test_process_add_refuses_a_bad_line_by_its_column(start: Callable[..., Waiting]) -> None:
    prog = start(1)
    with kprobes.attach(prog.pid) as proc:
        with pytest.raises(kprobes.errors.SpecError) as info:
            proc.add("p:entry work x=%di:u63")
        assert info.value.column == len("p:entry work x=%di:")
        with pytest.raises(kprobes.errors.SpecError):
            proc.add("-:entry")
        assert list(proc.iter_probes()) == []
    prog.go()


def _uprobe_lines(u: Uprobes) -> list[str]:
    lines = (TRACEFS / "uprobe_events").read_text().splitlines()
    return [line for line in lines if f":{u.group}/" in line]


def _both(prog: Waiting, attempt: Callable[[Any], None]) -> list[BaseException]:
    """``attempt`` on Uprobes and on Process; what each raised. Nothing may be left."""
    raised: list[BaseException] = []
    with Uprobes(pid=prog.pid) as u:
        try:
            attempt(u)
        except ProbeError as exc:
            raised.append(exc)
        assert u.iter_probes() == [] and _uprobe_lines(u) == []
    with kprobes.attach(prog.pid) as proc:
        try:
            attempt(proc)
        except ProbeError as exc:
            raised.append(exc)
        assert list(proc.iter_probes()) == []
    return raised


def test_the_same_bad_input_is_refused_the_same_way(start: Callable[..., Waiting]) -> None:
    prog = start(1)

    def mixed(target: Any) -> None:
        good = Kprobe(symbol="work", async_handler=lambda *_: None)
        bad = Kprobe(symbol="work", pre_handler=lambda *_: None, async_handler=lambda *_: None)
        target.register_kprobes([good, bad])

    def twice(target: Any) -> None:
        kp = Kprobe(symbol="work", async_handler=lambda *_: None, args="x=%di")
        target.register_kprobe(kp, ["y=%si"])

    for attempt, words in ((mixed, "does not go with a pre"), (twice, "fetch-args given twice")):
        raised = _both(prog, attempt)
        assert len(raised) == 2, attempt
        assert all(words in str(exc) and exc.errno == errno.EINVAL for exc in raised), raised
    # A probe that could not be placed is left as it was given: the call's fetch-args were
    # not kept on it.
    unplaced: list[Kprobe] = []

    def nowhere(target: Any) -> None:
        unplaced.append(Kprobe(symbol="no_such_function", async_handler=lambda *_: None))
        target.register_kprobe(unplaced[-1], ["x=%di"])

    raised = _both(prog, nowhere)
    assert [type(exc) for exc in raised] == [SymbolNotFound] * 2, raised
    assert [kp.args for kp in unplaced] == [(), ()]
    prog.go()


def test_what_only_the_kernels_targets_take_is_refused_on_process(
    start: Callable[..., Waiting],
) -> None:
    """A return probe's fetch-args and event name are the tracefs targets' (their handlers
    see events); Process runs its kretprobe handler with live registers: refused, naming
    both. An event name for a probe without an async_handler likewise."""
    prog = start(1)
    with kprobes.attach(prog.pid) as proc:
        rp = Kretprobe(symbol="work", handler=lambda *_: None)
        with pytest.raises(UnsupportedOption) as info:
            proc.register_kretprobe(rp, ["ret=$retval"])
        assert (info.value.target, info.value.option) == ("Process", "args")
        assert not rp.is_registered
        kp = Kprobe(symbol="work", pre_handler=lambda *_: None)
        with pytest.raises(UnsupportedOption) as info:
            proc.register_kprobe(kp, event="mine")
        assert (info.value.target, info.value.option) == ("Process", "event")
        assert str(info.value).startswith("Process cannot honour event='mine' on a Kprobe")
        assert not kp.is_registered and list(proc.iter_probes()) == []
    prog.go()
