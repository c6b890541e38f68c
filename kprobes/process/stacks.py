"""Stack traces of a stopped thread, for handlers: ``proc.backtrace(regs)``.

Frames come from each module's unwind tables (``symbols/unwind.py``), read through the
process's own view of its files (its mount namespace; the mapped inode of a file deleted
since). A frame hooked by a kretprobe shows its real return address, asked of the trampoline,
never the trampoline itself.

``Backtraces`` is a part of ``Process`` (target.py), which hands ``backtrace`` on.
"""

from __future__ import annotations

import builtins
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kprobes.process.engine.attachment import Attachment


class Backtraces:
    """``backtrace()`` for ``Process``."""

    def __init__(self, program: Attachment) -> None:
        self._program = program

    def backtrace(self, regs: Any, max_frames: int = 64) -> builtins.list[tuple[int, str]]:
        """The call stack of the thread whose registers are ``regs``, innermost first.

        Each frame is ``(address, "func+0xoff [module]")``: the thread's ``rip``, then return
        addresses, found from each module's unwind tables (see ``symbols/unwind.py``). A frame
        hooked by a kretprobe shows its real return address, never the trampoline. Call it
        from a handler: the thread must be stopped where ``regs`` were taken.
        """
        # Imported on the first backtrace: most sessions never take one (a start-up cost).
        from kprobes.symbols.unwind import FoundBy, unwind

        program = self._program
        pid, resolver, tramp = program.pid, program.symbols(), program.tracer.trampoline
        thread = program.tracer.threads.get(regs.tid)
        refreshed = False
        files: dict[str, str] = {}

        def module_at(addr: int) -> tuple[str, int] | None:
            nonlocal refreshed
            module = resolver.get_module_at(addr)
            if module is None and not refreshed:  # perhaps mapped since the last look
                refreshed = True
                resolver.refresh()
                module = resolver.get_module_at(addr)
            if module is None:
                return None
            # The file as this process sees it (its mount namespace; the mapped inode if the
            # file was deleted since), not the path of the shared ElfImage, which names
            # whichever process opened it first.
            path = files.get(module.path)
            if path is None:
                first = module.mappings[0]
                path = f"/proc/{pid}/map_files/{first.start:x}-{first.end:x}"
                if not first.is_deleted and os.path.exists(f"/proc/{pid}/root{first.path}"):
                    path = f"/proc/{pid}/root{first.path}"
                files[module.path] = path
            return path, module.bias

        def read_word(addr: int) -> int:
            return int.from_bytes(program.memory().read(addr, 8), "little")

        def real_return(slot: int, value: int) -> int:
            # The trampoline keys a hooked frame by the stack pointer after its return.
            if value != tramp.addr or not tramp.addr or thread is None:
                return value
            real = tramp.home_of(thread, slot + 8)
            return value if real is None else real

        out: builtins.list[tuple[int, str]] = []
        for frame in unwind(regs.as_dict(), read_word, module_at, real_return, max_frames):
            # A return address may be the first byte after the function that made the call
            # (a call to a function that never returns): name the call's function.
            exact = frame.how in (FoundBy.FIRST, FoundBy.SIGNAL)
            at = frame.addr if exact else frame.addr - 1
            module = resolver.get_module_at(at)
            found = None if module is None else module.image.function_at(at - module.bias)
            if module is None:
                text = f"{frame.addr:#x}"
            elif found is None:
                text = f"{frame.addr:#x} [{module.name}]"
            else:
                symbol, offset = found
                text = f"{symbol.name}+{offset + frame.addr - at:#x} [{module.name}]"
            out.append((frame.addr, text))
        return out
