"""Turns measured rows into the two Markdown tables and the JSON document.

The first table has one line per peer or tier: the overhead per hit, median (min-max) over the
runs, pinned and unpinned, the no-probe baseline, and probed calls per second. The second divides
each of our tiers' overhead by each reference peer's: below 1 means ours costs less per hit.
"""

from __future__ import annotations

import json
import os
import platform
import time
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
    ("uprobes-lea", "uprobes, lea"),
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
        text += f" ✗ count {cell.bad_counts[0]}/{cell.calls}"
    if cell.error is not None:
        text += f" ✗ then: {_clean(cell.error, 40)}"
    return text


def _notes(result: RowResult) -> str:
    notes: list[str] = []
    plans = {c.info["plan"] for c in result.cells.values() if "plan" in c.info}
    notes.extend(f"plan: {_clean(plan, 50)}" for plan in sorted(plans))
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
            if ref is None:
                continue
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
            cell = refs[ref_key]
            line.append(" / ".join("—" if cell[p] is None else _ratio(cell[p]) for p in PLACEMENTS))
        lines.append(line)
    return _table(["ours ÷ peer (pinned / unpinned)", *[name for _, name in columns]], lines)


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
        parts.append("Ours relative to each peer (overhead per hit; below 1 = ours costs less):")
        parts.append(ratio)
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
            f"{func}/{placement}": samples
            for (func, placement), samples in sorted(baselines.samples.items())
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
