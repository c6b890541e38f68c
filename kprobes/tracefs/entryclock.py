"""Entry times for the kernel's return events, from a hidden entry event.

A kretprobe event says when a function returned, never when it was entered, and ``latency``
needs both (the Process target's return events carry ``entry_timestamp``). So a return probe
placed with ``entry_times=True`` gets a second event at the function's entry that is never
listed nor delivered: its records push a timestamp per (return event, thread), and each
return pops the newest, as calls nest.

A return whose entry the kernel missed (maxactive exhausted) leaves an entry behind, which a
later return of an outer call may take; the kernel counts such misses in ``nmissed`` and the
summary shows them. Rejected: synthetic events with hist triggers (``onmatch``), which differ
between kernel versions and cannot hand per-call values to Python.
"""

from __future__ import annotations

from typing import Final

from kprobes.model import Event

MAX_DEPTH: Final = 4096  # entry times kept per thread and return probe


class EntryClocks:
    """The pairs (hidden entry event, return event) of one target, by event name."""

    def __init__(self) -> None:
        self._return_of: dict[str, str] = {}  # hidden entry event → its return event
        self._returns: set[str] = set()
        # (return event, tid) → the entry times of the calls in flight, newest last.
        self._calls: dict[tuple[str, int], list[float]] = {}

    def __bool__(self) -> bool:
        return bool(self._returns)

    def add(self, entry_event: str, return_event: str) -> None:
        self._return_of[entry_event] = return_event
        self._returns.add(return_event)

    def remove(self, return_event: str) -> None:
        self._returns.discard(return_event)
        for entry, ret in list(self._return_of.items()):
            if ret == return_event:
                del self._return_of[entry]
        for key in [key for key in self._calls if key[0] == return_event]:
            del self._calls[key]

    def pair(self, events: list[Event]) -> list[Event]:
        """``events`` without the hidden entries, whose times go to their returns."""
        out = []
        calls, return_of, returns = self._calls, self._return_of, self._returns
        for event in events:
            name = event.event
            ret = return_of.get(name)
            if ret is not None:
                stack = calls.setdefault((ret, event.tid), [])
                if len(stack) < MAX_DEPTH:
                    stack.append(event.timestamp)
            elif name in returns:
                stack = calls.get((name, event.tid), [])
                out.append(event._replace(entry_timestamp=stack.pop()) if stack else event)
            else:
                out.append(event)
        return out
