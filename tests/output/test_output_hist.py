"""Histograms byte for byte against published bcc and bpftrace output."""

from __future__ import annotations

import pytest

from kprobes.output.hist import (
    HistBucket,
    LatencyStats,
    LinearHistogram,
    Log2Histogram,
    format_average,
)

# bcc tools/funclatency_example.txt: `funclatency pthread:pthread_mutex_lock -p ...`
FUNCLATENCY_COUNTS = {
    2048: 508967,
    4096: 70072,
    8192: 27686,
    16384: 5075,
    32768: 2318,
    65536: 581,
    131072: 38,
    262144: 5,
    524288: 1,
    1048576: 9,
}
FUNCLATENCY_OUTPUT = """\
     nsecs               : count     distribution
         0 -> 1          : 0        |                                        |
         2 -> 3          : 0        |                                        |
         4 -> 7          : 0        |                                        |
         8 -> 15         : 0        |                                        |
        16 -> 31         : 0        |                                        |
        32 -> 63         : 0        |                                        |
        64 -> 127        : 0        |                                        |
       128 -> 255        : 0        |                                        |
       256 -> 511        : 0        |                                        |
       512 -> 1023       : 0        |                                        |
      1024 -> 2047       : 0        |                                        |
      2048 -> 4095       : 508967   |****************************************|
      4096 -> 8191       : 70072    |*****                                   |
      8192 -> 16383      : 27686    |**                                      |
     16384 -> 32767      : 5075     |                                        |
     32768 -> 65535      : 2318     |                                        |
     65536 -> 131071     : 581      |                                        |
    131072 -> 262143     : 38       |                                        |
    262144 -> 524287     : 5        |                                        |
    524288 -> 1048575    : 1        |                                        |
   1048576 -> 2097151    : 9        |                                        |

avg = 4317 nsecs, total: 2654426112 nsecs, count: 614752
"""


def test_funclatency_example_byte_for_byte() -> None:
    hist = Log2Histogram()
    for value, count in FUNCLATENCY_COUNTS.items():
        hist.add(value, count)
    stats = LatencyStats()
    stats.count, stats.total = 614752, 2654426112
    # funclatency: print_log2_hist(label), then "\navg = ...\n".
    assert hist.format("nsecs") + "\n" + format_average(stats) + "\n" == FUNCLATENCY_OUTPUT
    assert hist.total == 614752


def test_zero_and_one_share_the_first_row_and_slot_zero_stays_empty() -> None:
    hist = Log2Histogram()
    for v in (0, 1, 2, 3, 4):
        hist.add(v)
    assert hist.slots[:4] == (0, 2, 2, 1)
    assert hist.format("usecs") == (
        "     usecs               : count     distribution\n"
        "         0 -> 1          : 2        |****************************************|\n"
        "         2 -> 3          : 2        |****************************************|\n"
        "         4 -> 7          : 1        |********************                    |\n"
    )
    assert hist.buckets() == [HistBucket(0, 2, 2), HistBucket(2, 4, 2), HistBucket(4, 8, 1)]


def test_leading_zero_rows_can_be_stripped() -> None:
    hist = Log2Histogram()
    hist.add(100)
    hist.add(1000, 3)
    assert hist.format("bytes", strip_leading_zero=True) == (
        "     bytes               : count     distribution\n"
        "        64 -> 127        : 1        |*************                           |\n"
        "       128 -> 255        : 0        |                                        |\n"
        "       256 -> 511        : 0        |                                        |\n"
        "       512 -> 1023       : 3        |****************************************|\n"
    )


def test_values_beyond_32_bits_switch_to_the_wide_layout() -> None:
    hist = Log2Histogram()
    hist.add(1)
    hist.add(1 << 40, 2)
    lines = hist.format("nsecs").splitlines()
    assert len(lines) == 1 + 41
    assert lines[0] == "               nsecs                         : count     distribution"
    assert lines[1] == (
        "                   0 -> 1                    : 1        |**********          |"
    )
    assert lines[2] == (
        "                   2 -> 3                    : 0        |                    |"
    )
    assert lines[-1] == (
        "       1099511627776 -> 2199023255551        : 2        |********************|"
    )


def test_negative_values_are_64_bit_unsigned_like_the_bpf_map() -> None:
    hist = Log2Histogram()
    hist.add(-1)
    assert hist.slots[64] == 1
    assert (
        hist.format()
        .splitlines()[-1]
        .startswith(" 9223372036854775808 -> 18446744073709551615 : 1 ")
    )


def test_empty_histogram_prints_nothing() -> None:
    assert Log2Histogram().format("nsecs") == ""
    assert LinearHistogram(0, 10, 1).format() == ""
    assert format_average(LatencyStats()) == ""


def test_log2_merge_and_json() -> None:
    a, b = Log2Histogram(), Log2Histogram()
    a.add(5)
    b.add(6)
    b.add(1)
    a.merge(b)
    assert a.to_json("nsecs") == {
        "val_type": "nsecs",
        "data": [
            {"interval-start": 0, "interval-end": 1, "count": 1},
            {"interval-start": 2, "interval-end": 3, "count": 0},
            {"interval-start": 4, "interval-end": 7, "count": 2},
        ],
    }


# bpftrace docs/reference_guide.md, lhist(): `@bytes = lhist(retval, 0, 10000, 1000)`.
def test_bpftrace_lhist_reference_example() -> None:
    hist = LinearHistogram(0, 10000, 1000)
    for value, count in ((500, 480), (1500, 49), (2000, 12), (3999, 39), (4000, 267)):
        hist.add(value, count)
    assert hist.format() == (
        "[0, 1000)            480 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[1000, 2000)          49 |@@@@@                                               |\n"
        "[2000, 3000)          12 |@                                                   |\n"
        "[3000, 4000)          39 |@@@@                                                |\n"
        "[4000, 5000)         267 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@                        |\n"
    )


def test_lhist_keeps_inner_empty_rows_and_trims_the_ends() -> None:
    hist = LinearHistogram(0, 10000, 1000)
    for value, count in ((1, 666), (1000, 6), (2999, 1), (3000, 3), (4500, 26), (8000, 5)):
        hist.add(value, count)
    assert hist.format() == (
        "[0, 1000)            666 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[1000, 2000)           6 |                                                    |\n"
        "[2000, 3000)           1 |                                                    |\n"
        "[3000, 4000)           3 |                                                    |\n"
        "[4000, 5000)          26 |@@                                                  |\n"
        "[5000, 6000)           0 |                                                    |\n"
        "[6000, 7000)           0 |                                                    |\n"
        "[7000, 8000)           0 |                                                    |\n"
        "[8000, 9000)           5 |                                                    |\n"
    )


def test_lhist_open_ends_and_k_m_labels() -> None:
    hist = LinearHistogram(0, 4096, 1024)
    for value in (-5, 1500, 4096, 1 << 30):
        hist.add(value)
    assert hist.format() == (
        "(..., 0)               1 |@@@@@@@@@@@@@@@@@@@@@@@@@@                          |\n"
        "[0, 1K)                0 |                                                    |\n"
        "[1K, 2K)               1 |@@@@@@@@@@@@@@@@@@@@@@@@@@                          |\n"
        "[2K, 3K)               0 |                                                    |\n"
        "[3K, 4K)               0 |                                                    |\n"
        "[4K, ...)              2 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
    )
    assert hist.buckets()[0] == HistBucket(None, 0, 1)
    assert hist.buckets()[-1] == HistBucket(4096, None, 2)
    mega = LinearHistogram(0, 2 << 20, 1 << 20)
    mega.add(1 << 20)
    assert mega.format().startswith("[1M, 2M) ")


def test_lhist_rejects_impossible_buckets() -> None:
    with pytest.raises(ValueError):
        LinearHistogram(0, 100, 0)
    with pytest.raises(ValueError):
        LinearHistogram(10, 10, 1)
    with pytest.raises(ValueError):
        LinearHistogram(0, 10, 1).merge(LinearHistogram(0, 20, 1))


def test_latency_stats() -> None:
    stats = LatencyStats()
    for v in (30, 10, 20):
        stats.add(v)
    other = LatencyStats()
    other.add(5)
    stats.merge(other)
    stats.merge(LatencyStats())
    assert (stats.count, stats.total, stats.min, stats.max, stats.avg) == (4, 65, 5, 30, 16.25)
    assert format_average(stats, "usecs") == "avg = 16 usecs, total: 65 usecs, count: 4"
    assert stats.to_json() == {"count": 4, "total": 65, "min": 5, "max": 30, "avg": 16.25}
    assert LatencyStats().avg is None
