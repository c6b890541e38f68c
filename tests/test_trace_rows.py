"""``trace``'s fast reader: records decoded and formatted a batch at a time (issue 21).

Each test runs ``kprobes trace`` through the command line's ``main()`` in this process on
the test program's hot loop, its probes jump-optimized (record probes):

- every event of a 200,000-call loop is there, in order, or counted as dropped (and of a
  700,000-call loop, whose records lap the ring);
- the batch path's bytes are the per-event path's bytes for the *same records*: each block
  the reader takes from the ring is also handed, record by record, to the per-event path
  (``Event`` values, ``format_event``/``format_json``), and the two outputs are compared
  whole, over many fetch types (registers cut to s64/u32/x64/s8/char/bitfield, an immediate,
  ``$comm``, a string, a byte array, a faulting read);
- ``--filter`` on the batch path keeps what the sink keeps, and counts the rest;
- options the batch path does not cover (``-n``) still print through the handlers;
- lines of plain values are read as columns (process/fast/columns.py) where they can be, with
  the same bytes: one thread's dense runs, four threads' runs interleaved in the ring,
  returns, and ``script`` of a record file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import run_main as kprobes

from kprobes.cli.session import Session, event_fields, parse_spec
from kprobes.output.jsonl import format_json
from kprobes.output.text import format_event
from kprobes.process.fast import batch as batch_mod
from kprobes.process.fast import columns as columns_mod
from kprobes.process.fast import reader as reader_mod
from kprobes.process.fast.interleave import Interleaved
from kprobes.process.fast.reader import RingReader

pytestmark = pytest.mark.ptrace

SUMMARY = re.compile(r"(\d+) events, (\d+) hits, (\d+) missed, (\d+) dropped")


@pytest.fixture
def target(build: Any) -> Path:
    return build("target")


@pytest.mark.parametrize(
    ("as_json", "calls"),
    [(False, 200_000), (True, 200_000), (False, 700_000)],
    ids=["text", "json", "text-past-the-ring"],  # 700,000 > the ring's 524,288: it laps
)
def test_every_event_of_a_hot_loop_in_order(target: Path, as_json: bool, calls: int) -> None:
    out, err = kprobes(
        "trace", *(["--json"] if as_json else []), "-c", f"{target} {calls}", "p work i=%di:u64"
    )
    if as_json:
        values = [json.loads(line)["args"]["i"] for line in out.splitlines()]
    else:
        values = [int(line.rpartition(" i=")[2]) for line in out.splitlines()]
    m = SUMMARY.search(err)
    assert m is not None, err
    events, hits, _, dropped = map(int, m.groups())
    assert hits == calls and events == len(values)
    assert values == sorted(values) and len(set(values)) == len(values)  # in order, once each
    assert values[0] >= 0 and values[-1] <= calls - 1
    assert calls - len(values) == dropped  # a gap only where the summary says drops


SPECS = (
    r"p work a=%di:s64 b=%di:u32 c=%di d=%di:s8 e=%di:char f=%di:b4@2/32 h=%di:x16 k=\7"
    " n=$comm x=%di:s32 g=+0(%di):u8",  # g: address i, which faults
    "p show s=+0(%di):string bytes=+0(%di):u8[4]",
    "p compute x=%di:s32",  # keeps its breakpoint (a ret in its first 5 bytes): a trap event
)


def tee_blocks(monkeypatch: pytest.MonkeyPatch, record: Callable[[Any, Any], None]) -> list[int]:
    """Each block the reader takes is also handed, record by record, to the per-event path,
    whose events go to ``record`` (the probes taking the records lend it their handler); the
    list's one item counts the runs the batch path took."""
    batched_runs = [0]
    deliver_block = RingReader._deliver_block

    def both(self: RingReader, block: Any) -> None:
        saved = {}
        for rs in self.sites.values():
            for probe in reader_mod.record_targets(rs):  # a return probe takes its returns'
                saved[probe] = probe.async_handler
                probe.async_handler = record
        try:
            for one in block.records():
                self._deliver(one)
        finally:
            for probe, handler in saved.items():
                probe.async_handler = handler
        batched_runs[0] += sum(
            not run.has_regs and self._batcher(run.probe, run.slots) is not None
            for run in block.runs
        )
        deliver_block(self, block)

    monkeypatch.setattr(RingReader, "_deliver_block", both)
    return batched_runs


def both_paths(
    target: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool, *extra: str
) -> tuple[str, str, list[str], int]:
    """``trace`` of SPECS on a 3000-call run, each block the reader takes also handed,
    record by record, to the per-event path (its lines, filtered as the session's sink
    would, kept apart): (stdout, stderr, the per-event lines, runs the batch path took)."""
    per_event: list[str] = []
    fmt = format_json if as_json else format_event
    keep = Session._compile_filter(extra[1] if extra else None, [parse_spec(t) for t in SPECS])

    def record(_kp: Any, ev: Any) -> None:
        if keep is None or keep(event_fields(ev)):
            per_event.append(fmt(ev) + "\n")

    batched_runs = tee_blocks(monkeypatch, record)
    json_flag = ["--json"] if as_json else []
    out, err = kprobes("trace", *json_flag, *extra, "-c", f"{target} 3000", *SPECS)
    return out, err, per_event, batched_runs[0]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_batches_print_the_bytes_the_handlers_print(
    target: Path, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _, per_event, batched_runs = both_paths(target, monkeypatch, as_json)
    assert batched_runs >= 2  # both record probes went the batch way
    assert len(per_event) == 3001
    trap = [line for line in out.splitlines(keepends=True) if "p_compute_0" in line]
    assert len(trap) == 1  # between work's events and show's, as the program made them
    assert out == "".join(per_event[:3000]) + trap[0] + per_event[3000]
    assert "(fault)" in out or "null" in out
    assert '"hello kprobes"' in out


FILTER = 'a < 100 || a >= 2990 || s ~ "hell*" || x == 7'


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_filter_on_the_batch_path_keeps_what_the_sink_keeps(
    target: Path, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err, per_event, batched_runs = both_paths(target, monkeypatch, as_json, "--filter", FILTER)
    assert batched_runs >= 2
    assert len(per_event) == 100 + 10 + 1
    trap = [line for line in out.splitlines(keepends=True) if "p_compute_0" in line]
    assert len(trap) == 1
    assert out == "".join(per_event[:110]) + trap[0] + per_event[110]
    assert "112 printed, 2890 filtered out" in err  # the sink's counts, too


def test_max_events_keeps_the_handlers_path(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    plan_decoder = batch_mod.plan_decoder  # the reader imports it on its first batch

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(args[0])
        return plan_decoder(*args, **kwargs)

    monkeypatch.setattr(batch_mod, "plan_decoder", spy)
    out, err = kprobes("trace", "-n", "5", "-c", f"{target} 1000", "p work i=%di:u32")
    assert [line.rpartition("=")[2] for line in out.splitlines()] == list(map(str, range(5)))
    assert made == [] and "5 events" in err


# -- records of returns (issue 20): written by the trampoline, decoded a batch at a time ---

RETURN_SPECS = {
    "rec 300": (
        r"r rec a=$retval:s64 b=$retval:u32 c=%ax d=$retval:s8 e=$retval:char"
        r" f=$retval:b4@2/32 h=%bx:x16 k=\7 n=$comm m=$arg1:s16 w=%ip g=+0($retval):u8"
    ),  # g: a small number as an address, which faults; w: the caller
    "names 300": "r name_of s=+0($retval):string bytes=+0($retval):u8[4] i=$arg1:u8",
    # every argument register, kept by the entry: six words of the shadow entry
    "mix 300": "r mix r=$retval:s64 a=$arg1:s64 b=$arg2:s8 c=$arg3 d=$arg4:u16 e=$arg5 f=$arg6:s32",
}


def both_paths_of_returns(
    rets: Path, command: str, monkeypatch: pytest.MonkeyPatch, as_json: bool, *specs: str
) -> tuple[str, list[str], int]:
    """``trace`` of ``command``'s return spec (or of ``specs``), each block also handed,
    record by record, to the per-event path (``Event`` values,
    ``format_event``/``format_json``): (the trace's lines, the per-event lines, runs the
    batch path took)."""
    per_event: list[str] = []
    fmt = format_json if as_json else format_event

    def record(_rp: Any, ev: Any) -> None:
        per_event.append(fmt(ev) + "\n")

    batched_runs = tee_blocks(monkeypatch, record)
    json_flag = ["--json"] if as_json else []
    specs = specs or (RETURN_SPECS[command],)
    out, err = kprobes("trace", *json_flag, "-c", f"{rets} {command}", *specs)
    assert "uses a breakpoint" not in err  # the entry took its jump: returns are records
    return out, per_event, batched_runs[0]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("command", RETURN_SPECS, ids=["values", "memory", "entry-args"])
def test_batches_of_returns_print_the_bytes_the_handlers_print(
    build: Any, command: str, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, per_event, batched_runs = both_paths_of_returns(
        build("rets"), command, monkeypatch, as_json
    )
    assert batched_runs >= 1  # the return probe's records went the batch way
    assert len(per_event) == 301 if command == "rec 300" else 300
    assert out == "".join(per_event)
    if command == "rec 300":
        assert ("<- rec) a=0 " in out or '"func": "rec"' in out) and "main+" in out
    elif command == "names 300":
        assert '"three"' in out
    else:  # mix(299, -299, 598, 299 ^ 5, 7, 701)
        assert "f=701" in out or '"f": 701' in out


# -- lines of plain values, read as columns ---------------------------------------------------

PLAIN_SPECS = {  # every value a register's word cut to a type, or a constant
    False: r"p work a=%di:s64 b=%di:u32 c=%di d=%di:s8 e=%di:char h=%di:x16 k=\7 w=%ip x=%di:s32",
    True: r"p work a=%di:s64 b=%di:u32 c=%di d=%di:s8 h=%di:x16 k=\7 w=%ip x=%di:s32 y=%si:u8",
}  # (JSON prints a char through its formatter: not a plain column)


def count_columns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[records read as columns, records columns.py handed to batch.py's decoder]."""
    counts = [0, 0]
    piece = columns_mod.ColumnDecoder._piece

    def spy(self: Any, view: Any, n: int, *args: Any) -> Any:
        text = piece(self, view, n, *args)
        counts[text is None] += n
        return text

    monkeypatch.setattr(columns_mod.ColumnDecoder, "_piece", spy)
    return counts


def traced_as_columns(
    monkeypatch: pytest.MonkeyPatch, as_json: bool, command: str, spec: str
) -> tuple[str, list[str], list[int]]:
    """``trace`` of ``spec`` on ``command``, each block also handed to the per-event path:
    (the trace's output, the per-event lines, records read as columns and not)."""
    per_event: list[str] = []
    fmt = format_json if as_json else format_event
    tee_blocks(monkeypatch, lambda _kp, ev: per_event.append(fmt(ev) + "\n"))
    counts = count_columns(monkeypatch)
    json_flag = ["--json"] if as_json else []
    out, _ = kprobes("trace", *json_flag, "-c", command, spec)
    return out, per_event, counts


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_columns_print_the_bytes_the_handlers_print(
    target: Path, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, per_event, counts = traced_as_columns(
        monkeypatch, as_json, f"{target} 20000", PLAIN_SPECS[as_json]
    )
    assert len(per_event) == 20000 and out == "".join(per_event)
    assert counts[0] >= 10000  # most of the hot loop's records were read as columns


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_columns_of_threads_print_the_bytes_the_handlers_print(
    build: Any, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads' records interleave in the ring: each thread's run is its own piece
    (its tid and CPU in its lines), short runs go to the per-event decoder."""
    spec = "p hammer t=%di i=%si:u32"
    out, per_event, counts = traced_as_columns(
        monkeypatch, as_json, f"{build('threads')} 4 20000", spec
    )
    assert len(per_event) == 80000 and out == "".join(per_event)
    assert counts[0] > 0
    lines = out.splitlines()
    assert len({line.split('"tid": ')[1][:8] if as_json else line[:24] for line in lines}) >= 4


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_columns_of_returns_print_the_bytes_the_handlers_print(
    build: Any, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records of returns: each event's caller is read as a column too."""
    spec = r"r rec a=$retval:s64 b=$retval:u32 c=%ax d=$retval:s8 h=%bx:x16 k=\7 m=$arg1:s16 w=%ip"
    out, per_event, counts = traced_as_columns(
        monkeypatch, as_json, f"{build('rets')} rec 3000", spec
    )
    assert out == "".join(per_event) and len(per_event) >= 3000
    assert counts[0] > 0


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_script_prints_columns_as_the_handlers_print(
    target: Path, as_json: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``script`` reads a record file's blocks through the same reader: the columns' bytes
    there are the per-event path's too."""
    data = tmp_path / "plain.data"
    kprobes("record", "-o", data, "-c", f"{target} 20000", PLAIN_SPECS[as_json])
    per_event: list[str] = []
    fmt = format_json if as_json else format_event
    tee_blocks(monkeypatch, lambda _kp, ev: per_event.append(fmt(ev) + "\n"))
    counts = count_columns(monkeypatch)
    out, _ = kprobes("script", *(["--json"] if as_json else []), data)
    assert len(per_event) == 20000 and out == "".join(per_event)
    assert counts[0] >= 10000


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_two_probes_whose_records_alternate_are_decoded_a_probe_at_a_time(
    build: Any, as_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry and a return probe of one function: their records alternate in the ring
    (runs of one record). Each block's runs of each probe are decoded with one call
    (process/fast/interleave.py) and handed back run by run: the per-event path's bytes,
    in the ring's order."""
    gathered: list[int] = []
    keep = Interleaved.keep

    def spy(self: Interleaved, key: tuple[int, int], lines: list[str]) -> None:
        gathered.append(len(lines))
        keep(self, key, lines)

    monkeypatch.setattr(Interleaved, "keep", spy)
    specs = ("p leaf x=%di:s32 n=$comm", "r leaf ret=$retval:u64 a=$arg1")
    out, per_event, batched_runs = both_paths_of_returns(
        build("rets"), "leaf 3000", monkeypatch, as_json, *specs
    )
    assert len(per_event) == 6000 and out == "".join(per_event)
    assert batched_runs >= 2
    assert sum(gathered) > 3000  # most records decoded with their probe's others
