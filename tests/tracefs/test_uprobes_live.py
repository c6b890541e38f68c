"""The Uprobes target on this machine's kernel (root; uprobes but no kprobes here).

Events are checked against the kernel's own text rendering of the same records (the
instance's ``trace`` file, read before ``trace_pipe_raw`` consumes them), hits against
``uprobe_profile``, and cleanup against what is left in tracefs.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe
from kprobes.errors import ProbeRejected, SpecError, SymbolNotFound, TargetError, TraceFsError
from kprobes.model import ArgValue, Event
from kprobes.spec import parse
from kprobes.symbols.elf import ElfImage
from kprobes.tracefs import Kernel, Uprobes, parse_error_log
from tracefs.conftest import TRACEFS, Waiting, require_uprobe_events, tracefs_leftovers

pytestmark = pytest.mark.tracefs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# work(x, s, r): x in rdi, s in rsi, r in rdx; struct rec { int a; long b; char name[16];
# unsigned short arr[4]; } at offsets 0, 8, 16, 32.
WORK_ARGS = (
    "x=%di:s64",
    "xx=%di:x32",
    "s=+0(%si):string",
    "a=+0(%dx):s32",
    "b=+8(%dx):u64",
    "name=+16(%dx):string",
    "arr=+32(%dx):u16[4]",
    "c=+16(%dx):char",
    "$comm",
)


def kernel_text(typ: str, value: ArgValue) -> str:
    """``value`` as the kernel prints an argument of type ``typ`` in ``trace``."""
    if isinstance(value, tuple):
        base = typ.split("[")[0]
        return "{" + ",".join(kernel_text(base, v) for v in value) + "}"
    if value is None:
        return "(fault)"
    if typ == "string":
        return f'"{value}"'
    if typ == "char":
        assert isinstance(value, int)
        return f"'{chr(value)}'"
    assert isinstance(value, int)
    return f"{value:#x}" if typ.startswith("x") else str(value)


_LINE = re.compile(
    r"^\s*(?P<comm>.+)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+"
    r"(?P<event>\w+):\s+\((?P<where>[^)]*)\)\s*(?P<args>.*)$"
)


def parse_trace(text: str) -> list[dict[str, str]]:
    return [m.groupdict() for line in text.splitlines() if (m := _LINE.match(line))]


def test_events_match_the_kernels_own_text(start: Callable[..., Waiting]) -> None:
    prog = start(4)
    got: list[Event] = []
    with Uprobes(pid=prog.pid, sink=got.append) as u:
        kp = Kprobe(symbol="work")
        rp = Kretprobe(symbol="work")
        u.register_kprobe(kp, WORK_ARGS)
        u.register_kretprobe(rp, ["ret=$retval:s64"])
        before = time.monotonic()
        out = prog.go()
        after = time.monotonic()
        text = u.session.read("trace")  # not consuming: the same records, rendered by the kernel
        assert u.run(timeout=10) is True
        assert kp.nhit == 4 and rp.nhit == 4 and kp.nmissed == 0
    lines = parse_trace(text)
    assert len(got) == len(lines) == 8, text
    totals = 0
    for event, line in zip(got, lines, strict=True):
        assert event.event == line["event"]
        assert (event.pid, event.tid) == (prog.pid, prog.pid)
        assert event.tid == int(line["pid"]) and event.cpu == int(line["cpu"])
        assert event.comm == line["comm"].strip() == "prog"
        assert abs(event.timestamp - float(line["ts"])) < 2e-6
        rendered = " ".join(f"{a.name}={kernel_text(a.type, a.value)}" for a in event.args)
        assert rendered == line["args"]
        if event.is_return:
            # The kernel prints (return address <- function), as in the Kprobes document.
            assert line["where"] == f"{event.ip:#x} <- {event.func_ip:#x}"
            assert event.func == "work" and event.location.startswith("calls+")
            ret = event.arg("ret")
            assert isinstance(ret, int)
            totals += ret
        else:
            assert line["where"] == f"{event.ip:#x}"
            assert event.location.startswith("work+0x0/")
    # The instance's trace clock is CLOCK_MONOTONIC, the Process target's clock.
    assert all(before <= e.timestamp <= after for e in got)
    first = got[0]
    assert [a.type for a in first.args] == [
        "s64", "x32", "string", "s32", "u64", "string", "u16[4]", "char", "string",
    ]  # fmt: skip
    assert [a.value for a in first.args] == [
        0, 0, "hello world", 7, 99, "pairname", (1, 2, 3, 4), ord("p"), "prog",
    ]  # fmt: skip
    assert got[2].arg("s") == "second name" and got[2].arg("x") == 1
    assert totals == int(out)


def test_hits_and_cleanup(start: Callable[..., Waiting]) -> None:
    prog = start(5)
    u = Uprobes(pid=prog.pid)
    group, instance = u.group, u.instance
    kp = Kprobe(symbol="work")
    u.register_kprobe(kp)
    assert (TRACEFS / "instances" / instance / "events" / group).is_dir()
    prog.go()
    u.run(timeout=10)
    assert kp.nhit == 5
    profile = (TRACEFS / "uprobe_profile").read_text()
    assert re.search(rf"\s{u.get_event_name(kp)}\s+5$", profile, re.M), profile
    u.close()
    assert tracefs_leftovers(group, instance) == []
    assert not kp.is_registered
    u.close()  # idempotent


def test_unregister_removes_the_event(start: Callable[..., Waiting]) -> None:
    prog = start(2)
    with Uprobes(pid=prog.pid) as u:
        kp = Kprobe(symbol="work")
        u.register_kprobe(kp)
        event = u.get_event_name(kp)
        assert event is not None and (TRACEFS / "events" / u.group / event).exists()
        u.unregister_kprobe(kp)
        assert not (TRACEFS / "events" / u.group / event).exists()
        assert not kp.is_registered
        with pytest.raises(ProbeRejected):
            u.unregister_kprobe(kp)
        prog.go()
        assert u.run(timeout=10) and u.read_events() == []


def test_a_thread_created_later_is_followed(start: Callable[..., Waiting]) -> None:
    prog = start(3, "thread")
    got: list[Event] = []
    with Uprobes(pid=prog.pid, sink=got.append) as u:
        u.register_kprobe(Kprobe(symbol="work"), ["x=%di:s64"])
        prog.go()
        u.run(timeout=10)
    assert [e.arg("x") for e in got] == [0, 1, 2]
    assert all(e.pid == prog.pid and e.tid != prog.pid for e in got)


def test_a_thread_gone_before_its_events_are_read_is_kept(start: Callable[..., Waiting]) -> None:
    """The thread runs on CPU 0; its creation is recorded on CPU 1 (task_newtask, by the main
    thread). When the pages are read the thread is gone, and CPU 0's page is decoded first:
    its events must wait for the announcement further on in the same batch."""
    assert len(os.sched_getaffinity(0)) >= 2, "needs two CPUs"
    prog = start(3, "thread-cpu0")
    with Uprobes(pid=prog.pid) as u:
        u.register_kprobe(Kprobe(symbol="work"), ["x=%di:s64"])
        prog.go()  # returns once the program has exited
        events = u.read_events()
    assert [e.arg("x") for e in events] == [0, 1, 2]
    assert all(e.pid == prog.pid and e.tid != prog.pid and e.cpu == 0 for e in events)


def test_pages_read_and_decoded_apart(start: Callable[..., Waiting]) -> None:
    prog = start(3)
    with Uprobes(pid=prog.pid) as u:
        u.register_kprobe(Kprobe(symbol="work"), ["x=%di:s64", "s=+0(%si):string"])
        prog.go()
        pages = u.read_pages()
        assert pages and u.read_events() == []  # read_pages consumed them
        events = u.decode_pages(pages)
        assert u.decode_pages(pages) == events
    assert [(e.arg("x"), e.arg("s")) for e in events] == [
        (0, "hello world"), (1, "second name"), (2, "hello world"),
    ]  # fmt: skip


def test_a_poll_reads_at_most_pages_per_read_pages_of_each_cpu(
    start: Callable[..., Waiting],
) -> None:
    """A batch is delivered whole before ``run()`` looks at the clock again: the command line
    keeps batches small so that a lagging reader still ends on time."""
    prog = start(2000)
    with Uprobes(pid=prog.pid) as u:
        u.register_kprobe(Kprobe(symbol="work"), ["x=%di:s64", "s=+0(%si):string"])
        prog.go()
        u.pages_per_read = 2
        batches = []
        while pages := u.read_pages():
            batches.append(Counter(cpu for cpu, _ in pages))
    assert len(batches) > 1 and all(max(b.values()) <= 2 for b in batches), batches


def test_pid_filter_drops_a_forked_child(start: Callable[..., Waiting]) -> None:
    prog = start(3, "fork")
    mine: list[Event] = []
    with Uprobes(pid=prog.pid, sink=mine.append) as u:
        kp = Kprobe(symbol="work")
        u.register_kprobe(kp)
        prog.go()
        u.run(timeout=10)
    assert len(mine) == 3 and {e.pid for e in mine} == {prog.pid}
    assert kp.nhit == 6  # the kernel's count: both processes hit the file's probe


def test_path_target_sees_every_process(start: Callable[..., Waiting], program: Path) -> None:
    prog = start(3, "fork")
    got: list[Event] = []
    with Uprobes(path=str(program), sink=got.append) as u:
        u.register_kprobe(Kprobe(symbol="work"))
        prog.go()
        u.run(timeout=1)
    assert len(got) == 6 and len({e.pid for e in got}) == 2


def test_disabled_probe_records_nothing_until_enabled(start: Callable[..., Waiting]) -> None:
    prog = start(2)
    with Uprobes(pid=prog.pid) as u:
        off = Kprobe(symbol="work", disabled=True)
        on = Kprobe(symbol="work")
        u.register_kprobes([off, on])
        assert off.is_disabled and off.is_registered
        u.disable_kprobe(on)
        u.enable_kprobe(off)
        prog.go()
        events = u.read_events()
    assert [e.event for e in events] == ["p_work_0x0"] * 2


def test_definition_lines_and_file_offsets(start: Callable[..., Waiting], program: Path) -> None:
    image = ElfImage.open(str(program))
    work = image.lookup("work")
    assert work is not None
    offset = image.vaddr_to_offset(work.value)
    readelf = subprocess.run(["readelf", "-lW", str(program)], capture_output=True, text=True)
    for row in readelf.stdout.splitlines():  # the same answer from readelf's program headers
        parts = row.split()
        if parts[:1] == ["LOAD"] and int(parts[2], 16) <= work.value < int(parts[2], 16) + int(
            parts[4], 16
        ):
            assert offset == work.value - int(parts[2], 16) + int(parts[1], 16)
    prog = start(2)
    got: list[Event] = []
    with Uprobes(pid=prog.pid, sink=got.append) as u:
        by_offset = u.add(f"p:at_offset {program}:{offset:#x} x=%di:s64")
        by_name = u.add("r:ret work ret=$retval:s64")
        assert isinstance(by_offset, Kprobe) and isinstance(by_name, Kretprobe)
        lines = (TRACEFS / "uprobe_events").read_text()
        assert f"p:{u.group}/at_offset {program}:0x{offset:016x} x=%di:s64" in lines
        prog.go()
        u.run(timeout=10)
    assert [e.event for e in got] == ["at_offset", "ret", "at_offset", "ret"]


def test_refused_line_reports_the_column_and_leaves_nothing(start: Callable[..., Waiting]) -> None:
    prog = start(1)
    with Uprobes(pid=prog.pid) as u:
        before = len(parse_error_log((TRACEFS / "error_log").read_text()))
        # A line is parsed by our grammar first: the kernel's message, at the kernel's column.
        line = "p:bad work ok=%di m=%ax:string"
        with pytest.raises(SpecError, match="String accepts only memory argument") as parsed:
            u.add(line)
        assert line[parsed.value.column :] == "string"
        # Fetch-args given as words reach the kernel, which refuses them in its error_log.
        with pytest.raises(TraceFsError) as info:
            u.register_kprobe(Kprobe(symbol="work"), ["ok=%di", "m=%ax:string"])
        err = info.value
        assert err.errno == errno.EINVAL
        (entry,) = parse_error_log(err.log_line)
        assert entry.message == "String accepts only memory argument"
        assert entry.command[entry.column :] == "string"
        assert "column" in str(err) and "string" in str(err)
        assert not (TRACEFS / "events" / u.group).exists()
        assert f"{u.group}/" not in (TRACEFS / "uprobe_events").read_text()
        after = parse_error_log((TRACEFS / "error_log").read_text())
        assert len(after) <= before + 1  # ours is cleared when the log held only ours
        prog.go()


def test_refusals_before_the_kernel(start: Callable[..., Waiting]) -> None:
    prog = start(1)
    with Uprobes(pid=prog.pid) as u:
        with pytest.raises(SymbolNotFound, match="no_such_function"):
            u.register_kprobe(Kprobe(symbol="no_such_function"))
        with pytest.raises(ProbeRejected, match="does not know the fetch-arg type 'float'"):
            u.register_kprobe(Kprobe(symbol="work"), ["x=%di:float"])
        with pytest.raises(ProbeRejected, match=r"\$retval is only for return probes"):
            u.register_kprobe(Kprobe(symbol="work"), ["$retval"])
        with pytest.raises(ProbeRejected, match="past the end"):
            u.register_kprobe(Kprobe(symbol="work", offset=0x10000))
        assert not (TRACEFS / "events" / u.group).exists()
        prog.go()


def test_handler_exceptions_reach_the_fault_handler_or_run(start: Callable[..., Waiting]) -> None:
    prog = start(2)
    faults: list[int] = []

    def boom(kp: Kprobe, event: Event) -> None:
        raise ValueError("handler failed")

    with Uprobes(pid=prog.pid) as u:
        handled = Kprobe(
            symbol="work", pre_handler=boom, fault_handler=lambda k, e, n: faults.append(n) or True
        )
        unhandled = Kprobe(symbol="work", pre_handler=boom)
        u.register_kprobes([handled, unhandled])
        prog.go()
        with pytest.raises(ValueError, match="handler failed"):
            u.run(timeout=10)
    assert faults == [-1, -1]


def _session_driver(program: Path) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "session_driver.py"), str(program)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    group, instance = proc.stdout.readline().split()
    return proc, group, instance


def test_sigterm_cleans_up(program: Path) -> None:
    proc, group, instance = _session_driver(program)
    assert tracefs_leftovers(group, instance) != []
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert tracefs_leftovers(group, instance) == []


def test_a_killed_sessions_leftovers_are_removed_by_the_next(program: Path) -> None:
    proc, group, instance = _session_driver(program)
    proc.kill()
    proc.wait(timeout=30)
    assert len(tracefs_leftovers(group, instance)) == 3
    with Uprobes(path=str(program)) as u:
        assert group in u.session.stale_removed
        assert tracefs_leftovers(group, instance) == []


def _append(line: str) -> None:
    fd = os.open(TRACEFS / "uprobe_events", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def test_a_clashing_group_is_refused(program: Path) -> None:
    image = ElfImage.open(str(program))
    work = image.lookup("work")
    assert work is not None
    offset = image.vaddr_to_offset(work.value)
    assert offset is not None
    other_group = "kpt_other_tool"  # "another tool" owning a group with a plain name
    _append(f"p:{other_group}/ev {program}:{offset:#x}")
    try:
        with pytest.raises(TraceFsError, match="already exists"):
            Uprobes(path=str(program), group=other_group)
        assert (TRACEFS / "events" / other_group / "ev").exists()  # theirs is untouched
    finally:
        _append(f"-:{other_group}/ev")
    leftovers = [n for n in os.listdir(TRACEFS / "instances") if n.startswith("kprobes_")]
    assert not [n for n in leftovers if n.startswith(f"kprobes_{os.getpid()}")]


def test_kernel_target_on_this_kernel() -> None:
    if (TRACEFS / "kprobe_events").exists():
        with Kernel() as k:  # a kernel with kprobes: the target must simply work
            assert k.group.startswith("kprobes_")
        return
    with pytest.raises(TargetError) as info:
        Kernel()
    message = str(info.value)
    assert "built without CONFIG_KPROBES" in message
    assert "Uprobes" in message and "Process" in message
    assert "\n" not in message


def test_not_root_is_one_clear_line() -> None:
    code = (
        "import os\n"
        "from kprobes.errors import TargetError\n"
        "from kprobes.tracefs import Kernel, Uprobes\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "for make in (Kernel, lambda: Uprobes(path='/bin/true')):\n"
        "    try:\n"
        "        make()\n"
        "    except TargetError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("needs root" in line for line in lines), out.stdout


def test_specs_with_entry_times(start: Callable[..., Waiting]) -> None:
    """``place_spec(entry_times=True)``: a hidden entry event pairs each return with its call."""
    prog = start(3)
    got: list[Event] = []
    with Uprobes(pid=prog.pid, sink=got.append) as u:
        rp = u.place_spec(parse("r:done work ret=$retval:s64"), entry_times=True)
        kp = u.place_spec(parse("p work x=%di:s64"))
        assert u.iter_probes() == [rp, kp]  # the entry clock is not listed
        assert u.get_event_name(kp) == "p_work_0"  # the kernel's default name
        mine = [x for x in u.fs.iter_lines("uprobe_events") if f":{u.group}/" in x]
        assert len(mine) == 3  # done, its hidden entry clock, p_work_0
        prog.go()
        assert u.run(timeout=10) is True
        group = u.group
    returns = [e for e in got if e.is_return]
    entries = [e for e in got if not e.is_return]
    assert [e.event for e in got].count("done") == 3 and len(entries) == 3
    for entry, ret in zip(entries, returns, strict=True):
        # The hidden entry event fired with the visible one, before the function ran.
        assert abs(ret.entry_timestamp - entry.timestamp) < 1e-3
        assert 0 < ret.entry_timestamp <= ret.timestamp
    assert f"{group}/" not in (TRACEFS / "uprobe_events").read_text()


def test_data_symbols_are_read_through_file_offsets(start: Callable[..., Waiting]) -> None:
    """``@SYM`` is translated to the ``@+OFFSET`` uprobes accept (the kernel refuses names)."""
    prog = start(2)
    got: list[Event] = []
    with Uprobes(pid=prog.pid, sink=got.append) as u:
        u.add("p:calls work n=@ncalls:s64 first=+0(@names):string")
        line = next(x for x in u.fs.iter_lines("uprobe_events") if f"{u.group}/calls" in x)
        assert "n=@+" in line and "(@+" in line and "@ncalls" not in line
        prog.go()
        assert u.run(timeout=10) is True
    assert [e.arg("n") for e in got] == [0, 1]  # .bss, counted before the call
    assert [e.arg("first") for e in got] == ["hello world"] * 2


def test_return_sites_are_named_when_the_command_is_gone_before_it_is_read(
    program: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short command can run and exit before its mappings are read from /proc (about one
    ``trace -c 'target 4'`` in three printed ``0x55... <- work``): the return event gives the
    probed function's address, so its file's load bias, and the return address is named from
    that file's symbols. Here every read of /proc mappings fails, as for a process gone."""
    require_uprobe_events()

    def gone(pid: int) -> None:
        raise OSError(errno.ESRCH, "the process has exited")

    monkeypatch.setattr("kprobes.tracefs.uprobes.SymbolResolver", gone)
    got: list[Event] = []
    argv = ["/bin/sh", "-c", f"echo go | {program} 3"]
    with Uprobes(command=argv, sink=got.append) as u:
        u.register_kretprobe(Kretprobe(symbol=f"{program}:work"), ["ret=$retval:s64"])
        assert u.run(timeout=30) is True
    returns = [e for e in got if e.is_return]
    assert len(returns) == 3
    assert all(e.location.startswith("calls+0x") for e in returns), [e.location for e in got]


def test_a_signal_just_after_pages_are_read_loses_no_event(
    start: Callable[..., Waiting], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a page consumes it. Ctrl-C's exception, coming as the pages are read (here
    the read sends SIGINT itself), is raised once their events are kept, not between the
    read and the decoding: the next ``poll()`` (the command line's ending) delivers them."""
    from kprobes.tracefs.ringbuffer import CpuBuffers

    read_pages = CpuBuffers.read_pages
    sent = []

    def read_then_interrupt(self: CpuBuffers, max_pages: int = 256) -> list[tuple[int, bytes]]:
        pages = read_pages(self, max_pages)
        if pages and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return pages

    monkeypatch.setattr(CpuBuffers, "read_pages", read_then_interrupt)
    prog = start(3)
    got: list[ArgValue] = []
    # Python's own SIGINT handler (a test run in the background inherits SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Uprobes(pid=prog.pid) as u:
            probe = Kprobe(symbol="work", async_handler=lambda _p, e: got.append(e.arg("x")))
            u.register_kprobe(probe, ["x=%di:s64"])
            prog.go()
            with pytest.raises(KeyboardInterrupt):
                while not sent:
                    u.poll()
            assert got == [] and u.undelivered == 3
            assert u.poll() == 3
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == [0, 1, 2]
