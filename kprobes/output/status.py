"""The live status line and the end-of-run summary: where every lost hit is accounted for.

A tracer that loses events and says nothing produces counts and histograms that look right and
are wrong. Hits are lost in two places -- a probe that could not run its handler (the kernel's
``nmissed``: a kretprobe out of ``maxactive`` instances, a re-entered handler) and a record
that did not fit in a ring buffer (per-cpu overruns) -- and both numbers are shown every time,
zeros included, so their absence can never be mistaken for "none". The summary breaks them down
per probe and per cpu and ends with a warning line whenever anything was lost.

The status line is meant for a terminal's stderr: it starts with ``\\r`` and ends with
``ESC[K`` (erase to end of line), so each one overwrites the last without a newline. The CLI
decides whether stderr is a terminal; these functions only build text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

ERASE_TO_EOL = "\x1b[K"


def format_status(
    events: int, rate: float, hits: int, misses: int, dropped: int, behind: int = 0
) -> str:
    """``\\r...ESC[K``: one overwriting line of live counters (no newline). ``behind`` is
    the hits whose events are not read yet (a reader that lags): the events climb slower
    than the hits, and the line says why instead of looking stuck."""
    lost = "  LOSING EVENTS" if misses or dropped else ""
    lag = f"  {behind} not read yet" if behind > 0 else ""
    return (
        f"\r{events} events ({rate:.1f}/s)  hits {hits}{lag}  missed {misses}  dropped {dropped}"
        f"{lost}{ERASE_TO_EOL}"
    )


def format_summary(
    *,
    events: int,
    hits: int,
    misses: int,
    dropped: int,
    duration: float | None = None,
    missed_by_probe: Mapping[str, int] | None = None,
    dropped_by_cpu: Mapping[int, int] | None = None,
    unprinted: int = 0,
    unread: int = 0,
    filtered: int = 0,
    ended_by: str = "",
    verb: str = "printed",
) -> str:
    """The end-of-run summary, newline-terminated.

    ``events`` is what reached the output, ``hits`` what the probes counted; ``misses`` and
    ``dropped`` are the totals, broken down by ``missed_by_probe`` (probe name -> nmissed) and
    ``dropped_by_cpu`` (cpu -> records lost) when given; non-zero entries are listed.
    A run that ended before it had shown every event (``ended_by``: ``-n 100``, ``-d 1``,
    ``SIGINT``...) says how many it did not: ``unprinted`` were read but came after the end,
    ``unread`` were written by the program and never read; ``filtered`` did not pass
    ``--filter``. Shown whenever one is not zero, with ``events`` ``verb`` beside them.
    """
    when = f" in {duration:.3f} s" if duration is not None else ""
    lines = [f"{events} events, {hits} hits, {misses} missed, {dropped} dropped{when}"]
    if unprinted or unread or filtered:
        lines.append(
            f"  of the hits: {events} {verb}, {filtered} filtered out, {dropped} dropped in the "
            f"program, {unprinted} read but not {verb}, {unread} never read"
        )
    if unprinted or unread:
        why = f"the run ended ({ended_by})" if ended_by else "the run ended"
        lines.append(
            f"NOTE: {why} with {unprinted + unread} events not {verb} ({unprinted} read "
            f"after the end, {unread} never read): the hits count them, the output does not"
        )
    for name, n in sorted((missed_by_probe or {}).items()):
        if n:
            lines.append(f"  missed  {name:<36} {n:>8}")
    for cpu, n in sorted((dropped_by_cpu or {}).items()):
        if n:
            lines.append(f"  dropped {'cpu ' + str(cpu):<36} {n:>8}")
    if misses or dropped:
        lines.append(
            f"WARNING: {misses + dropped} hits lost ({misses} missed, {dropped} dropped): "
            "the output above is incomplete"
        )
    return "\n".join(lines) + "\n"


def format_summary_json(
    *,
    events: int,
    hits: int,
    misses: int,
    dropped: int,
    duration: float | None = None,
    missed_by_probe: Mapping[str, int] | None = None,
    dropped_by_cpu: Mapping[int, int] | None = None,
) -> str:
    """The same numbers as one JSON line (newline-terminated), every key always present."""
    obj = {
        "events": events,
        "hits": hits,
        "missed": misses,
        "dropped": dropped,
        "duration": duration,
        "missed_by_probe": dict(sorted((missed_by_probe or {}).items())),
        "dropped_by_cpu": {str(c): n for c, n in sorted((dropped_by_cpu or {}).items())},
    }
    return json.dumps(obj) + "\n"
