"""``--linear MIN,MAX,STEP`` (cli/linear.py): bpftrace's lhist buckets for ``hist`` and
``latency``, on every tier: aggregated in the program (arch/x86_64/retstack.py ``Linear``)
where the function's entry takes a jump, else from the events (traps, records, the kernel).

The values are exact: ``rets threads T N D`` has each of T threads call rec(D) N times, and
rec(k) returns k(k+1)/2 for every k from 0 to D, so each bucket's count is known. Durations
are not: for ``latency`` the buckets must add up to the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import support
from test_fast_returns import optimized
from test_retprobes import run_to_exit, start

from kprobes import Kretprobe
from kprobes.output.hist import LinearHistogram

pytestmark = pytest.mark.ptrace


@pytest.fixture
def rets(build: Callable[[str], Path]) -> Path:
    return build("rets")


def buckets(stdout: str) -> dict[str, int]:
    """bpftrace's lhist rows: ``[10, 20)   12 |@@@  |`` → {"[10, 20)": 12}."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith(("[", "(")) and "|" in line:
            label, _, rest = line.partition(")")
            out[label + ")"] = int(rest.split("|")[0])
    return out


def expected(threads: int, calls: int, depth: int, low: int, high: int, step: int) -> dict:
    hist = LinearHistogram(low, high, step)
    for k in range(depth + 1):
        hist.add(k * (k + 1) // 2, threads * calls)
    return buckets(hist.format())


@pytest.mark.parametrize(
    "linear",
    [(0, 100, 10), (5, 200, 7), (-50, 100, 25), (0, 3000, 1)],
    ids=["in-the-program", "uneven-step", "negative-min-from-records", "2000-slots-from-records"],
)
def test_hist_linear_of_return_values_is_exact_on_both_tiers(rets, linear):
    threads, calls, depth = 3, 4, 60
    command = f"{rets} threads {threads} {calls} {depth}"
    option = ",".join(map(str, linear))
    spec = "r rec ret=$retval:u64"
    fast = support.cli("hist", f"--linear={option}", "-c", command, spec, "--key", "ret")
    traps = support.cli(
        "hist", "--no-optimize", f"--linear={option}", "-c", command, spec, "--key", "ret"
    )
    assert fast.returncode == traps.returncode == 0, fast.stderr + traps.stderr
    want = expected(threads, calls, depth, *linear)
    assert buckets(fast.stdout) == buckets(traps.stdout) == want
    assert "@ret:\n" in fast.stdout
    n = threads * calls * (depth + 1)
    assert f"{n} events, {n} hits, 0 missed" in fast.stderr


def test_hist_linear_of_an_entry_arg(rets):
    """An entry's fetched value: rec's argument k, from D down to 0, each call once."""
    r = support.cli(
        "hist", "--linear", "0,30,10", "-c", f"{rets} rec 40", "rec k=%di", "--key", "k"
    )
    assert r.returncode == 0, r.stderr
    assert buckets(r.stdout) == {"[0, 10)": 10, "[10, 20)": 10, "[20, 30)": 10, "[30, ...)": 11}


def test_the_program_fills_linear_slots_of_a_return_probe(spawn, rets, tmp_path):
    """The API's view of what the program aggregated: ``hist_slots`` are the linear
    buckets' (below MIN, the buckets, MAX and above), slot for slot as LinearHistogram's."""
    argv = [rets, "threads", 2, 5, 30]
    proc, out = start(spawn, tmp_path, argv)
    rp = Kretprobe(symbol="rec", optimize=True)
    rp.value_bits, rp.linear = 64, (3, 100, 20)
    proc.register_kretprobe(rp)
    assert optimized(proc, rp)
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output(argv)
    proc.list()  # the program's counts read
    want = LinearHistogram(3, 100, 20)
    for k in range(31):
        want.add(k * (k + 1) // 2, 2 * 5)
    assert rp.hist_slots == want.slots
    assert rp.hist_total == 2 * 5 * sum(k * (k + 1) // 2 for k in range(31))


@pytest.mark.parametrize("optimize", [True, False], ids=["in-the-program", "no-optimize"])
def test_latency_linear_counts_every_call(rets, optimize):
    threads, calls, depth = 2, 3, 500
    argv = f"{rets} threads {threads} {calls} {depth}"
    flags = [] if optimize else ["--no-optimize"]
    r = support.cli("latency", *flags, "--linear", "0,20000,1000", "-c", argv, "rec")
    assert r.returncode == 0, r.stderr
    n = threads * calls * (depth + 1)
    assert sum(buckets(r.stdout).values()) == n
    assert "@nsecs:\n" in r.stdout and f"count: {n}\n" in r.stdout


def test_linear_is_refused_when_it_makes_no_buckets(rets):
    r = support.cli("latency", "--linear", "10,5,1", "-c", f"{rets} rec 3", "rec")
    assert r.returncode != 0 and "--linear" in r.stderr and "greater than min" in r.stderr
    r = support.cli(
        "hist", "-H", "--linear", "0,5,1", "-c", f"{rets} rec 3", "rec k=%di", "--key", "k"
    )
    assert r.returncode != 0 and "not allowed with" in r.stderr


@support.needs_uprobes
def test_hist_linear_on_the_kernels_uprobes_matches_ours(rets):
    threads, calls, depth = 2, 2, 30
    command = f"{rets} threads {threads} {calls} {depth}"
    spec = "r rec ret=$retval:u64"
    kernel = support.cli(
        "hist", "--backend", "uprobes", "--linear", "0,300,50", "-c", command, spec, "--key", "ret"
    )
    assert kernel.returncode == 0, kernel.stderr
    assert buckets(kernel.stdout) == expected(threads, calls, depth, 0, 300, 50)
