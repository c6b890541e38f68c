"""funccount and argdist -C tables, byte for byte."""

from __future__ import annotations

import json
from datetime import datetime

from kprobes.output.counts import (
    FrequencyTable,
    count_rows,
    format_counts,
    format_counts_json,
    format_interval_header,
)

# `funccount -Ti 1 ...` as quoted on LKML ("memcg: ... stats_updates", 2024): the interval
# header, then the counts ascending so that the busiest ends up last.
MEMCG = {
    "cgroup_rstat_updated": 2632389,
    "__mod_memcg_state": 377553,
    "__mod_memcg_lruvec_state": 1229673,
    "__count_memcg_events": 393078,
}


def test_funccount_interval_byte_for_byte() -> None:
    text = format_interval_header(datetime(2024, 5, 1, 10, 28, 9)) + format_counts(MEMCG)
    assert text == (
        "10:28:09\n"
        "FUNC                                    COUNT\n"
        "__mod_memcg_state                      377553\n"
        "__count_memcg_events                   393078\n"
        "__mod_memcg_lruvec_state              1229673\n"
        "cgroup_rstat_updated                  2632389\n"
    )


def test_funccount_single_probe() -> None:
    # `funccount -p 596 c:malloc -d 10`
    assert format_counts({"malloc": 1082371}) == (
        "FUNC                                    COUNT\n"
        "malloc                                1082371\n"
    )


def test_zero_counts_are_left_out_and_ties_sort_by_name() -> None:
    assert format_counts({"b": 2, "a": 2, "idle": 0}) == (
        "FUNC                                    COUNT\n"
        "a                                           2\n"
        "b                                           2\n"
    )
    assert format_counts({}) == "FUNC                                    COUNT\n"


def test_json_lines_are_the_tables_rows() -> None:
    counts = {"malloc": 3, "free": 0, "calloc": 1}
    text = format_counts_json(counts)
    assert text == '{"probe": "calloc", "hits": 1}\n{"probe": "malloc", "hits": 3}\n'
    assert [json.loads(line)["probe"] for line in text.splitlines()] == [
        line.split()[0] for line in format_counts(counts).splitlines()[1:]
    ]
    stamped = format_counts_json({"malloc": 3}, when=datetime(2024, 5, 1, 10, 28, 9))
    assert json.loads(stamped) == {"probe": "malloc", "hits": 3, "time": "2024-05-01T10:28:09"}


def test_zeros_lists_every_probe_in_both() -> None:
    counts = {"malloc": 3, "free": 0}
    assert format_counts(counts, zeros=True) == (
        "FUNC                                    COUNT\n"
        "free                                        0\n"
        "malloc                                      3\n"
    )
    assert format_counts_json(counts, zeros=True) == (
        '{"probe": "free", "hits": 0}\n{"probe": "malloc", "hits": 3}\n'
    )


def test_top_keeps_the_busiest_in_ascending_order() -> None:
    assert count_rows(MEMCG, top=2) == [
        ("__mod_memcg_lruvec_state", 1229673),
        ("cgroup_rstat_updated", 2632389),
    ]
    assert format_counts(MEMCG, top=1) == (
        "FUNC                                    COUNT\n"
        "cgroup_rstat_updated                  2632389\n"
    )
    assert format_counts_json(MEMCG, top=1) == (
        '{"probe": "cgroup_rstat_updated", "hits": 2632389}\n'
    )
    # Zeros are left out before the top is taken: a top of 5 over two busy rows is two rows.
    assert count_rows({"a": 1, "b": 0, "c": 2}, top=5) == [("a", 1), ("c", 2)]
    assert count_rows({"a": 1, "b": 0, "c": 2}, top=5, zeros=True) == [
        ("b", 0),
        ("a", 1),
        ("c", 2),
    ]


def test_json_names_a_rows_aliases() -> None:
    text = format_counts_json({"open": 4, "close": 4}, aliases={"open": ("open64", "__open")})
    assert [json.loads(line) for line in text.splitlines()] == [
        {"probe": "close", "hits": 4},
        {"probe": "open", "hits": 4, "aliases": ["open64", "__open"]},
    ]


def test_interval_headers() -> None:
    when = datetime(2024, 5, 1, 10, 28, 9)
    assert format_interval_header(when) == "10:28:09\n"  # funccount -T
    assert format_interval_header(when, brackets=True) == "[10:28:09]\n"  # argdist


def test_argdist_frequency_table() -> None:
    table = FrequencyTable()
    for size in (16, 32, 16, 16, 4096, 32):
        table.add(f"size = {size}")
    assert table.format("p:c:malloc(size_t size):size_t:size") == (
        "p:c:malloc(size_t size):size_t:size\n"
        "\tCOUNT      EVENT\n"
        "\t1          size = 4096\n"
        "\t2          size = 32\n"
        "\t3          size = 16\n"
    )
    assert table.format(top=1) == "\tCOUNT      EVENT\n\t3          size = 16\n"
    assert table.total == 6 and len(table) == 3


def test_frequency_tables_merge() -> None:
    a, b = FrequencyTable(), FrequencyTable()
    a.add("fd = 1", 5)
    b.add("fd = 1", 2)
    b.add("fd = 2")
    a.merge(b)
    assert a.items() == [("fd = 2", 1), ("fd = 1", 7)]
    assert a.to_json() == [{"value": "fd = 2", "count": 1}, {"value": "fd = 1", "count": 7}]
