"""SIGTERM and SIGHUP unwind like an exception while any target holds patched state.

Both targets (a traced process, a tracefs session) must undo what they did on every way out
that can be caught. ``atexit`` and ``finally`` cover a normal end and exceptions; SIGTERM and
SIGHUP would kill the tool without running either, so while anything is held they raise
``SystemExit`` instead. One registry serves every target, so that one target letting go
never takes the handlers away from another that still holds state.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Final

CAUGHT: Final = (signal.SIGTERM, signal.SIGHUP)
_holders: set[int] = set()
_saved_handlers: dict[int, Any] = {}


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def hold_exit_signals(holder: object) -> None:
    """``holder`` has state to undo: SIGTERM/SIGHUP become SystemExit (if they were default)."""
    _holders.add(id(holder))
    if threading.current_thread() is threading.main_thread():
        for sig in CAUGHT:
            if sig not in _saved_handlers and signal.getsignal(sig) is signal.SIG_DFL:
                _saved_handlers[sig] = signal.signal(sig, _raise_exit)


def release_exit_signals(holder: object) -> None:
    """``holder`` has nothing left to undo; the last one out restores the handlers."""
    _holders.discard(id(holder))
    if not _holders and threading.current_thread() is threading.main_thread():
        for sig, handler in list(_saved_handlers.items()):
            if signal.getsignal(sig) is _raise_exit:
                signal.signal(sig, handler)
            del _saved_handlers[sig]
