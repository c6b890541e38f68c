"""x86-64 Linux syscall numbers of the calls we make the program run (injections) or watch it
make (the loader's startup): one table, not a constant per module."""

from __future__ import annotations

from typing import Final

NR_CLOSE: Final = 3
NR_MMAP: Final = 9
NR_MPROTECT: Final = 10
NR_MUNMAP: Final = 11
NR_RT_SIGACTION: Final = 13
NR_MADVISE: Final = 28
NR_FTRUNCATE: Final = 77
NR_OPENAT: Final = 257
NR_MEMFD_CREATE: Final = 319
