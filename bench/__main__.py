"""``python -m bench``: measure every peer and every tier of ours, print the tables.

    python -m bench [--runs R] [--calls N] [--only PEER_OR_ROW,...] [--quick] [--json FILE]

Progress goes to stderr, the Markdown report to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from bench.build import BuildError, build_all
from bench.measure import PLACEMENTS, Baselines, Cell, RowResult, measure_row
from bench.peer import Peer, Row
from bench.peer_floor import FloorPeer
from bench.peer_frida import FridaPeer
from bench.peer_gdb import GdbPeer
from bench.peer_kprobes import KprobesPeer
from bench.peer_optimized import DetourFloorPeer, OptimizedPeer
from bench.peer_ptrace import PtracePeer
from bench.peer_uprobes import UprobesPeer
from bench.report import render, to_json, write_json

PEERS: tuple[type[Peer], ...] = (
    FloorPeer,
    UprobesPeer,
    FridaPeer,
    PtracePeer,
    GdbPeer,
    KprobesPeer,
    DetourFloorPeer,
    OptimizedPeer,
)
BASELINE_CALLS, QUICK_BASELINE_CALLS = 1_000_000, 100_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="runs per cell (default 5; 1 with --quick); GDB and python-ptrace at most 3",
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=None,
        help="calls per run for every row (default: per row, ~0.5-2 s a run)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated peers (floor, uprobes, frida, ptrace, gdb, kprobes, detour-floor, "
        "optimized) or row keys",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one run of a small N per row: a smoke test of a few seconds",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="also write every sample to FILE"
    )
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = 1 if args.quick else 5
    if args.runs < 1 or (args.calls is not None and args.calls < 1):
        parser.error("--runs and --calls must be positive")
    return args


def select(peers: list[Peer], only: str) -> list[tuple[Peer, Row]]:
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    chosen = [
        (peer, row)
        for peer in peers
        for row in peer.rows()
        if not wanted or peer.name in wanted or row.key in wanted
    ]
    known = {p.name for p in peers} | {row.key for p in peers for row in p.rows()}
    unknown = wanted - known
    if unknown:
        raise SystemExit(f"--only: unknown peer or row {', '.join(sorted(unknown))}")
    return chosen


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every session's cleanup


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    # "Unpinned" must mean free to run anywhere, even if we were started under taskset.
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        programs = build_all()
    except BuildError as e:
        print(e, file=sys.stderr)
        return 1
    peers = [cls(programs) for cls in PEERS]
    chosen = select(peers, args.only)
    if args.list:
        for peer, row in chosen:
            print(f"{row.key:24} {peer.name:8} {row.site:12} N={row.calls:<9,} {row.label}")
        return 0

    baselines = Baselines(
        str(programs.target), args.runs, QUICK_BASELINE_CALLS if args.quick else BASELINE_CALLS
    )
    results: list[RowResult] = []
    versions: list[str] = []
    for peer in dict.fromkeys(p for p, _ in chosen):
        reason = peer.unavailable()
        version = peer.version() if reason is None else ""
        if version:
            versions.append(version)
        for row in (r for p, r in chosen if p is peer):
            calls = args.calls or (row.quick_calls if args.quick else row.calls)
            runs = min(args.runs, row.max_runs or args.runs)
            print(f"{row.key}: {runs} x {calls:,} calls", file=sys.stderr, flush=True)
            if reason is not None:
                results.append(_unavailable(row, runs, calls, reason))
                continue
            results.append(measure_row(peer, row, runs, calls, baselines))

    print(render(results, args.runs, versions))
    if args.json is not None:
        options = {"runs": args.runs, "calls": args.calls, "only": args.only, "quick": args.quick}
        write_json(args.json, to_json(results, baselines, options, versions))
    return 0


def _unavailable(row: Row, runs: int, calls: int, reason: str) -> RowResult:
    cells = {p: Cell(placement=p, calls=calls, error=f"unavailable: {reason}") for p in PLACEMENTS}
    return RowResult(row=row, runs=runs, calls=calls, cells=cells)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
