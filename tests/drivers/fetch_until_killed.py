"""A kprobes user whose code of its own faults on fetches, until the test SIGKILLs it.

    fetch_until_killed.py PID START END [--no-activate]

Attaches to PID (tests/programs/fetchfault.c), declares [START, END) as code of ours (as
``map_xol_page`` does for each detour page), makes the rescue the program's SIGSEGV and
SIGBUS handler (``activate_fetch_faults``, as the optimizer does before the first detour that
fetches through a pointer; not with ``--no-activate``), prints ``ready`` and dispatches stops
until it is killed. Nothing here restores anything: SIGKILL gives it no chance.
"""

from __future__ import annotations

import argparse
import sys

import kprobes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("pid", type=int)
    parser.add_argument("start", type=lambda text: int(text, 16))
    parser.add_argument("end", type=lambda text: int(text, 16))
    parser.add_argument("--no-activate", action="store_true")
    opts = parser.parse_args()
    with kprobes.attach(opts.pid) as proc:
        proc._calls.note_own_code(opts.start, opts.end)
        if not opts.no_activate and not proc._calls.activate_fetch_faults():
            print(f"no rescue: {proc._tracer.rescue.unavailable}", flush=True)
            return 1
        print("ready", flush=True)
        proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
