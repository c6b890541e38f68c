"""Per-hit overhead of a probe, for our tool and its peers, measured side by side.

Run by ``make bench`` as ``python -m bench``; not part of the test suite (one smoke test runs
the cheap peers in ``--quick`` mode).

What is measured: ``bench/target.c`` calls one small function N times and times the loop itself
with ``CLOCK_MONOTONIC``, so a tool's start-up, symbol loading and teardown never enter the
figure. Rows of several threads (``threads=T``: the N calls split between T threads) are timed
in the threads' CPU time instead, and so is their baseline. The overhead of a probe is the
program's ns per call with the probe minus its ns per call without one (the median of each, over
R runs), on the same machine in the same run. Every run's hit count is checked against N: a
tool that misses or double-counts hits is marked so, never silently averaged in.

Every tool runs as a separate process, twice per run: "pinned" under ``taskset -c 0`` (the tool
and the program it starts share CPU 0, so each stop is a switch on one CPU) and "unpinned"
(the scheduler is free to put them on different CPUs, which on a VM makes every wake-up an
inter-processor interrupt). The alternative of measuring inside one Python process was rejected:
it could not pin the peer alone, and a crash of one peer would take the others down.

Modules: ``build`` compiles the C programs, ``elf`` turns symbols into addresses and file
offsets, ``peer`` defines what a peer is, ``measure`` runs and checks the cells, ``report``
prints the tables and writes the JSON (``report_optimized`` the optimized probes' goals), and
one ``peer_*`` module per tool (``peer_optimized``: our optimized probes and the C detour
floor).
"""
