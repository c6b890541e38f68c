"""The signal state a child we fork gives the command it execs: the one it would have without us.

An ignored signal stays ignored across ``execve``, and a blocked one stays blocked. CPython
ignores SIGPIPE and SIGXFSZ at its startup (a write to a closed pipe raises BrokenPipeError
instead of killing it), so a command the tool starts inherited both: ``yes | head -1`` under
``count -c`` printed "Broken pipe" and exited 1 where ``yes`` is killed by SIGPIPE (status
141) without us. Handlers need nothing (``execve`` makes every caught signal SIG_DFL), and a
signal the tool itself inherited as ignored (SIGINT in a shell's background job) stays
ignored, as the command would have inherited it from that shell.

So a forked child calls ``restore_signals()`` before it execs: SIGPIPE and SIGXFSZ back to
SIG_DFL, and an empty signal mask (the tool blocks SIGCHLD around its waits, and a caller of
the API may block what it likes in the thread that spawns). It is what ``subprocess`` does
with ``restore_signals=True``, and an empty mask besides. Rejected: resetting every ignored
signal (it would undo the shell's own choices, ``nohup``'s SIGHUP included).
"""

from __future__ import annotations

import signal
from typing import Final

PYTHON_IGNORED: Final = (signal.SIGPIPE, signal.SIGXFSZ)  # set to SIG_IGN by CPython's startup


def restore_signals() -> None:
    """In a forked child, before ``execve``: the dispositions and mask a command starts with."""
    for sig in PYTHON_IGNORED:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
