"""Events and aggregates turned into text, for people and for programs.

Every target (Process, Kernel, Uprobes) hands over the same :class:`~kprobes.model.Event`
values, so one set of formatters serves them all. They are pure: they take values and return
strings (or write to a stream they are given) and never print, read a clock or touch a process,
so the CLI alone decides where output goes and each layout is tested with exact strings.

Where a reference tool's layout exists, it is reproduced byte for byte rather than approximated,
so that output can be diffed against the kernel's own ``trace`` file, bcc and bpftrace:

    text      the kernel's trace line               kernel/trace/trace_output.c, trace_kprobe.c
    jsonl     one typed JSON object per event
    counts    funccount table, argdist -C table     bcc tools/funccount.py, tools/argdist.py
    hist      log2 / linear histograms, averages    bcc table.py, bpftrace output.cpp,
                                                    bcc tools/funclatency.py
    perfetto  calls as slices for ui.perfetto.dev   Chrome JSON Trace Event format
    status    live status line, loss summary
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kprobes.output.argtypes import FetchType, Kind, format_value, json_value, parse_type
    from kprobes.output.counts import (
        FrequencyTable,
        format_counts,
        format_counts_json,
        format_interval_header,
    )
    from kprobes.output.hist import (
        HistBucket,
        LatencyStats,
        LinearHistogram,
        Log2Histogram,
        format_average,
    )
    from kprobes.output.jsonl import event_to_json, format_json
    from kprobes.output.perfetto import PerfettoWriter, WriterState
    from kprobes.output.status import format_status, format_summary, format_summary_json
    from kprobes.output.text import BufferCounts, format_event, format_header, format_timestamp

# Where each name lives, imported on first use (PEP 562): a command imports only the
# formatters it uses (``count`` needs neither Perfetto nor histograms).
_WHERE = {
    "BufferCounts": "kprobes.output.text",
    "FetchType": "kprobes.output.argtypes",
    "FrequencyTable": "kprobes.output.counts",
    "HistBucket": "kprobes.output.hist",
    "Kind": "kprobes.output.argtypes",
    "LatencyStats": "kprobes.output.hist",
    "LinearHistogram": "kprobes.output.hist",
    "Log2Histogram": "kprobes.output.hist",
    "PerfettoWriter": "kprobes.output.perfetto",
    "WriterState": "kprobes.output.perfetto",
    "event_to_json": "kprobes.output.jsonl",
    "format_average": "kprobes.output.hist",
    "format_counts": "kprobes.output.counts",
    "format_counts_json": "kprobes.output.counts",
    "format_event": "kprobes.output.text",
    "format_header": "kprobes.output.text",
    "format_interval_header": "kprobes.output.counts",
    "format_json": "kprobes.output.jsonl",
    "format_status": "kprobes.output.status",
    "format_summary": "kprobes.output.status",
    "format_summary_json": "kprobes.output.status",
    "format_timestamp": "kprobes.output.text",
    "format_value": "kprobes.output.argtypes",
    "json_value": "kprobes.output.argtypes",
    "parse_type": "kprobes.output.argtypes",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kprobes.output' has no attribute {name!r}")
    value = getattr(import_module(where), name)
    globals()[name] = value
    return value


__all__ = [
    "BufferCounts",
    "FetchType",
    "FrequencyTable",
    "HistBucket",
    "Kind",
    "LatencyStats",
    "LinearHistogram",
    "Log2Histogram",
    "PerfettoWriter",
    "WriterState",
    "event_to_json",
    "format_average",
    "format_counts",
    "format_counts_json",
    "format_event",
    "format_header",
    "format_interval_header",
    "format_json",
    "format_status",
    "format_summary",
    "format_summary_json",
    "format_timestamp",
    "format_value",
    "json_value",
    "parse_type",
]
