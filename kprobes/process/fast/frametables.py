"""The compact frame tables in the program, for the stack walks of its record detours.

A record probe that takes the user stack on the fast tier (issue 23, item 5) walks it in
the detour (arch/x86_64/stackwalk.py) over the compact tables of every file the program
maps executable (symbols/frametable.py, compiled once per file in the tool), packed with
a directory of the mappings. This module puts them in the program and keeps them current:

- **Where.** The packed directory and its tables go in private read-write memory the
  program maps for us (``ProgramCalls.map_data``) and the tool writes; the detour finds it
  through one word, a counter of a shared area (``WalkTables.cell``), that holds its
  address (an ``indirect`` walk reads it once a frame). Detours embed the word's address,
  which never changes while the image lives.
- **When.** At the first walk, when the fast return probes' shadow stacks and
  trampolines are made (a walk reads a hooked frame's real return address there), and
  then whenever code comes or goes (``refresh`` is one of
  the code watchers of process/following/: the exec's image, each library the loader maps
  at startup, ``dlopen`` and ``dlclose`` at the rendezvous), before the pending probes of
  new code are placed. Nothing is rebuilt when the executable mappings did not change.
- **How it changes under running threads.** A new directory is written whole into a new
  mapping, then the word is set to it (one aligned 8-byte store through the tool's
  mapping of the area). A walk in another thread reads the old directory or the new, each
  complete; the old mapping is never reused nor unmapped while the image lives (a walk
  may be in it), and goes at the clean end with the other pages of ours
  (survival/unmapping.py).

Rejected: the tables in the shared area itself (its size is fixed when the program maps it,
and a library's table alone is hundreds of KB: libc's is 339 KB); one mapping rewritten in
place (a thread walking it meanwhile reads half of each, and can give a wrong stack); a
mapping per file with the directory alone rebuilt (less memory at each ``dlopen``, but the
walker's offsets are 32-bit and from the directory's entry: the tables would have to lie
within 4 GiB above it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

from kprobes.arch.x86_64 import shared_area as sa
from kprobes.arch.x86_64.stackwalk import MappedTable, StackWalk, pack_directory
from kprobes.errors import ProbeError
from kprobes.symbols.frametable import table_of
from kprobes.symbols.maps import iter_modules

if TYPE_CHECKING:
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.fast.state import JumpState
    from kprobes.process.inject.program import ProgramCalls

_PAGE: Final = 4096
_Key = tuple[int, int, int, str]


class FrameTables:
    """The frame tables of one address space in its own memory, for record detours."""

    def __init__(self, program: Attachment, injector: ProgramCalls, state: JumpState) -> None:
        self.pid = program.pid
        self._program = program
        self._injector = injector
        self._state = state
        # Where ``refresh`` asks to be called when code comes or goes (Following's code
        # watchers: target.py sets it); None: nobody calls it (the tables stay as made).
        self.code_watchers: list[Callable[[], None]] | None = None

    def walk(self, area_index: int, max_returns: int) -> StackWalk | str:
        """A walk of at most ``max_returns`` return addresses over the tables, published
        first if they are not yet (a str says why there can be none)."""
        tables = self._state.tables
        if not tables.cell:
            area = self._state.areas[area_index]
            if area.next_counter >= area.layout.ncounters:
                return "no counter left in the shared area for the frame tables' directory"
            index = area.next_counter
            area.next_counter += 1
            tables.cell_area, tables.cell_offset = area_index, area.layout.counter_offset(index)
            tables.cell = area.addr + tables.cell_offset
            self._set_cell(0)
            watchers = self.code_watchers
            if watchers is not None and self.refresh not in watchers:
                watchers.append(self.refresh)
        try:
            self.refresh()
        except ProbeError as exc:
            return f"the frame tables could not be put in the program: {exc}"
        return StackWalk(tables.cell, max_returns, indirect=True)

    def refresh(self) -> None:
        """Code came or went: a new directory in the program if the executable mappings
        changed since the last one (Steps 1-3 of the module docstring's "how")."""
        tables = self._state.tables
        if not tables.cell:
            return
        # Step 1: the tables of what is mapped now (each file's compiled once, cached).
        mapped = list(self._mapped())
        # And where the fast return probes keep the real return addresses (their shadow
        # stacks) and their trampolines: a walk goes through a hooked frame (stackwalk.py).
        stacks = self._state.returns
        returns = (stacks.shadow, *stacks.tramp_range()) if stacks.shadow else (0, 0, 0)
        key = (*(k for k, _ in mapped), returns)
        if key == tables.published:
            return
        blob = pack_directory([m for _, m in mapped], returns)
        # Step 2: a new mapping, written whole before anything points to it.
        size = -(-len(blob) // _PAGE) * _PAGE
        addr = self._injector.map_data(size)
        tables.regions.append((addr, size))
        self._program.memory().write(addr, blob)
        # Step 3: the word points to it; the old one stays (a walk may be reading it).
        self._set_cell(addr)
        tables.published = key

    def _set_cell(self, value: int) -> None:
        """One aligned 8-byte store (a memoryview of ``Q``s: never a byte at a time)."""
        tables = self._state.tables
        view = self._state.areas[tables.cell_area].view
        assert tables.cell_offset % 8 == 0 and tables.cell_offset < sa.PAGE + len(view)
        view.cast("Q")[tables.cell_offset // 8] = value

    def _mapped(self) -> Iterator[tuple[_Key, MappedTable]]:
        """Each executable mapping of a file and its file's table, as the walker reads
        them; a file whose table cannot be read is left out (its frames are uncovered:
        the walker follows the frame pointer there, as the trap tier's unwinder does)."""
        pid = self.pid
        for module in iter_modules(pid):
            first = module.mappings[0]
            path = f"/proc/{pid}/root{module.path}"
            if first.is_deleted or not os.path.exists(path):
                path = f"/proc/{pid}/map_files/{first.start:x}-{first.end:x}"
            try:
                table = table_of(path)
            except (OSError, ProbeError):
                continue
            data = table.to_bytes()
            for m in module.mappings:
                if "x" in m.perms:
                    key = (m.start, m.end, module.bias, module.path)
                    yield key, MappedTable(m.start, m.end, module.bias, data, len(table))
