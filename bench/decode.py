"""``python -m bench.decode``: decoded events per second, ring-buffer pages against trace_pipe text.

    python -m bench.decode [--events N] [--runs R] [--repeats K] [--cpu C] [--quick]
    python -m bench.decode --vm [...]    the kernel's kprobes, in a qemu guest (tests/vm/harness)

Two ways of getting the same events out of the kernel into Python ``Event`` values:

* ours: the per-CPU ``trace_pipe_raw`` pages of the session's instance, decoded by
  ``TraceTarget.decode_pages`` (``kprobes/tracefs/records.py``): what ``read_events()`` and
  ``poll()`` deliver;
* the peer: the ``trace_pipe`` text of a second instance recording the same event, parsed
  back into the same values (``bench/trace_text.py``).

On the host the event is a uprobe (``Uprobes(pid=)``) on ``decode_work`` of
``bench/decode_target.c`` with three fetch-args: an integer, a string, a hex integer. In the
guest (``--vm``; the host has no CONFIG_KPROBES) it is a kprobe (``Kernel()``) on
``do_sys_openat2`` with the same shapes, driven by the same program opening a file in a loop.
One run:

    Step 1  start the program (waiting), register the probe with a buffer big enough for N
            events, enable the same event in a second instance for the text peer
    Step 2  let the program make N events: both instances now hold the same records
    Step 3  ours, collection: every page, by ``read_pages()`` calls (at most 256 pages per
            CPU each, as ``read_events()`` reads them); timed once, the pages kept. They are
            decoded once, untimed, for the checks (which fills the per-thread caches, as the
            first events of a stream do)
    Step 4  ours, decoding: ``decode_pages`` on each of those batches, K times; a batch's
            events are dropped before the next is decoded, as a consuming handler would
    Step 5  peer, collection: ``trace_pipe`` read until empty (the kernel formats the text
            while it is read); timed once, the text kept
    Step 6  peer, parsing: that text into events, K times (all the text in one call)
    Step 7  check: ours are the values the program passed (on the host), and the peer's
            are ours; times are only checked to be in order and within Step 2, since each
            instance stamps its own copy of a record and the text rounds to the microsecond.
            On the guest only the program's own events are compared: both instances also
            record the opens this process makes after Step 2

Everything (this process and the program; with ``--vm``, qemu on the host and the two inside
the guest) runs on one CPU (``--cpu``, default 1). Events per
second = events decoded / seconds; "end to end" adds a path's median collection time and its
median decoding time, per event. Progress goes to stderr, the Markdown report to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType

from bench.build import BIN, BuildError, compile_c
from bench.trace_text import EventText, TextParser, read_trace_pipe, text_instance
from kprobes.core.probes import Kprobe
from kprobes.model import Event
from kprobes.tracefs import Kernel, Uprobes
from kprobes.tracefs.target import TraceTarget

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = "decode_target"
NAMES = ("alpha", "bravo-charlie", "/usr/lib/x86_64-linux-gnu/libc.so.6", "delta echo foxtrot")
UPROBE_ARGS = ("n=%di:s64", "s=+0(%si):string", "x=%dx:x32")
KPROBE_ARGS = ("dfd=%di:s32", "name=+0(%si):ustring", "flags=+0(%dx):x64")
OPENED = "/tmp/kpbench-decode-file"
RECORD_ROOM = 96  # buffer bytes to allow per event (records are 52-60 bytes, pages 4 KiB)


class CheckFailed(Exception):
    """The events decoded are not the events made: no figure is reported for the run."""


@dataclass(slots=True)
class Samples:
    """Seconds per repetition of one measured step, over every run."""

    seconds: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)

    def add(self, seconds: float, events: int) -> None:
        self.seconds.append(seconds)
        self.events.append(events)

    def rates(self) -> list[float]:
        return [n / s for n, s in zip(self.events, self.seconds, strict=True)]

    def per_event(self) -> float:
        """Median seconds per event."""
        return statistics.median(s / n for n, s in zip(self.events, self.seconds, strict=True))


@dataclass(slots=True)
class Results:
    setting: str
    event_line: str
    runs: int = 0
    events: int = 0
    pages: int = 0
    page_bytes: int = 0
    text_bytes: int = 0
    ours_collect: Samples = field(default_factory=Samples)
    ours_decode: Samples = field(default_factory=Samples)
    text_collect: Samples = field(default_factory=Samples)
    text_parse: Samples = field(default_factory=Samples)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--events", type=int, default=None, help="events per run (N)")
    parser.add_argument("--runs", type=int, default=None, help="runs, each a fresh capture (R)")
    parser.add_argument("--repeats", type=int, default=None, help="decodings per run (K)")
    parser.add_argument("--cpu", type=int, default=None, help="the CPU for everything")
    parser.add_argument("--quick", action="store_true", help="a small N, once: a smoke test")
    parser.add_argument("--vm", action="store_true", help="run in a qemu guest, on kprobes")
    parser.add_argument("--in-vm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    in_guest = args.in_vm or args.vm
    default_n = 50_000 if in_guest else 400_000
    args.events = args.events or (5_000 if args.quick else default_n)
    args.runs = args.runs or (1 if args.quick else 3)
    args.repeats = args.repeats or (1 if args.quick else (3 if in_guest else 5))
    if args.cpu is None:
        args.cpu = 1 if len(os.sched_getaffinity(0)) > 1 else 0
    if min(args.events, args.runs, args.repeats) < 1:
        parser.error("--events, --runs and --repeats must be positive")
    return args


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _timed_collection(target: TraceTarget) -> tuple[list[list[tuple[int, bytes]]], float]:
    """Step 3: every page, in the batches read_events() would have read."""
    batches = []
    started = time.perf_counter()
    while batch := target.read_pages():
        batches.append(batch)
    return batches, time.perf_counter() - started


def _timed_decoding(target: TraceTarget, batches: Sequence[Sequence[tuple[int, bytes]]]) -> float:
    """Step 4: one decoding of every batch, each batch's events dropped before the next."""
    decode = target.decode_pages
    events: list[Event] = []
    started = time.perf_counter()
    for batch in batches:
        events = decode(batch)
    seconds = time.perf_counter() - started
    del events
    return seconds


def _check_same(ours: list[Event], text: list[Event], span: tuple[float, float]) -> None:
    """Step 7, the peer: the same events but for the times, which are only checked to be in
    order and within ``span`` (CLOCK_MONOTONIC around Step 2, the instances' trace clock).
    Each instance stamps its own copy of a record, one after the other, and the text rounds
    to the microsecond."""
    if len(ours) != len(text):
        raise CheckFailed(f"{len(ours)} events decoded, {len(text)} parsed from the text")
    for events in (ours, text):
        times = [e.timestamp for e in events]
        if times != sorted(times) or not span[0] - 1e-6 <= times[0] <= times[-1] <= span[1]:
            raise CheckFailed(f"times out of order or outside {span}: {times[0]}, {times[-1]}")
    for a, b in zip(ours, text, strict=True):
        if a._replace(timestamp=0.0) != b._replace(timestamp=0.0):
            raise CheckFailed(f"decoded {a}\nparsed  {b}")


def _start_program(argv: list[str], cpu: int) -> subprocess.Popen[bytes]:
    prog = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert prog.stderr is not None
    if prog.stderr.readline() != b"ready\n":
        prog.kill()
        raise CheckFailed(f"{argv[0]} did not start: {prog.communicate()[1]!r}")
    os.sched_setaffinity(prog.pid, {cpu})
    return prog


def _reap(prog: subprocess.Popen[bytes]) -> None:
    prog.kill()
    prog.wait()


def _finish_program(prog: subprocess.Popen[bytes], n: int) -> None:
    out, err = prog.communicate(b"go\n", timeout=600)
    if prog.returncode != 0 or out.decode().strip() != f"calls={n}":
        raise CheckFailed(f"the program failed ({prog.returncode}): {err.decode()}")


def one_run(args: argparse.Namespace, results: Results, kernel: bool) -> None:
    n, cpu = args.events, args.cpu
    program = str(BIN / PROGRAM)
    buffer_kb = max(2048, n * RECORD_ROOM // 1024)
    # Step 1: the program, the probe, and the second instance for the peer.
    with contextlib.ExitStack() as undo:
        target: TraceTarget
        if kernel:
            with open(OPENED, "w"):
                pass
            prog = _start_program([program, "open", str(n), OPENED], cpu)
            undo.callback(_reap, prog)
            target = undo.enter_context(Kernel(buffer_kb=buffer_kb))
            kp, fetch = Kprobe(symbol="do_sys_openat2"), KPROBE_ARGS
        else:
            prog = _start_program([program, "call", str(n)], cpu)
            undo.callback(_reap, prog)
            target = undo.enter_context(Uprobes(pid=prog.pid, buffer_kb=buffer_kb))
            kp, fetch = Kprobe(symbol="decode_work"), UPROBE_ARGS
        target.register_kprobe(kp, fetch)
        event = target.get_event_name(kp)
        assert event is not None and kp.location is not None
        results.event_line = f"p:{target.group}/{event} {kp.location.display} {' '.join(fetch)}"
        peer = text_instance(
            target.fs, f"kpbench_text_{os.getpid()}", f"{target.group}/{event}", buffer_kb=buffer_kb
        )
        text_pipe = undo.enter_context(peer)
        # Step 2: the events.
        span = (time.monotonic(), 0.0)
        _finish_program(prog, n)
        span = (span[0], time.monotonic())
        # Step 3 and 4: ours.
        batches, seconds = _timed_collection(target)
        ours = [e for batch in batches for e in target.decode_pages(batch)]  # checked below
        if target.lost:
            raise CheckFailed(f"the kernel lost {target.lost} events: the buffer was too small")
        results.ours_collect.add(seconds, len(ours))
        for _ in range(args.repeats):
            results.ours_decode.add(_timed_decoding(target, batches), len(ours))
        # Step 5 and 6: the peer.
        started = time.perf_counter()
        text = read_trace_pipe(text_pipe)
        seconds = time.perf_counter() - started
        parser = TextParser(
            target.group,
            {
                event: EventText(
                    arg_names=tuple(a.name for a in ours[0].args),
                    arg_types=tuple(a.type for a in ours[0].args),
                    location=kp.location.describe,
                    ip=kp.addr or 0,
                )
            },
            who=lambda tid: (target.tasks.tgid(tid) or tid, ""),
        )
        parsed = parser.parse(text)
        results.text_collect.add(seconds, len(parsed))
        for _ in range(args.repeats):
            started = time.perf_counter()
            parser.parse(text)
            results.text_parse.add(time.perf_counter() - started, len(parsed))
        # Step 7: the checks.
        if kernel:
            mine = [e for e in ours if e.pid == prog.pid]
            if sum(e.arg("name") == OPENED for e in mine) != n:
                raise CheckFailed(f"{len(mine)} events of the program, {n} opens of {OPENED}")
            # Both instances also recorded this process's own opens: compare what both have.
            _check_same(mine, [e for e in parsed if e.pid == prog.pid], span)
        else:
            _check_program_values(ours, prog.pid, cpu, n)
            _check_same(ours, parsed, span)
        results.runs += 1
        results.events += len(ours)
        results.pages += sum(len(b) for b in batches)
        results.page_bytes += sum(len(p) for b in batches for _, p in b)
        results.text_bytes += len(text)


def _check_program_values(events: list[Event], pid: int, cpu: int, n: int) -> None:
    """Step 7, ours: decode_work(i, NAMES[i % 4], 3 * i) for i in 0..N-1, in order."""
    if len(events) != n:
        raise CheckFailed(f"{len(events)} events decoded, {n} calls made")
    for i, e in enumerate(events):
        want = (i, NAMES[i % 4], (3 * i) & 0xFFFFFFFF)
        got = tuple(a.value for a in e.args)
        if got != want or (e.pid, e.tid, e.cpu, e.comm) != (pid, pid, cpu, PROGRAM):
            raise CheckFailed(f"event {i}: {e}")


# -- the report ---------------------------------------------------------------------------------


def _rate(rate: float) -> str:
    if rate >= 1e6:
        return f"{rate / 1e6:.3g}M"
    return f"{rate / 1e3:.3g}k"


def _cell(samples: Samples) -> str:
    rates = samples.rates()
    if len(rates) == 1:
        return f"{_rate(rates[0])}/s"
    return f"{_rate(statistics.median(rates))}/s ({_rate(min(rates))} to {_rate(max(rates))})"


def _machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{os.cpu_count()} CPUs, {model or platform.machine()}, kernel {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def render(results: Results, args: argparse.Namespace) -> str:
    ours_e2e = results.ours_collect.per_event() + results.ours_decode.per_event()
    text_e2e = results.text_collect.per_event() + results.text_parse.per_event()
    per_run = results.events // max(results.runs, 1)
    decoding = results.text_parse.per_event() / results.ours_decode.per_event()
    lines = [
        f"### Decoded events per second: {results.setting}",
        "",
        f"Machine: {_machine()}. Everything pinned to CPU {args.cpu}. {results.runs} runs x "
        f"{per_run:,} events; decoding and parsing repeated {args.repeats} times per run. "
        f"Event: `{results.event_line}`. Per run: {results.pages // max(results.runs, 1):,} "
        f"pages ({results.page_bytes / max(results.runs, 1) / 2**20:.1f} MiB) against "
        f"{results.text_bytes / max(results.runs, 1) / 2**20:.1f} MiB of text.",
        "",
        "| path | collection | decoding / parsing | end to end |",
        "|---|---|---|---|",
        f"| **ours**: `trace_pipe_raw` pages → `Event` | {_cell(results.ours_collect)} | "
        f"**{_cell(results.ours_decode)}** | **{_rate(1 / ours_e2e)}/s** "
        f"({ours_e2e * 1e9:.0f} ns an event) |",
        f"| peer: `trace_pipe` text → `Event` | {_cell(results.text_collect)} | "
        f"{_cell(results.text_parse)} | {_rate(1 / text_e2e)}/s ({text_e2e * 1e9:.0f} ns "
        "an event) |",
        "",
        f"Ours ÷ peer, events per second: decoding {decoding:.2f}x, end to end "
        f"{text_e2e / ours_e2e:.2f}x. Medians (min to max) over every repetition; end to end "
        "= median collection + median decoding, per event.",
        "",
    ]
    return "\n".join(lines)


# -- the guest ----------------------------------------------------------------------------------


def _harness() -> ModuleType:
    """tests/vm/harness.py (standard library only), loaded by path."""
    path = ROOT / "tests" / "vm" / "harness.py"
    spec = importlib.util.spec_from_file_location("kprobes_vm_harness", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_in_vm(args: argparse.Namespace) -> int:
    harness = _harness()
    python = ROOT / ".venv" / "bin" / "python"
    argv = [
        str(python if python.exists() else sys.executable),
        "-m", "bench.decode", "--in-vm",
        "--events", str(args.events), "--runs", str(args.runs),
        "--repeats", str(args.repeats), "--cpu", str(args.cpu),
    ]  # fmt: skip
    _progress(f"booting the guest for: {' '.join(argv[1:])}")
    try:
        result = harness.run(argv, cwd=ROOT, timeout=1800)
    except harness.VmError as exc:
        print(f"bench.decode --vm: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(result.output)
    if result.returncode == 0:
        print(
            f'qemu (`-accel tcg -smp 2`) ran pinned to host CPU {args.cpu}; "CPU" above is '
            "the guest's. The guest's CPU is emulated in software: its figures show the ratio "
            "of the two paths, not what a real CPU does.\n"
        )
    if result.returncode != 0:
        sys.stderr.write(result.console[-3000:])
    _progress(f"guest: exit {result.returncode} after {result.seconds:.0f} s")
    return 0 if result.returncode == 0 else 1


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the sessions' and instances' cleanup


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    try:
        compile_c(PROGRAM)  # before the guest starts: its view of the checkout is read-only
    except BuildError as exc:
        if not args.in_vm:
            print(exc, file=sys.stderr)
            return 1
    os.sched_setaffinity(0, {args.cpu})  # with --vm, qemu's threads inherit it
    if args.vm:
        return run_in_vm(args)
    kernel = args.in_vm
    setting = (
        "the kernel's kprobes, in a qemu TCG guest (software-emulated CPU)"
        if kernel
        else "the kernel's uprobes, on the host"
    )
    results = Results(setting=setting, event_line="")
    for run in range(args.runs):
        _progress(f"run {run + 1}/{args.runs}: {args.events:,} events")
        try:
            one_run(args, results, kernel)
        except CheckFailed as exc:
            print(f"bench.decode: run {run + 1}: {exc}", file=sys.stderr)
            return 1
    print(render(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
