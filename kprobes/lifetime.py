"""Every live target is closed on every way out that can be caught; SIGTERM and SIGHUP unwind.

Every target (a traced process, a tracefs session) must undo what it did on every way out
that can be caught. ``finally`` and the ``with`` block cover exceptions; the ``atexit`` hook
here closes whatever is still live when the interpreter ends, the newest first; SIGTERM and
SIGHUP would kill the tool without running either, so while anything is held they raise
``SystemExit`` instead. One registry (``remember``/``forget``) serves every target, so that
one target letting go never takes the handlers away from another that still holds state.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import signal
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Final, Protocol

CAUGHT: Final = (signal.SIGTERM, signal.SIGHUP)


class Closable(Protocol):
    def close(self) -> None: ...


_live: weakref.WeakValueDictionary[int, Closable] = weakref.WeakValueDictionary()
_order = itertools.count()


def remember(target: Closable) -> None:
    """Close ``target`` at interpreter exit, and let SIGTERM/SIGHUP unwind to its ``close``."""
    if not is_live(target):
        _live[next(_order)] = target
    hold_exit_signals(target)


def forget(target: Closable) -> None:
    for key, live in list(_live.items()):
        if live is target:
            del _live[key]
    release_exit_signals(target)


def is_live(target: Closable) -> bool:
    return any(live is target for live in _live.values())


@atexit.register
def _close_everything() -> None:
    for key in sorted(_live.keys(), reverse=True):
        target = _live.get(key)
        if target is not None:
            with contextlib.suppress(Exception):
                target.close()


_holders: set[int] = set()
_saved_handlers: dict[int, Any] = {}


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def hold_exit_signals(holder: object) -> None:
    """``holder`` has state to undo: SIGTERM/SIGHUP become SystemExit (if they are default,
    also if someone set them back to it while another holder held them)."""
    _holders.add(id(holder))
    if threading.current_thread() is threading.main_thread():
        for sig in CAUGHT:
            if _handler_of(sig) is signal.SIG_DFL:
                _saved_handlers.setdefault(sig, _set_handler(sig, _raise_exit))


def release_exit_signals(holder: object) -> None:
    """``holder`` has nothing left to undo; the last one out restores the handlers."""
    _holders.discard(id(holder))
    if not _holders and threading.current_thread() is threading.main_thread():
        for sig, handler in list(_saved_handlers.items()):
            if _handler_of(sig) is _raise_exit:
                _set_handler(sig, handler)
            del _saved_handlers[sig]


# -- sections that no signal may cut in two ---------------------------------------------------

# The signals whose Python handlers may raise at any bytecode: SIGINT (KeyboardInterrupt),
# SIGTERM and SIGHUP (SystemExit above, or the command line's ending), SIGALRM (the command
# line's recheck of a deferred SIGINT, cli/sigint.py).
DEFERRED: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)
_depth = 0
_came: list[int] = []
_swapped: dict[int, Any] = {}  # in an uninterrupted block: the handlers it leaves
_entry: dict[int, Any] = {}  # and those it found (a signal noted is handled by these)


def _handler_of(sig: int) -> Any:
    """The handler of ``sig``, the one an ``uninterrupted`` block will put back if it holds
    the signal now."""
    current = signal.getsignal(sig)
    return _swapped.get(sig, current) if current is _note else current


def _set_handler(sig: int, handler: Any) -> Any:
    """``signal.signal``, or, while an ``uninterrupted`` block holds ``sig``, the handler it
    puts back (``hold_exit_signals`` called in a detach). Returns the previous one."""
    if signal.getsignal(sig) is _note and sig in _swapped:
        previous, _swapped[sig] = _swapped[sig], handler
        return previous
    return signal.signal(sig, handler)


def _note(signum: int, frame: FrameType | None) -> None:
    if signum not in _came:
        _came.append(signum)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the block to its end: a signal of ``DEFERRED`` that comes meanwhile is raised
    again right after it, where the handler it finds then runs.

    For what leaves the program harmed if an exception cuts it in two: the three writes of a
    jump (breakpoints.py), a whole detach. Python runs signal handlers in the main thread
    only, between two bytecodes; so in the main thread the handlers are swapped for one that
    notes the signal, and elsewhere nothing is needed. Nested blocks swap once. Rejected:
    ``pthread_sigmask`` alone (a program of ours with another thread has the signal taken
    there, and the main thread still runs the handler at its next bytecode); catching the
    exception and redoing the work (a second signal cuts the redo too: malloc was left as an
    int3 before the jump's four bytes, and the program died of it).
    """
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        for deferred in DEFERRED:
            if signal.getsignal(deferred) is not None:  # None: not Python's to swap back
                _entry[deferred] = _swapped[deferred] = signal.signal(deferred, _note)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            entry, leave = dict(_entry), dict(_swapped)
            _entry.clear()
            _swapped.clear()
            for sig, handler in entry.items():
                if signal.getsignal(sig) is _note:  # else set in the block: that one stays
                    signal.signal(sig, handler)
            came, _came[:] = list(_came), []
            try:  # each signal that came, handled as it would have been when it came
                for signum in came:
                    signal.raise_signal(signum)
            finally:  # then what the block set (hold/release_exit_signals)
                for sig, handler in leave.items():
                    if signal.getsignal(sig) is entry[sig]:
                        signal.signal(sig, handler)
