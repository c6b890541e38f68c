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
import tempfile
from typing import Protocol

from kprobes import lifetime
from kprobes.model import ProbeListing


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
    for base in ("/run/kprobes", os.path.join(tempfile.gettempdir(), f"kprobes-{os.getuid()}")):
        try:
            os.makedirs(base, mode=0o755, exist_ok=True)
            if os.access(base, os.W_OK):
                return base
        except OSError:
            continue
    raise OSError("no writable directory for kprobes state")


def state_path(pid: int) -> str:
    return os.path.join(state_dir(), f"{pid}.json")


def publish(proc: Traced, listing: list[ProbeListing]) -> None:
    if not lifetime.is_live(proc):
        remove_state(proc.pid)
        return
    data = {"tracer": os.getpid(), "pid": proc.pid, "probes": [e.to_json() for e in listing]}
    try:
        path = state_path(proc.pid)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
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
    try:
        os.kill(tracer, 0)
    except OSError:
        return None
    return tracer, [ProbeListing.from_json(e) for e in data.get("probes", [])]
