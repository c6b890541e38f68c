"""Every byte we patch in the program, and the one way to read code as it was.

Arming writes ``int3`` over the first byte of the probed instruction in every address space
that has its own copy of the code (the program, and followed fork children); disarming writes
the saved byte back. ``original()`` is the only way the rest of the package reads code to
decode it: it undoes our own patches so that no analysis ever sees an int3 of ours.

``ever_patched`` remembers every address we have armed. A thread may have hit a breakpoint
just before we removed it; its trap then arrives for an address that no longer holds an int3,
and this set is how the event loop recognises such a stale trap (and a fork child's copy of
memory is cleaned of every byte we might have left in it).

An optimized probe (optimizer.py) has a 5-byte ``jmp`` where its int3 was: ``patch_jump``
moves the address from ``armed`` to ``jumps`` (its 5 original bytes), so ``original()``
undoes the jump as it undoes an int3, ``is_stale_trap`` holds for a trap taken before the
jump went in, and ``restore_all``/``sync`` treat the jump as they treat the int3s.
"""

from __future__ import annotations

from collections.abc import Iterable

from kprobes.errors import InternalError, TargetError
from kprobes.process.tracee import Tracee

INT3 = 0xCC


class Breakpoints:
    def __init__(self) -> None:
        self.armed: dict[int, int] = {}  # addr → original byte
        self.ever_patched: dict[int, int] = {}  # addr → original byte, armed or not
        self.jumps: dict[int, tuple[bytes, bytes]] = {}  # addr → (jmp, original 5 bytes)
        self.ever_jumped: dict[int, tuple[bytes, bytes]] = {}  # likewise, jumped or not

    def arm(self, spaces: Iterable[Tracee], addr: int, original: int) -> None:
        if addr in self.armed:
            raise InternalError(f"breakpoint at {addr:#x} is already armed")
        if original == INT3:
            raise InternalError(f"original byte at {addr:#x} is already an int3")
        for space in spaces:
            space.write(addr, b"\xcc")
        self.armed[addr] = original
        self.ever_patched[addr] = original

    def disarm(self, spaces: Iterable[Tracee], addr: int) -> None:
        original = self.armed.pop(addr, None)
        if original is None:
            raise InternalError(f"breakpoint at {addr:#x} is not armed")
        for space in spaces:
            space.write(addr, bytes((original,)))

    def patch_jump(self, spaces: Iterable[Tracee], addr: int, jmp: bytes, original: bytes) -> None:
        """Replace the armed int3 at ``addr`` by ``jmp`` (the caller holds the world)."""
        if addr not in self.armed or addr in self.jumps:
            raise InternalError(f"no int3 to replace by a jump at {addr:#x}")
        if len(jmp) != len(original) or original[0] != self.armed[addr]:
            raise InternalError(f"the jump's original bytes at {addr:#x} do not match")
        for space in spaces:
            space.write(addr, jmp)
        del self.armed[addr]
        self.jumps[addr] = self.ever_jumped[addr] = (jmp, original)

    def unpatch_jump(self, spaces: Iterable[Tracee], addr: int, *, rearm: bool) -> None:
        """Put the original bytes back at ``addr``, then the int3 if ``rearm``."""
        patch = self.jumps.pop(addr, None)
        if patch is None:
            raise InternalError(f"no jump at {addr:#x}")
        code = bytearray(patch[1])
        if rearm:
            code[0] = INT3
            self.armed[addr] = patch[1][0]
        for space in spaces:
            space.write(addr, bytes(code))

    def is_stale_trap(self, addr: int) -> bool:
        """A trap at ``addr`` came from an int3 of ours that has since been removed."""
        return addr in self.ever_patched and addr not in self.armed

    def original(self, space: Tracee, addr: int, size: int) -> bytes:
        """The program's bytes at [addr, addr+size) with our patches undone."""
        data = space.read_some(addr, size)
        if not self.armed and not self.jumps:
            return data
        end = addr + len(data)
        patched = [a for a in self.armed if addr <= a < end]
        jumped = [a for a in self.jumps if addr - len(self.jumps[a][1]) < a < end]
        if not patched and not jumped:
            return data
        out = bytearray(data)
        for a in patched:
            out[a - addr] = self.armed[a]
        for a in jumped:
            for i, byte in enumerate(self.jumps[a][1]):
                if addr <= a + i < end:
                    out[a + i - addr] = byte
        return bytes(out)

    def restore_all(self, space: Tracee) -> None:
        """Put back every byte we ever patched (detach; a fork child being released)."""
        for addr, original in self.ever_patched.items():
            try:
                if space.read(addr, 1)[0] == INT3:
                    space.write(addr, bytes((original,)))
            except TargetError:  # the mapping may be gone (munmap, exec)
                continue
        for addr, (jmp, code) in self.ever_jumped.items():
            try:
                if space.read(addr, len(jmp)) == jmp:
                    space.write(addr, code)
            except TargetError:
                continue

    def sync(self, space: Tracee) -> None:
        """Make a fork child's copy match: int3 where armed now, original bytes elsewhere."""
        for addr, original in self.ever_patched.items():
            if addr in self.ever_jumped:
                continue
            want = b"\xcc" if addr in self.armed else bytes((original,))
            try:
                space.write(addr, want)
            except TargetError:
                continue
        for addr, (jmp, code) in self.ever_jumped.items():
            now = bytearray(jmp if addr in self.jumps else code)
            if addr in self.armed:
                now[0] = INT3
            try:
                space.write(addr, bytes(now))
            except TargetError:
                continue

    def drop(self, addr: int) -> None:
        """The code at ``addr`` was unmapped (dlclose): our int3 went with it, and what is
        mapped there later is not ours to restore."""
        self.armed.pop(addr, None)
        self.ever_patched.pop(addr, None)
        self.jumps.pop(addr, None)
        self.ever_jumped.pop(addr, None)

    def forget(self) -> None:
        """The address space was replaced (exec): nothing of ours is in it any more."""
        self.armed.clear()
        self.ever_patched.clear()
        self.jumps.clear()
        self.ever_jumped.clear()
