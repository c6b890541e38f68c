"""Stack traces of a stopped thread, for handlers: ``proc.backtrace(regs)``, and as values
(``proc.stacks.user_stack(regs)``: the frames of ``trace --stack`` and ``stackcount``).

Frames come from each module's unwind tables (``symbols/unwind.py``), read through the
process's own view of its files (its mount namespace; the mapped inode of a file deleted
since). A frame hooked by a kretprobe shows its real return address, asked of the trampoline,
never the trampoline itself.

A walk that ends before the outermost frame (``_start``, ``clone``) says why in the stack's
``stop``: a frame without unwind table entry and without a usable frame pointer, stack memory
that cannot be read, the depth limit. Those words are short, as a marker frame prints them
(`` => [no unwind info]``).

``Backtraces`` is a part of ``Process`` (target.py), which hands ``backtrace`` on and holds
it as ``proc.stacks``.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kprobes.errors import ProbeError, TargetError
from kprobes.model import StackFrame, UserStack

if TYPE_CHECKING:
    from kprobes.arch.x86_64.stackwalk import WalkResult
    from kprobes.process.engine.attachment import Attachment
    from kprobes.symbols.maps import Module
    from kprobes.symbols.unwind import Frame

# What a marker frame says of a walk that stopped short (symbols/unwind.py's StopReason).
STOP_MARKERS = {
    "outermost": "",
    "no_module": "no unwind info",
    "no_unwind_info": "no unwind info",
    "unknown_register": "no unwind info",
    "unsupported": "no unwind info",
    "unreadable": "stack unreadable",
    "not_outward": "corrupt stack",
    "max_frames": "depth limit",
}


_NAMED = 1 << 16  # named stacks kept at most


class Backtraces:
    """``backtrace()`` for ``Process``, and ``user_stack()`` for the command line."""

    def __init__(self, program: Attachment) -> None:
        self._program = program
        self._main: str | None = None  # the program's own file, as last seen
        # Stacks walked in the program, named (most repeat): for one resolver's modules.
        self._named: dict[tuple[int, WalkResult], UserStack] = {}
        self._named_for = (0, -1)  # (the resolver's id, its generation)

    def backtrace(self, regs: Any, max_frames: int = 64) -> builtins.list[tuple[int, str]]:
        """The call stack of the thread whose registers are ``regs``, innermost first.

        Each frame is ``(address, "func+0xoff [module]")``: the thread's ``rip``, then return
        addresses, found from each module's unwind tables (see ``symbols/unwind.py``). A frame
        hooked by a kretprobe shows its real return address, never the trampoline. Call it
        from a handler: the thread must be stopped where ``regs`` were taken.
        """
        out: builtins.list[tuple[int, str]] = []
        for frame, module, found in self._walk(regs.as_dict(), regs.tid, max_frames):
            if module is None:
                text = f"{frame.addr:#x}"
            elif found is None:
                text = f"{frame.addr:#x} [{module.name}]"
            else:
                name, offset, _size = found
                text = f"{name}+{offset:#x} [{module.name}]"
            out.append((frame.addr, text))
        return out

    def user_stack(
        self, regs: Any, max_frames: int = 127, *, ip: int | None = None, compact: bool = False
    ) -> UserStack:
        """The call stack of the thread whose registers are ``regs`` as a value: each frame
        named ``func+0xOFF/0xSIZE``, ``module`` set for a library's (not the program's own
        file), and why the walk stopped short, if it did. ``ip`` replaces ``regs``' own
        instruction pointer: a return handler gives the real return address, so that the
        stack is the caller's, from where the call returns to. ``compact`` walks with the
        compact frame tables (symbols/tablewalk.py), as the fast tier's walker in the
        program is to: a marker where those tables cannot go on. Call it from a handler."""
        values = regs.as_dict()
        if ip is not None:
            values["rip"] = ip
        try:
            main: str | None = self._program.symbols().main_module().path
        except ProbeError:
            main = None
        frames = []
        stop = ""
        for frame, module, found in self._walk(values, regs.tid, max_frames, compact=compact):
            lib = "" if module is None or module.path == main else module.name
            if found is None:
                frames.append(StackFrame(frame.addr, module=lib))
            else:
                frames.append(StackFrame(frame.addr, found[0], found[1], found[2], lib))
            if frame.stop is not None:
                stop = STOP_MARKERS.get(frame.stop.name.lower(), frame.stop.value)
        return UserStack(tuple(frames), stop)

    def walked(self, ip: int, walk: WalkResult) -> UserStack:
        """The stack of a walk made in the program (the fast tier's record: ``ip``, then
        the return addresses the detour found), named as ``user_stack`` names its frames.

        A return address in code of ours (the trampoline of a return probe on
        breakpoints: the walk in the program goes through those of return probes on jumps)
        ends the stack there, with the marker of a frame without unwind information (the
        frames the walk found past one are not to be trusted), and a wrong frame is never
        shown. Each stack is named once for
        the modules mapped (a busy probe's walks repeat: naming is what the reader pays)."""
        resolver = self._program.symbols()
        if (id(resolver), resolver.generation) != self._named_for:
            self._named.clear()
            self._named_for = (id(resolver), resolver.generation)
        known = self._named.get((ip, walk))
        if known is not None:
            return known
        stack = self._name_walk(ip, walk)
        if (id(resolver), resolver.generation) == self._named_for and len(self._named) < _NAMED:
            self._named[(ip, walk)] = stack
        return stack

    def _name_walk(self, ip: int, walk: WalkResult) -> UserStack:
        resolver = self._program.symbols()
        ours = self._program.tracer.fetch_faults.is_ours
        main = self._main_path()
        frames = [self._frame(ip, ip, main)]
        stop = STOP_MARKERS.get(walk.stop.name.lower(), "")
        refreshed = False
        for addr in walk.returns:
            if ours(addr):
                stop = STOP_MARKERS["no_unwind_info"]
                break
            if not refreshed and resolver.get_module_at(addr - 1) is None:
                refreshed = True  # perhaps mapped since the last look (if it still lives)
                with contextlib.suppress(TargetError):
                    resolver.refresh()
            frames.append(self._frame(addr, addr - 1, main))
        return UserStack(tuple(frames), stop)

    def note_main(self) -> None:
        """Learn the program's own file now, while it lives: records are read after its
        exit too (``walked`` names the program's frames without ``[module]``)."""
        self._main_path()

    def _main_path(self) -> str | None:
        """The program's own file; once it is gone (records read after its exit), the
        last one known."""
        with contextlib.suppress(ProbeError):
            self._main = self._program.symbols().main_module().path
        return self._main

    def _frame(self, addr: int, at: int, main: str | None) -> StackFrame:
        """The frame of ``addr``, named by the function holding ``at`` (``addr - 1`` for
        a return address: the call's own function)."""
        module = self._program.symbols().get_module_at(at)
        lib = "" if module is None or module.path == main else module.name
        found = None if module is None else module.image.function_at(at - module.bias)
        if found is None:
            return StackFrame(addr, module=lib)
        symbol, offset = found
        return StackFrame(addr, symbol.name, offset + addr - at, symbol.size, lib)

    def _walk(
        self, regs: dict[str, int], tid: int, max_frames: int, *, compact: bool = False
    ) -> Iterator[tuple[Frame, Module | None, tuple[str, int, int] | None]]:
        """Each frame of the walk, its module and (function, offset, size) when known."""
        # Imported on the first backtrace: most sessions never take one (a start-up cost).
        from kprobes.symbols.tablewalk import walk
        from kprobes.symbols.unwind import FoundBy, unwind

        program = self._program
        pid, resolver, tramp = program.pid, program.symbols(), program.tracer.trampoline
        thread = program.tracer.threads.get(tid)
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

        walker = walk if compact else unwind
        for frame in walker(regs, read_word, module_at, real_return, max_frames):
            # A return address may be the first byte after the function that made the call
            # (a call to a function that never returns): name the call's function.
            exact = frame.how in (FoundBy.FIRST, FoundBy.SIGNAL)
            at = frame.addr if exact else frame.addr - 1
            module = resolver.get_module_at(at)
            found = None if module is None else module.image.function_at(at - module.bias)
            if found is None:
                yield frame, module, None
            else:
                symbol, offset = found
                yield frame, module, (symbol.name, offset + frame.addr - at, symbol.size)
