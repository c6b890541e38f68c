"""Hit counts as tables: bcc funccount's per-probe table and argdist ``-C``'s frequency table.

Counting is the cheapest useful aggregation (one integer per probe, no per-event output), and
people who count functions already know what bcc prints, so the layouts are bcc's, byte for byte:

* ``funccount`` (tools/funccount.py): ``"%-36s %8s" % ("FUNC", "COUNT")`` then one
  ``"%-36s %8d"`` row per probe, **ascending** by count so the busiest ends up just above the
  prompt, probes with no hits left out. With ``-T``, each interval starts with ``"%-8s"`` of
  ``HH:MM:SS``; argdist prints the same time as ``[HH:MM:SS]`` (:func:`format_interval_header`
  has both).
* ``argdist -C`` (tools/argdist.py): the probe's label, then ``"\\t%-10s %s" % ("COUNT",
  "EVENT")`` and ``"\\t%-10s %s"`` rows, ascending, ``-T N`` keeping the last N.

Ties are broken by name, so output is stable from one run to the next (bcc's order among equal
counts is the hash table's). The JSON lines are the table's rows, in its order: the same
probes, zero hits left out unless ``zeros`` (then both list them), and ``top`` keeps the same
busiest rows in both (docs/decisions.md: "count's rows").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a count's start does not import datetime (docs/performance.md)
    from datetime import datetime


def _ascending(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda item: (item[1], item[0]))


def count_rows(
    counts: Mapping[str, int], *, top: int | None = None, zeros: bool = False
) -> list[tuple[str, int]]:
    """The rows both forms print: ascending, without the probes of no hit unless ``zeros``,
    only the ``top`` busiest when given (still ascending: the busiest last)."""
    rows = [(name, hits) for name, hits in _ascending(counts) if hits or zeros]
    return rows[-top:] if top is not None else rows


def format_counts(counts: Mapping[str, int], *, top: int | None = None, zeros: bool = False) -> str:
    """bcc funccount's table for ``{probe: hits}``, newline-terminated (``count_rows``)."""
    lines = [f"{'FUNC':<36} {'COUNT':>8}"]  # "%-36s %8s"
    lines.extend(f"{name:<36} {hits:>8}" for name, hits in count_rows(counts, top=top, zeros=zeros))
    return "\n".join(lines) + "\n"


def format_counts_json(
    counts: Mapping[str, int],
    *,
    when: datetime | None = None,
    top: int | None = None,
    zeros: bool = False,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """One JSON line ``{"probe": ..., "hits": ...}`` per row of the table (``count_rows``),
    newline-terminated.

    ``when`` (the end of the interval) adds ``"time"`` in ISO 8601 to every line;
    ``aliases`` (a row's other names: the same function) adds ``"aliases"`` to its line.
    """
    lines = []
    for name, hits in count_rows(counts, top=top, zeros=zeros):
        obj: dict[str, object] = {"probe": name, "hits": hits}
        if aliases and aliases.get(name):
            obj["aliases"] = list(aliases[name])
        if when is not None:
            obj["time"] = when.isoformat()
        lines.append(json.dumps(obj))
    return "".join(line + "\n" for line in lines)


def format_interval_header(when: datetime, *, brackets: bool = False) -> str:
    """The interval time stamp, newline-terminated: funccount ``-T``'s ``HH:MM:SS``, or
    argdist's ``[HH:MM:SS]`` with ``brackets``."""
    clock = when.strftime("%H:%M:%S")
    return f"[{clock}]\n" if brackets else f"{clock:<8}\n"


class FrequencyTable:
    """Counts of distinct values of an expression (argdist ``-C``): ``key text -> count``.

    Keys are the caller's text for one value, e.g. ``"size = 16"`` or ``"retval = -2"``, so that
    the table prints what the user asked about in the user's own words.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, key: str, count: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + count

    def merge(self, other: FrequencyTable) -> None:
        for key, count in other._counts.items():
            self.add(key, count)

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def items(self) -> list[tuple[str, int]]:
        """``(key, count)`` ascending by count, as printed."""
        return _ascending(self._counts)

    def format(self, label: str | None = None, *, top: int | None = None) -> str:
        """argdist's table, newline-terminated; ``label`` is printed first when given, and
        ``top`` keeps only the ``top`` largest counts (argdist ``-T``)."""
        rows: Iterable[tuple[str, int]] = self.items()
        if top is not None:
            rows = self.items()[-top:] if top > 0 else []
        lines = [] if label is None else [label]
        lines.append(f"\t{'COUNT':<10} EVENT")  # "\t%-10s %s"
        lines.extend(f"\t{count!s:<10} {key}" for key, count in rows)
        return "\n".join(lines) + "\n"

    def to_json(self) -> list[dict[str, object]]:
        return [{"value": key, "count": count} for key, count in self.items()]
