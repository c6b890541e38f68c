"""Turns measured rows into the Markdown tables and the JSON document.

The first table has one line per peer or tier: the overhead per hit, median (min-max) over the
runs, pinned and unpinned, the no-probe baseline, and probed calls per second. The second divides
each of our tiers' overhead by each reference peer's with as many threads: below 1 means ours
costs less per hit. The third restates k, j, r, kr and jr in the Kprobes document's §6
notation, ours beside the kernel's uprobes of the same run and the document's own 2005 figures,
and checks that a return-probe hit costs at most one stop more than an entry hit. The last
(report_optimized.py) sets our optimized probes against the kernel's uprobe, the C detour floor
and the goals of issue 12.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.measure import PLACEMENTS, Baselines, Cell, RowResult

# The peers every tier of ours is compared with, in column order.
REFERENCES: tuple[tuple[str, str], ...] = (
    ("floor-one", "C floor, one stop"),
    ("floor-two", "C floor, two stops"),
    ("ptrace", "python-ptrace"),
    ("gdb", "GDB"),
    ("uprobes-push", "uprobes, push"),
    ("uprobes-push-4t", "uprobes, push, 4 threads"),
    ("uprobes-lea", "uprobes, lea"),
)


@dataclass(frozen=True, slots=True)
class Notation:
    """One probe kind of the Kprobes document's §6, and the rows that measure it here."""

    symbol: str
    meaning: str
    stops: int  # ptrace stops per hit on the push site: the entry int3, plus the trampoline's
    ours: str
    kernel: str | None  # the kernel's uprobe counterpart; None: the kernel has none


NOTATION: tuple[Notation, ...] = (
    Notation("k", "kprobe", 1, "kprobes-push", "uprobes-push"),
    Notation("j", "jprobe", 1, "kprobes-j-push", None),
    Notation("r", "return probe", 2, "kprobes-r-push", "uprobes-r-push"),
    Notation("kr", "kprobe + return probe, same function", 2, "kprobes-kr-push", "uprobes-kr-push"),
    Notation("jr", "jprobe + return probe, same function", 2, "kprobes-jr-push", None),
)

# The Kprobes document (the kernel's Documentation/kprobes.txt, as kept in
# /work/shared/reference/kprobes.txt), "6. Probe Overhead", lines 618-625, usec per hit:
#   i386: Intel Pentium M, 1495 MHz, 2957.31 bogomips
#   k = 0.57 usec; j = 1.00; r = 0.92; kr = 0.99; jr = 1.40
#   x86_64: AMD Opteron 246, 1994 MHz, 3971.48 bogomips
#   k = 0.49 usec; j = 0.76; r = 0.80; kr = 0.82; jr = 1.07
#   ppc64: POWER5 (gr), 1656 MHz (SMT disabled, 1 virtual CPU per physical CPU)
#   k = 0.77 usec; j = 1.31; r = 1.26; kr = 1.45; jr = 1.99
DOC_2005_US: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("i386", "Pentium M 1495 MHz", {"k": 0.57, "j": 1.00, "r": 0.92, "kr": 0.99, "jr": 1.40}),
    ("x86_64", "Opteron 246 1994 MHz", {"k": 0.49, "j": 0.76, "r": 0.80, "kr": 0.82, "jr": 1.07}),
    ("ppc64", "POWER5 1656 MHz", {"k": 0.77, "j": 1.31, "r": 1.26, "kr": 1.45, "jr": 1.99}),
)


def _unit(ns: float) -> tuple[float, str]:
    a = abs(ns)
    if a < 1_000:
        return 1.0, "ns"
    if a < 1_000_000:
        return 1_000.0, "µs"
    return 1_000_000.0, "ms"


def _num(value: float, scale: float) -> str:
    v = value / scale
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def format_ns(ns: float) -> str:
    scale, unit = _unit(ns)
    return f"{_num(ns, scale)} {unit}"


def format_rate(ns_per_call: float | None) -> str:
    if not ns_per_call:
        return "—"
    rate = 1e9 / ns_per_call
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.3g}{suffix}"
    return f"{rate:.3g}"


def _clean(text: str, width: int = 70) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def cell_text(cell: Cell) -> str:
    if cell.error is not None and not cell.samples:
        return f"✗ {_clean(cell.error.removeprefix('error: '))}"
    overhead = cell.overhead()
    if overhead is None:
        return "—"
    median, low, high = overhead
    scale, unit = _unit(median)
    text = f"{_num(median, scale)} {unit}"
    if len(cell.samples) > 1:
        text += f" ({_num(low, scale)} to {_num(high, scale)})"
    if cell.bad_counts:
        text += f" ✗ count {cell.bad_counts[0]}/{cell.expected_hits}"
    if cell.error is not None:
        text += f" ✗ then: {_clean(cell.error, 40)}"
    return text


def stops_per_hit(cell: Cell) -> float | None:
    """The program's stops over its last run divided by N (start-up included), if reported."""
    stops = cell.info.get("stops")
    return int(stops) / cell.calls if stops is not None and cell.calls else None


def _notes(result: RowResult) -> str:
    notes: list[str] = []
    plans = {c.info["plan"] for c in result.cells.values() if "plan" in c.info}
    notes.extend(f"plan: {_clean(plan, 50)}" for plan in sorted(plans))
    stops = [stops_per_hit(c) for c in result.cells.values()]
    shown = sorted({f"{s:.2f}" for s in stops if s is not None})
    if shown:
        notes.append(f"stops/hit: {' / '.join(shown)}")
    drops = [
        [int(s.info["dropped"]) for s in c.samples if "dropped" in s.info]
        for c in result.cells.values()
    ]
    if any(drops):
        most = " / ".join(f"{max(d):,}" if d else "—" for d in drops)
        notes.append(f"records dropped, most in a run: {most}")
    return "; ".join(notes)


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out.extend("| " + " | ".join(line) + " |" for line in lines)
    return "\n".join(out)


def overhead_table(results: list[RowResult]) -> str:
    header = [
        "tool",
        "site",
        "pinned",
        "unpinned",
        "no probe (pinned / unpinned)",
        "probed calls/s (pinned / unpinned)",
        "runs x N",
        "notes",
    ]
    lines = []
    for r in results:
        pinned, unpinned = r.cells["pinned"], r.cells["unpinned"]
        baselines = " / ".join(
            format_ns(c.baseline_ns) if c.baseline_ns is not None else "—"
            for c in (pinned, unpinned)
        )
        rates = " / ".join(format_rate(c.with_ns) for c in (pinned, unpinned))
        lines.append(
            [
                r.row.label,
                r.row.site,
                cell_text(pinned),
                cell_text(unpinned),
                baselines,
                rates,
                f"{r.runs} x {r.calls:,}",
                _notes(r),
            ]
        )
    return _table(header, lines)


def _median_overhead(result: RowResult | None, placement: str) -> float | None:
    if result is None:
        return None
    cell = result.cells[placement]
    overhead = cell.overhead()
    if overhead is None or cell.bad_counts or cell.error is not None:
        return None
    return overhead[0]


def ratios(results: list[RowResult]) -> dict[str, dict[str, dict[str, float | None]]]:
    """ours key -> reference key -> placement -> ours / reference (None where either is missing)."""
    by_key = {r.row.key: r for r in results}
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for ours in (r for r in results if r.row.ours):
        table[ours.row.key] = {}
        for ref_key, _ in REFERENCES:
            ref = by_key.get(ref_key)
            if ref is None or ref.row.threads != ours.row.threads:
                continue  # like with like: one thread's cost against one thread's
            cells: dict[str, float | None] = {}
            for p in PLACEMENTS:
                a, b = _median_overhead(ours, p), _median_overhead(ref, p)
                cells[p] = a / b if a is not None and b else None
            table[ours.row.key][ref_key] = cells
    return table


def _ratio(value: float) -> str:
    return f"{value:.0f}x" if value >= 100 else f"{value:.2g}x"


def ratio_table(results: list[RowResult]) -> str | None:
    table = ratios(results)
    present = {k for r in table.values() for k in r}
    columns = [(k, name) for k, name in REFERENCES if k in present]
    if not table or not columns:
        return None
    labels = {r.row.key: r.row.label for r in results}
    lines = []
    for ours_key, refs in table.items():
        line = [labels[ours_key]]
        for ref_key, _ in columns:
            cells = refs.get(ref_key)
            if cells is None:  # a reference with another number of threads
                line.append("")
                continue
            values = [cells[p] for p in PLACEMENTS]
            line.append(" / ".join("—" if v is None else _ratio(v) for v in values))
        lines.append(line)
    return _table(["ours ÷ peer (pinned / unpinned)", *[name for _, name in columns]], lines)


def _figure(us: float | None, k_us: float | None, present: bool, digits: str = ".3g") -> str:
    """A figure in µs with its multiple of the same column's k; why there is none, if none."""
    if us is None:
        return "✗ (see above)" if present else "not run"
    text = f"{us:{digits}} µs"
    return text if not k_us else f"{text} ({us / k_us:.2f}x k)"


def notation_figures(results: list[RowResult]) -> dict[str, dict[str, float | None]]:
    """symbol -> {"ours", "kernel"} -> pinned median overhead in µs (None: missing or ✗)."""
    by_key = {r.row.key: r for r in results}
    figures: dict[str, dict[str, float | None]] = {}
    for n in NOTATION:
        figures[n.symbol] = {}
        for side, key in (("ours", n.ours), ("kernel", n.kernel)):
            ns = None if key is None else _median_overhead(by_key.get(key), "pinned")
            figures[n.symbol][side] = None if ns is None else ns / 1000
    return figures


def notation_table(results: list[RowResult]) -> str | None:
    """k, j, r, kr, jr: ours and the kernel's (pinned medians) beside the document's 2005."""
    by_key = {r.row.key: r for r in results}
    if not any(k in by_key for n in NOTATION for k in (n.ours, n.kernel)):
        return None
    figures = notation_figures(results)
    header = [
        "§6",
        "probe",
        "stops/hit, ours (by design / measured)",
        "ours, pinned",
        "kernel uprobes, pinned",
        *[f"2005 {arch} ({cpu})" for arch, cpu, _ in DOC_2005_US],
    ]
    lines = []
    for n in NOTATION:
        is_k = n.symbol == "k"  # every other line is also given as a multiple of its column's k
        ours = by_key.get(n.ours)
        measured = None if ours is None else stops_per_hit(ours.cells["pinned"])
        if n.kernel is None:
            kernel = "none (no jprobes since 4.15)"
        else:
            k_kernel = None if is_k else figures["k"]["kernel"]
            kernel = _figure(figures[n.symbol]["kernel"], k_kernel, n.kernel in by_key)
        k_ours = None if is_k else figures["k"]["ours"]
        lines.append(
            [
                f"**{n.symbol}**",
                n.meaning,
                f"{n.stops} / {'—' if measured is None else f'{measured:.2f}'}",
                _figure(figures[n.symbol]["ours"], k_ours, ours is not None),
                kernel,
                *[
                    _figure(doc[n.symbol], None if is_k else doc["k"], True, ".2f")
                    for _, _, doc in DOC_2005_US
                ],
            ]
        )
    return _table(header, lines)


def _difference(name: str, a: float | None, b: float | None, unit: float | None) -> str | None:
    if a is None or b is None:
        return None
    text = f"{name} {a - b:.3g} µs"
    return f"{text} ({(a - b) / unit:.2f} k)" if unit else text


def notation_words(results: list[RowResult]) -> str | None:
    """The goal "a return-probe hit costs at most one stop more than an entry hit", in words."""
    f = notation_figures(results)
    k, r = f["k"]["ours"], f["r"]["ours"]
    if k is None or r is None:
        return None
    verdict = "met" if r - k <= k else "missed"
    words = [
        "A return-probe hit costs at most one stop more than an entry hit (one stop's cost taken "
        f"as our k, {k:.3g} µs): our r - k = {r - k:.3g} µs = {(r - k) / k:.2f} stops: "
        f"**{verdict}**."
    ]
    more = [
        d
        for d in (
            _difference("kr - k", f["kr"]["ours"], k, k),
            _difference("jr - j", f["jr"]["ours"], f["j"]["ours"], k),
        )
        if d is not None
    ]
    if more:
        words.append(f"A return probe added to an entry probe: {', '.join(more)}.")
    scale = [
        d
        for d in [
            _difference("kernel", f["r"]["kernel"], f["k"]["kernel"], f["k"]["kernel"]),
            *[_difference(f"2005 {a}", doc["r"], doc["k"], doc["k"]) for a, _, doc in DOC_2005_US],
        ]
        if d is not None
    ]
    words.append(f"For scale, r - k (in its own column's k): {'; '.join(scale)}.")
    kr = [
        d
        for d in [
            _difference("ours", f["kr"]["ours"], r, k),
            _difference("kernel", f["kr"]["kernel"], f["r"]["kernel"], f["k"]["kernel"]),
            *[_difference(f"2005 {a}", doc["kr"], doc["r"], doc["k"]) for a, _, doc in DOC_2005_US],
        ]
        if d is not None
    ]
    words.append(
        '§6: with a return probe on a function, adding a kprobe at its entry "adds essentially '
        f'no overhead": kr - r is {"; ".join(kr)}.'
    )
    return " ".join(words)


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": model,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def render(results: list[RowResult], runs: int, versions: list[str]) -> str:
    m = machine()
    head = (
        f"# Per-hit overhead, {m['date']}\n\n"
        f"{m['cpus']} CPUs, {m['cpu']}, kernel {m['kernel']}"
        f"{''.join('; ' + v for v in versions if v)}.\n"
        "Overhead = ns per call with the probe minus ns per call without; "
        f"median (min to max) of {runs} runs (GDB and python-ptrace: at most 3); "
        "every run's hit count checked (✗ count = the tool saw a different number of hits). "
        "Pinned = tool and program on CPU 0 (`taskset -c 0`). Unpinned figures are often "
        "bimodal (the scheduler either puts tool and program on one CPU or not, for a whole "
        "run): read their range, and their ratios with care."
    )
    parts = [head, overhead_table(results)]
    ratio = ratio_table(results)
    if ratio is not None:
        parts.append(
            "Ours relative to each peer (overhead per hit; below 1 = ours costs less; a row "
            "of 4 threads against a peer's row of 4 threads only):"
        )
        parts.append(ratio)
    from bench.report_optimized import (  # it builds on this module
        optimized_section,
        returns_section,
    )

    parts.extend(optimized_section(results))
    parts.extend(returns_section(results))
    notation = notation_table(results)
    if notation is not None:
        parts.append(
            "The document's §6 notation (k = kprobe, j = jprobe, r = return probe, kr and jr = "
            "kprobe or jprobe + return probe on the same function), overhead per hit on the "
            "push site, pinned medians; the 2005 figures are the Kprobes document's own "
            "(§6 Probe Overhead). The kernel has no jprobes (removed in 4.15) and uprobes never "
            "had them, so our j and jr have no kernel counterpart. Stops per hit, measured: "
            "the program's voluntary context switches in its last pinned run, divided by N."
        )
        parts.append(notation)
        words = notation_words(results)
        if words is not None:
            parts.append(words)
    return "\n\n".join(parts) + "\n"


def _cell_json(cell: Cell) -> dict[str, Any]:
    overhead = cell.overhead()
    return {
        "ns_per_call": [s.ns_per_call for s in cell.samples],
        "hits": [s.hits for s in cell.samples],
        "baseline_ns_per_call": cell.baseline_ns,
        "overhead_ns": None if overhead is None else overhead[0],
        "overhead_min_ns": None if overhead is None else overhead[1],
        "overhead_max_ns": None if overhead is None else overhead[2],
        "count_ok": bool(cell.samples) and not cell.bad_counts,
        "error": cell.error,
        "info": cell.info,
    }


def to_json(
    results: list[RowResult], baselines: Baselines, options: dict[str, Any], versions: list[str]
) -> dict[str, Any]:
    return {
        "machine": machine(),
        "versions": versions,
        "options": options,
        "baselines": {
            f"{func}/{placement}{'' if threads == 1 else f'/{threads}t'}": samples
            for (func, placement, threads), samples in sorted(baselines.samples.items())
        },
        "rows": [
            {
                "key": r.row.key,
                "peer": r.row.peer,
                "label": r.row.label,
                "site": r.row.site,
                "runs": r.runs,
                "calls": r.calls,
                "cells": {p: _cell_json(c) for p, c in r.cells.items()},
            }
            for r in results
        ],
        "ratios": ratios(results),
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
