"""Run by the cleanup tests: open a Uprobes session on PROGRAM's ``work``, print its group and
instance, then wait to be signalled (SIGTERM must clean up; SIGKILL leaves a stale session)."""

from __future__ import annotations

import sys
import time

from kprobes.core.probes import Kprobe
from kprobes.tracefs import Uprobes


def main() -> None:
    target = Uprobes(path=sys.argv[1])
    target.register_kprobe(Kprobe(symbol="work"), ["x=%di:s64"])
    print(target.group, target.instance, flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
