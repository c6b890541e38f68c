"""The command line's stress test, in its short form (``make stress`` runs the long one).

Every command, optimized or not, attached to result-checking programs (a 4-thread C checker
and a live Python) and ended every way, SIGKILL included, under load from another process:
see ``tests/stress_commands.py`` for what is checked. The seed is printed: a failure is
reproduced with ``python tests/stress_commands.py --seed SEED``.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import stress_commands

pytestmark = pytest.mark.ptrace

KNOWN_DEATH = re.compile(r"^\w+ .* opt \w+ on python: the target died \(status -11\)")
SECONDS = float(os.environ.get("KPROBES_STRESS_SECONDS", "60"))


@pytest.mark.deadline(SECONDS + 900)
def test_every_command_ended_every_way_harms_nothing(capsys):
    seed = random.randrange(1 << 32)
    with capsys.disabled():
        print(f"\nstress_commands seed {seed}")
    tally = stress_commands.stress(SECONDS, seed, load=True, verbose=False)
    known = [f for f in tally.failures if KNOWN_DEATH.search(f)]
    others = [
        f
        for f in tally.failures
        if f not in known and not (known and f.startswith("python ended with status -11"))
    ]
    assert not others, f"seed {seed}: " + "\n".join(tally.failures)
    if known:
        # Issue 17: an ending of an optimized command on a live Python once left an int3
        # before a jump's four bytes at malloc (cc 0b 47 b2 ff); the program died later of a
        # corrupted heap. Seen in about 1 round of 100. Two ways to it are closed (a signal
        # raised into the ending, a signal between two writes of a detach: decisions.md, "No
        # signal cuts a jump's three writes or a detach in two"), and one more way is still
        # open there (a first byte put back under the jump by a writer outside the tool's
        # write path): this stays an expected failure until that is found.
        pytest.xfail(f"seed {seed}: the known SIGSEGV after an optimized ending: {known[0]}")
    assert tally.rounds >= 1
