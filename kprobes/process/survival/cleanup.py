"""Every way out of the tool puts the program back as it was.

While a ``Process`` is traced, SIGTERM and SIGHUP (whose default action would kill the tool
without unwinding) are turned into ``SystemExit`` in the main thread, so the ``with`` block or
``try/finally`` around the trace detaches as it does for Ctrl-C's ``KeyboardInterrupt``. The
``atexit`` hook of ``lifetime.py`` detaches whatever is still attached when the interpreter
ends. Only SIGKILL escapes; nothing can catch it.

This module also publishes each traced process's probe list in a small state file so that
``kprobes list -p PID`` can show it from another shell, like debugfs' ``kprobes/list``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Protocol

from kprobes import lifetime
from kprobes.linux import procfs
from kprobes.model import ProbeListing

PUBLISH_INTERVAL = 0.5  # seconds between two writes of a state file while probes change


class Traced(Protocol):
    """What cleanup needs of a traced process (a ``Process``)."""

    @property
    def pid(self) -> int: ...

    def close(self) -> None: ...


def remember(proc: Traced) -> None:
    lifetime.remember(proc)


def forget(proc: Traced) -> None:
    lifetime.forget(proc)
    remove_state(proc.pid)


# -- the state files behind `kprobes list -p PID` -----------------------------------------


def state_dir() -> str:
    for base in ("/run/kprobes", None):
        if base is None:  # /run is not ours: tempfile (~4 ms of imports) only then
            import tempfile

            base = os.path.join(tempfile.gettempdir(), f"kprobes-{os.getuid()}")
        try:
            os.makedirs(base, mode=0o755, exist_ok=True)
            if os.access(base, os.W_OK):
                return base
        except OSError:
            continue
    raise OSError("no writable directory for kprobes state")


def state_path(pid: int) -> str:
    return os.path.join(state_dir(), f"{pid}.json")


class StateFile:
    """The state file of one traced process, written at most every ``PUBLISH_INTERVAL``
    seconds while its probes change: placing thousands of probes in short stops of the
    program (``Process.batch`` each) would otherwise list them all again after each stop.
    ``flush`` writes a change not written yet (``Process.run`` does before it waits).
    Rejected: a write per change (quadratic in the number of probes placed), and none until
    ``run()`` (``kprobes list -p`` would not see probes a script placed and holds)."""

    def __init__(self, proc: Traced, listing: Callable[[], list[ProbeListing]]) -> None:
        self._proc = proc
        self._listing = listing
        self._written = -PUBLISH_INTERVAL
        self._is_due = False

    def publish(self) -> None:
        if lifetime.is_live(self._proc) and time.monotonic() - self._written < PUBLISH_INTERVAL:
            self._is_due = True
        else:
            self._write()

    def flush(self) -> None:
        if self._is_due:
            self._write()

    def _write(self) -> None:
        self._is_due = False
        self._written = time.monotonic()
        proc = self._proc
        if not lifetime.is_live(proc):
            remove_state(proc.pid)
            return
        probes = [e.to_json() for e in self._listing()]
        data = {"tracer": os.getpid(), "pid": proc.pid, "probes": probes}
        try:
            path = state_path(proc.pid)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(data))  # one write: json.dump writes piece by piece
            os.replace(tmp, path)
        except OSError:
            pass  # the list command is a convenience; tracing goes on without it


def remove_state(pid: int) -> None:
    try:
        path = state_path(pid)
        with open(path) as f:
            owner = json.load(f).get("tracer")
        if owner == os.getpid():
            os.unlink(path)
    except (OSError, ValueError):
        pass


def read_state(pid: int) -> tuple[int, list[ProbeListing]] | None:
    """(tracer pid, listing) published for ``pid`` by a live kprobes session, else None."""
    try:
        with open(state_path(pid)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    tracer = int(data.get("tracer", 0))
    if not _is_traced_by(pid, tracer):
        return None  # a file a killed tool left (its pids may be anyone's by now)
    return tracer, [ProbeListing.from_json(e) for e in data.get("probes", [])]


def _is_traced_by(pid: int, tracer: int) -> bool:
    """``pid`` is traced by a thread of the process ``tracer``: with pids reused (32768 of
    them by default), a live tracer pid alone did not say the file was still true."""
    try:
        traced_by = int(procfs.read_status(pid).get("TracerPid", "0"))
    except (OSError, ValueError):
        return False
    return traced_by != 0 and procfs.tgid_of(traced_by) == tracer
