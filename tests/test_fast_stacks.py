"""User stacks walked in the program by record detours (issue 23, item 5), against the trap
tier's unwinder, on the same programs and the same call paths.

Through the library's ``SpecTracer(stack_depth=N, fast_stacks=True)``: an entry spec stays
a record probe, its site jump-optimized, and its detour walks the thread's stack over the
compact frame tables that process/fast/frametables.py keeps in the program. Each program
is run twice, once so and once on traps (``optimize=False``, the way ``trace -U`` runs
today), and the stacks of the hits must be the same, frame for frame (named
``func+0xOFF/0xSIZE [module]``, addresses aside: each run has its own layout), with the
same marker where a walk stops short. Programs at -O2 without frame pointers (stacks.c
through libstk.so, frames.c's rbp frames and recursion), one without unwind tables for its
own code (the marker), libraries that come and go with ``dlopen``/``dlclose`` (the
directory followed), and zstd's ``libc:malloc`` up to zstd's main.

A frame hooked by a return probe that takes a jump is walked through (the real return
address is in the thread's shadow stack), and the return records carry the caller's
stack; one hooked by a return probe on traps ends the stack with a marker, a prefix of
the trap tier's stack.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import run_main as kprobes
from support import threads_of

from kprobes import Kretprobe
from kprobes.model import Event, UserStack
from kprobes.process.specs import SpecTracer
from kprobes.spec import parse

pytestmark = pytest.mark.ptrace

Build = Callable[[str], Path]
DEPTH = 127


def frames_of(stack: UserStack) -> tuple[str, ...]:
    """The frames as text, a stripped file's addresses as ``[module]`` (they move)."""
    out = []
    for f in stack.frames:
        out.append(f.text if f.func else f"[{f.module or 'program'}]")
    return (*out, stack.marker)


def traced(
    spawn: Callable[..., Any],
    argv: list[Any],
    spec: str,
    *,
    fast: bool,
    before: Callable[[Any], None] | None = None,
) -> tuple[list[Event], bool]:
    """The events of ``spec`` over a run of ``argv`` with stacks, on the fast tier or on
    traps; and whether the probe's site took a jump."""
    with open(os.devnull, "wb") as devnull:
        proc = spawn(argv, stdout=devnull)
    if before is not None:
        before(proc)
    events: list[Event] = []
    recording: list[bool] = []  # at each event: some site writes records (a jump)

    def sink(event: Event) -> None:
        events.append(event)
        recording.append(proc.records.is_recording)

    tracer = SpecTracer(proc, sink, optimize=fast, stack_depth=DEPTH, fast_stacks=fast)
    (placed,) = tracer.place([parse(f"p {spec}")])
    assert proc.run(timeout=120) and proc.exit_code == 0
    proc.records.read_records()
    tracer.close()
    assert placed.hits == len(events)
    return events, bool(recording) and all(recording)


def both(spawn: Any, argv: list[Any], spec: str, **kw: Any) -> tuple[list[Event], list[Event]]:
    """The events of a fast run (its sites optimized: every event a record's) and of a run
    on traps."""
    fast, optimized = traced(spawn, argv, spec, fast=True, **kw)
    assert optimized, "the sites must take a jump"
    trap, _ = traced(spawn, argv, spec, fast=False, **kw)
    assert all(e.stack is not None for e in fast + trap)
    return fast, trap


def stacks(events: list[Event]) -> Counter[tuple[str, ...]]:
    return Counter(frames_of(e.stack) for e in events if e.stack is not None)


@pytest.mark.parametrize("name", ["stacks", "stacks-fp"])
def test_known_paths_through_a_library(spawn: Any, build: Build, name: str) -> None:
    fast, trap = both(spawn, [build(name)], "leaf")
    assert len(fast) == len(trap) == 10
    assert stacks(fast) == stacks(trap)
    assert all(e.stack is not None and e.stack.stop == "" for e in fast)
    paths = Counter(tuple(f.func for f in e.stack.frames[:3]) for e in fast if e.stack)
    assert paths == {("leaf", "a", "main"): 3, ("leaf", "b", "main"): 5,
                     ("leaf", "stk_through", "main"): 2}  # fmt: skip
    through = [e.stack for e in fast if e.stack and e.stack.frames[1].func == "stk_through"]
    assert all(s.frames[1].module == "libstk.so" for s in through)


def test_rbp_frames_and_recursion(spawn: Any, build: Build) -> None:
    for spec in ("deep", "grow"):
        fast, trap = both(spawn, [build("frames")], spec)
        assert stacks(fast) == stacks(trap), spec
        assert all(e.stack is not None and e.stack.stop == "" for e in fast)


def test_a_walk_that_cannot_go_on_ends_with_the_trap_tier_s_marker(
    spawn: Any, build: Build
) -> None:
    fast, trap = both(spawn, [build("stacks-nocfi")], "leaf")
    assert stacks(fast) == stacks(trap)
    assert {e.stack.stop for e in fast if e.stack} == {"no unwind info"}


def test_the_depth_limit(spawn: Any, build: Build) -> None:
    with open(os.devnull, "wb") as devnull:
        proc = spawn([build("frames")], stdout=devnull)
    events: list[Event] = []
    tracer = SpecTracer(proc, events.append, optimize=True, stack_depth=3, fast_stacks=True)
    tracer.place([parse("p deep")])
    assert proc.run(timeout=120) and proc.exit_code == 0
    proc.records.read_records()
    tracer.close()
    assert len(events) == 15
    for e in events:
        assert e.stack is not None and len(e.stack.frames) == 3
        assert e.stack.stop == "depth limit"


def test_libraries_that_come_and_go(spawn: Any, build: Build) -> None:
    """plughost dlopens libplug.so, calls it and dlcloses it, round after round: the
    directory in the program follows (the pending probe goes in at each dlopen)."""
    lib = build("libplug.so")
    argv = [build("plughost"), str(lib), "3", "4"]
    fast, trap = both(spawn, argv, "libplug.so:plug_work")
    assert len(fast) == len(trap) == 3 * (1 + 4)  # the constructor's call, then the host's
    assert stacks(fast) == stacks(trap)
    assert all(e.stack is not None and e.stack.stop == "" for e in fast)
    from_main = [e.stack for e in fast if e.stack and e.stack.frames[1].func == "main"]
    assert len(from_main) == 3 * 4


def test_a_frame_hooked_by_a_return_probe_that_takes_a_jump_is_walked_through(
    spawn: Any, build: Build
) -> None:
    """``main``'s return address is its fast return probe's trampoline while ``leaf`` runs:
    the walk takes the real one from the thread's shadow stack and goes on, as the trap
    tier's unwinder does, and no frame is a trampoline."""

    def hook(proc: Any) -> None:
        rp = Kretprobe(symbol="main", optimize=True)
        proc.register_kretprobe(rp)
        (entry,) = [e for e in proc.list() if e.addr == rp.addr]
        assert entry.is_optimized, entry.why_not_optimized

    fast, optimized = traced(spawn, [build("stacks")], "leaf", fast=True, before=hook)
    assert optimized
    trap, _ = traced(spawn, [build("stacks")], "leaf", fast=False)
    assert stacks(fast) == stacks(trap) and len(fast) == 10
    assert all(e.stack is not None and e.stack.frames[-1].func == "_start" for e in fast)


def test_a_frame_hooked_by_a_return_probe_on_traps_ends_the_walk(spawn: Any, build: Build) -> None:
    """``a``'s return address is a trap-tier trampoline's while ``leaf`` runs under it (its
    real one is in the tool): the fast stack stops there with a marker, a prefix of the
    trap tier's; ``b``'s is whole."""

    def hook(proc: Any) -> None:
        proc.register_kretprobe(Kretprobe(symbol="a", maxactive=4, handler=lambda *_: None))

    fast, trap = both(spawn, [build("stacks")], "leaf", before=hook)
    whole = {frames_of(e.stack) for e in trap if e.stack}
    for e in fast:
        assert e.stack is not None
        if e.stack.frames[1].func == "a":
            assert e.stack.stop == "no unwind info"
            texts = frames_of(e.stack)[:-1]
            assert any(w[: len(texts)] == texts for w in whole)
        else:
            assert frames_of(e.stack) in whole


def test_a_real_program_reaches_its_main(spawn: Any, tmp_path: Path) -> None:
    zstd = shutil.which("zstd")
    assert zstd is not None, "scripts/ensure-system-deps installs zstd"
    data = tmp_path / "data"
    data.write_bytes(b"".join(b"%d kprobes stacks\n" % i for i in range(20000)))
    argv = [zstd, "-q", "-f", "-o", tmp_path / "data.zst", data]
    fast, trap = both(spawn, argv, "libc:malloc")
    assert len(fast) >= 10
    assert stacks(fast) == stacks(trap)
    assert all(e.stack is not None and e.stack.stop == "" for e in fast)
    main_thread = [
        e for e in fast if e.stack and any(f.func == "__libc_start_main" for f in e.stack.frames)
    ]
    assert len(main_thread) >= len(fast) // 2


# -- the command line --------------------------------------------------------------------------


def stack_blocks(out: str) -> Counter[tuple[str, ...]]:
    """Each ``<user stack trace>`` block's frame lines (a frame without a symbol is its
    address, which each run's layout moves: ``ADDR``)."""
    blocks = re.split(r"\n(?=\s+\S+-\d+\s+\[)", out)
    return Counter(
        tuple(
            re.sub(r"^ => 0x[0-9a-f]+", " => ADDR", line)
            for line in b.splitlines()[1:]
            if line.startswith(" => ")
        )
        for b in blocks
        if b.splitlines() and b.splitlines()[0].endswith("<user stack trace>")
    )


def test_trace_u_walks_in_the_program_and_prints_what_traps_print(build: Build) -> None:
    program = build("stacks")
    fast_out, fast_err = kprobes("trace", "-U", "-c", program, "leaf")
    trap_out, trap_err = kprobes("trace", "-U", "--no-optimize", "-c", program, "leaf")
    assert "breakpoint" not in fast_err and "breakpoint" not in trap_err
    assert sum(stack_blocks(fast_out).values()) == 10
    assert stack_blocks(fast_out) == stack_blocks(trap_out)


def test_trace_u_with_return_specs_walks_through_their_frames(build: Build) -> None:
    # main's frame is hooked by 'r main' (its entry takes a jump) while leaf runs under it:
    # each stack, leaf's entries' and leaf's returns', goes on past it to libc's callers.
    program = build("stacks")
    specs = ("leaf", "r main", "r leaf")
    fast_out, fast_err = kprobes("trace", "-U", "-c", program, *specs)
    trap_out, trap_err = kprobes("trace", "-U", "--no-optimize", "-c", program, *specs)
    assert "breakpoint" not in fast_err and "breakpoint" not in trap_err
    assert sum(stack_blocks(fast_out).values()) == 21  # 10 entries, 10 returns, main's
    assert stack_blocks(fast_out) == stack_blocks(trap_out)
    assert all(block[-1].startswith(" => _start+") for block in stack_blocks(fast_out))
    # 'r a' keeps its breakpoint (a call in its region): a walk in the program could not
    # go through a's frames, so every probe goes back to breakpoints, and stderr says why.
    out, err = kprobes("trace", "-U", "-c", program, "leaf", "r a")
    assert "a return probe keeps its breakpoint" in err and err.count("kprobes:") == 1, err
    assert all(block[-1].startswith(" => _start+") for block in stack_blocks(out))


def test_record_u_keeps_the_walks_and_script_prints_them(build: Build, tmp_path: Path) -> None:
    # The stacks go to the file as the records lie (the walks' return addresses, no
    # event), with the files mapped; script names them as trace -U does on traps.
    from kprobes.output.recfile import END, EVNT, MODS, iter_chunks

    program, data = build("stacks"), tmp_path / "stacks.data"
    specs = ("leaf", "r main", "r leaf")
    _, err = kprobes("record", "-U", "-o", data, "-c", program, *specs)
    assert "breakpoint" not in err, err
    with open(data, "rb") as f:
        chunks = list(iter_chunks(f))
    assert not [c for c in chunks if c.tag == EVNT]  # every hit a record of the ring
    (end,) = [c.json() for c in chunks if c.tag == END]
    assert end["records"] == end["hits"] == 21
    mods = [c.json() for c in chunks if c.tag == MODS]
    assert mods and all(m["main"] == str(program) for m in mods)
    script, _ = kprobes("script", data)
    trap, _ = kprobes("trace", "-U", "--no-optimize", "-c", program, *specs)
    assert sum(stack_blocks(script).values()) == 21
    assert stack_blocks(script) == stack_blocks(trap)


def test_trace_json_stack_on_the_fast_tier(build: Build) -> None:
    program = build("stacks")
    fast, _ = kprobes("trace", "-U", "--json", "-c", program, "leaf")
    trap, _ = kprobes("trace", "-U", "--json", "--no-optimize", "-c", program, "leaf")

    def stacks_in(out: str) -> Counter[str]:
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return Counter(
            json.dumps(
                ([(f["func"], f["offset"], f["module"]) for f in r["stack"]], r.get("stack_stop"))
            )
            for r in records
        )

    assert sum(stacks_in(fast).values()) == 10
    assert stacks_in(fast) == stacks_in(trap)


@pytest.mark.filterwarnings("ignore:pending probe work stays pending")  # true has no work
def test_an_exec_gets_tables_of_its_own(spawn: Any, build: Build) -> None:
    """passon runs ``work`` 3 times and execs itself, which runs it twice and execs true:
    the new image's walks use tables made for it (the old image's went with it)."""
    passon = str(build("passon"))
    fast, trap = both(spawn, [passon, "3", passon, "2", "/bin/true"], "work")
    assert len(fast) == len(trap) == 5
    assert stacks(fast) == stacks(trap)
    assert all(e.stack is not None and e.stack.stop == "" for e in fast)
    assert all([f.func for f in e.stack.frames[:2]] == ["work", "main"] for e in fast if e.stack)


def test_threads_each_walk_their_own_stack(spawn: Any, build: Build) -> None:
    """busy's main thread and three pthreads call ``rec`` recursively: each record's stack
    is its own thread's, to main or through libc's start_thread to clone3."""
    fast, trap = both(spawn, [build("busy"), "4", "5", "3"], "rec")
    assert len(fast) == len(trap) == 4 * 5 * 4
    assert stacks(fast) == stacks(trap)
    assert all(e.stack is not None and e.stack.stop == "" for e in fast)
    by_thread = Counter(e.tid for e in fast)
    assert len(by_thread) == 4 and set(by_thread.values()) == {5 * 4}
    depths = Counter(sum(f.func == "rec" for f in e.stack.frames) for e in fast if e.stack)
    assert depths == {1: 20, 2: 20, 3: 20, 4: 20}


def test_a_process_attached_to_while_it_runs(build: Build) -> None:
    """Attached after its libraries are all in: the first walk's tables cover them at once."""
    import kprobes as api

    def run(fast: bool) -> list[Event]:
        prog = subprocess.Popen([build("stacks"), "gated"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)  # fmt: skip
        assert prog.stdin is not None
        try:
            with api.attach(prog.pid) as proc:
                events: list[Event] = []
                tracer = SpecTracer(
                    proc, events.append, optimize=fast, stack_depth=DEPTH, fast_stacks=fast
                )
                tracer.place([parse("p leaf")])
                prog.stdin.write(b"go\n")
                prog.stdin.close()
                assert proc.run(timeout=120), threads_of(proc)
                proc.records.read_records()
                tracer.close()
        finally:
            if prog.poll() is None:
                prog.kill()
            prog.wait()
        return events

    fast, trap = run(True), run(False)
    assert len(fast) == len(trap) == 10
    assert stacks(fast) == stacks(trap)
    assert all(e.stack is not None and e.stack.stop == "" for e in fast)


def test_a_site_that_keeps_its_breakpoint_unwinds_there(spawn: Any, build: Build) -> None:
    """With optimization off, the record probes of ``fast_stacks`` run at their traps: the
    stacks are the trap tier's own."""

    def off(proc: Any) -> None:
        proc.optimization = False

    fast, on_jumps = traced(spawn, [build("stacks")], "leaf", fast=True, before=off)
    trap, _ = traced(spawn, [build("stacks")], "leaf", fast=False)
    assert not on_jumps
    assert len(fast) == 10 and stacks(fast) == stacks(trap)


def test_a_clean_end_gives_the_tables_back(build: Build) -> None:
    """The tables' mappings are pages of ours: a detach unmaps them with the others."""
    import kprobes as api

    prog = subprocess.Popen([build("stacks"), "gated"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    assert prog.stdin is not None
    try:
        proc = api.attach(prog.pid)
        events: list[Event] = []
        tracer = SpecTracer(proc, events.append, optimize=True, stack_depth=DEPTH, fast_stacks=True)
        tracer.place([parse("p leaf")])
        prog.stdin.write(b"go\n")
        prog.stdin.flush()
        while len(events) < 10:
            proc.run(timeout=0.2)
        regions = list(proc._jumps.tables.regions)
        assert regions
        tracer.close()
        proc.close()
        with open(f"/proc/{prog.pid}/maps") as f:
            starts = {int(line.split("-")[0], 16) for line in f}
        assert not starts & {start for start, _ in regions}
        prog.stdin.close()
        assert prog.wait(timeout=60) == 0
    finally:
        if prog.poll() is None:
            prog.kill()
        prog.wait()
