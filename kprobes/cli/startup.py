"""The tool as a process of its own: what its start-up leaves to the garbage collector.

Everything the tool imports lives until it exits: the modules, their classes and functions,
the tables they build. CPython's collector walks all of them again in each full collection,
and once more at the interpreter's end (~30-40 ms of the exit of a ``count -c true`` on
this project's machines, docs/performance.md). When the console script runs (``entry``),
the objects alive once the engine is imported are moved to the collector's permanent
generation (``gc.freeze``), which it never walks: the exit takes ~10 ms, and the run's own
collections walk only what the run made. The collector stays on: what the run makes is
collected as before.

Until then the youngest generation is collected every 50,000 allocations instead of 700:
the imports make ~150,000 objects that all live, and the ~45 collections the default makes
among them cost ~10 ms. ``settled()`` puts the default back.

Only the console script does this: ``main()`` called in another program (the tests, a
benchmark's harness) leaves that program's collector alone, as it should a library's host.
Rejected: ``gc.disable()`` during the imports (a command that never reaches ``settled()``
would run with no collector; with the raised threshold it runs with a lazier one), and
``os._exit`` after the summary (a file some handler left unflushed would lose its end).
"""

from __future__ import annotations

import gc

STARTING_THRESHOLD = 50_000  # allocations between two collections of the youngest generation

_default_threshold: tuple[int, ...] | None = None  # set while the console script starts


def own_process() -> None:
    """The console script starts the tool: a lazier collector until ``settled()``."""
    global _default_threshold
    _default_threshold = gc.get_threshold()
    gc.set_threshold(STARTING_THRESHOLD, *_default_threshold[1:])


def settled() -> None:
    """The engine is imported: in the tool's own process, leave what is alive to the
    permanent generation and collect as by default from now on (once)."""
    global _default_threshold
    if _default_threshold is not None:
        gc.freeze()
        gc.set_threshold(*_default_threshold)
        _default_threshold = None
