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


def test_status_line_says_how_far_behind_the_reader_is() -> None:
    assert format_status(30967, 15483.5, 12948480, 0, 0, behind=12917513) == (
        "\r30967 events (15483.5/s)  hits 12948480  12917513 not read yet  missed 0  "
        "dropped 0\x1b[K"
    )


def test_summary_of_a_run_ended_early_says_what_was_not_printed() -> None:
    text = format_summary(
        events=30967,
        hits=12948480,
        misses=0,
        dropped=20,
        duration=1.0,
        unprinted=14339,
        unread=12903154,
        ended_by="SIGINT",
    )
    assert text == (
        "30967 events, 12948480 hits, 0 missed, 20 dropped in 1.000 s\n"
        "  of the hits: 30967 printed, 0 filtered out, 20 dropped in the program, "
        "14339 read but not printed, 12903154 never read\n"
        "NOTE: the run ended (SIGINT) with 12917493 events not printed (14339 read after the "
        "end, 12903154 never read): the hits count them, the output does not\n"
        "WARNING: 20 hits lost (0 missed, 20 dropped): the output above is incomplete\n"
    )
