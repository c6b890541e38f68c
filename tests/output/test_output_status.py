"""The live status line and the summary never hide a loss."""

from __future__ import annotations

import json

from kprobes.output.status import format_status, format_summary, format_summary_json


def test_status_line_overwrites_itself() -> None:
    assert format_status(1234, 246.75, 1240, 0, 0) == (
        "\r1234 events (246.8/s)  hits 1240  missed 0  dropped 0\x1b[K"
    )
    assert format_status(10, 1.0, 12, 2, 1) == (
        "\r10 events (1.0/s)  hits 12  missed 2  dropped 1  LOSING EVENTS\x1b[K"
    )


def test_summary_without_loss_still_says_zero() -> None:
    assert format_summary(events=5, hits=5, misses=0, dropped=0, duration=1.5) == (
        "5 events, 5 hits, 0 missed, 0 dropped in 1.500 s\n"
    )


def test_summary_lists_every_loss_and_warns() -> None:
    text = format_summary(
        events=1222,
        hits=1240,
        misses=6,
        dropped=12,
        missed_by_probe={"kp/malloc_ret": 6, "kp/malloc": 0},
        dropped_by_cpu={3: 2, 1: 10},
    )
    assert text == (
        "1222 events, 1240 hits, 6 missed, 12 dropped\n"
        "  missed  kp/malloc_ret                               6\n"
        "  dropped cpu 1                                      10\n"
        "  dropped cpu 3                                       2\n"
        "WARNING: 18 hits lost (6 missed, 12 dropped): the output above is incomplete\n"
    )


def test_summary_json_has_every_key() -> None:
    obj = json.loads(
        format_summary_json(
            events=1, hits=2, misses=1, dropped=0, missed_by_probe={"p": 1}, dropped_by_cpu={0: 0}
        )
    )
    assert obj == {
        "events": 1,
        "hits": 2,
        "missed": 1,
        "dropped": 0,
        "duration": None,
        "missed_by_probe": {"p": 1},
        "dropped_by_cpu": {"0": 0},
    }
