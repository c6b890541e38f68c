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
