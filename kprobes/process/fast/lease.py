"""The reader's lease on its rings (``--block``): producers wait for room while the tool lives.

A record detour that ``may_wait`` retries a full ring while ``rdtsc`` is below the area's
``block_until`` word (shared_area.py). ``Lease`` keeps that word ``LEASE`` seconds ahead of
now, from a thread of the tool that renews it every ``RENEW`` seconds for as long as the
session wants every record: from the first record probe that may wait until the reader stops
reading (``release``: a discard, the detach, exec). What releases the program:

- the tool's death: nothing renews; every waiting thread goes on (and drops) at most
  ``LEASE`` later, once;
- the tool stopped (^Z, SIGSTOP): its renewing thread is stopped with it, likewise;
- ``release`` (detach, discard, exec): the word is set to 0 at once.

While the tool lives and runs, the program waits for as long as the reader needs: a reader
whose output is blocked (``| less``, paused) holds the program, as a full pipe holds a
writer. That is what ``--block`` asks for.

Rejected: renewing at each read of the rings (a reader busy in a slow handler, or not yet
polling while the session starts, let the lease run out under load, and the program dropped
events the user asked to keep: 267,776 of 1,600,000 in one run); a longer fixed bound per
record (a dead tool would cost that bound on every hit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.linux.tsc import read_tsc, ticks_per_second

LEASE: Final = 1.0  # seconds ahead of now; what a dead or stopped tool costs, once
RENEW: Final = 0.1  # seconds between two renewals


class Lease:
    """The ``block_until`` word of every ring of one address space, kept ahead of now by a
    thread while ``is_held``."""

    def __init__(self, views: Callable[[], Iterable[memoryview]]) -> None:
        self._views = views
        self._ticks = int(ticks_per_second() * LEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_held(self) -> bool:
        return self._thread is not None

    def hold(self) -> None:
        """Producers may wait from now on (renewed until ``release``); idempotent."""
        if self._thread is not None:
            return
        self._renew()  # before the first detour that may wait goes in
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep, name="kprobes-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """No producer waits any more: a full ring drops from now on. The renewing thread is
        gone before the word is cleared (it would write it again)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        for view in self._views():
            sa.set_lease(view, 0)

    def _keep(self) -> None:
        while not self._stop.wait(RENEW):
            self._renew()

    def _renew(self) -> None:
        until = read_tsc() + self._ticks
        for view in self._views():
            sa.set_lease(view, until)
