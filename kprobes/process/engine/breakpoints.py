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

**Five bytes are never written at once** (``_text_poke``, the kernel's ``text_poke_bp``):
an int3 over the first byte, then the four others, then the first byte, so that a site only
ever holds a whole old instruction, a whole new one, or an int3 followed by either's other
bytes. The world is held for all three writes, so no thread of ours sees the steps; they are
for a tool that dies between two of them (the rescue finishes whichever instruction the four
bytes belong to: rescue.c) and for an exception between them (every later write reads what is
there and goes on from it). What is there is what counts, never only the bookkeeping: a site
that ever had a jump is restored whole from its five original bytes wherever its bytes are
ours, and the jump is noted in ``ever_jumped`` before its first byte is written. Rejected:
one 5-byte write (a tool killed in it, or an exception around it, left an int3 or the original
first byte before the jump's other four: ``41 0b 47 1a 00`` at ``malloc``, see
docs/decisions.md).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from kprobes.errors import InternalError, TargetError
from kprobes.lifetime import uninterrupted
from kprobes.process.engine.tracee import Tracee

INT3 = 0xCC
JUMP_LEN = 5  # an optimized probe's jmp rel32, and the original bytes it covers


class PokeStep(enum.Enum):
    """The three writes that change a jump site (``_text_poke``), in their order."""

    INT3 = "int3"  # the first byte becomes an int3: nothing runs the other four any more
    TAIL = "tail"  # the other four become the new instruction's
    FIRST = "first"  # the first byte becomes the new instruction's (an int3 stays one)


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
        jumped = self.ever_jumped.get(addr)
        # Noted before the byte is written, as a jump is: a detach then knows every int3 it
        # may have to take out, even one whose bookkeeping an exception cut short.
        self.ever_patched[addr] = original
        for space in spaces:
            if jumped is None:
                space.write(addr, b"\xcc")
            else:  # whatever is left of a jump goes first
                self._text_poke(space, addr, b"\xcc" + jumped[1][1:], jumped)
        self.armed[addr] = original

    def disarm(self, spaces: Iterable[Tracee], addr: int) -> None:
        original = self.armed.pop(addr, None)
        if original is None:
            raise InternalError(f"breakpoint at {addr:#x} is not armed")
        jumped = self.ever_jumped.get(addr)
        for space in spaces:
            if jumped is None:
                space.write(addr, bytes((original,)))
            else:
                self._text_poke(space, addr, jumped[1], jumped)

    def patch_jump(self, spaces: Iterable[Tracee], addr: int, jmp: bytes, original: bytes) -> None:
        """Replace the armed int3 at ``addr`` by ``jmp`` (the caller holds the world)."""
        if addr not in self.armed or addr in self.jumps:
            raise InternalError(f"no int3 to replace by a jump at {addr:#x}")
        if len(jmp) != JUMP_LEN or len(original) != JUMP_LEN or original[0] != self.armed[addr]:
            raise InternalError(f"the jump's original bytes at {addr:#x} do not match")
        patch = (jmp, original)
        self.ever_jumped[addr] = patch  # before a byte of it is written (see the docstring)
        for space in spaces:
            self._text_poke(space, addr, jmp, patch)
        del self.armed[addr]
        self.jumps[addr] = patch

    def unpatch_jump(self, spaces: Iterable[Tracee], addr: int, *, rearm: bool) -> None:
        """Put the original bytes back at ``addr``, then the int3 if ``rearm``."""
        patch = self.jumps.get(addr)
        if patch is None:
            raise InternalError(f"no jump at {addr:#x}")
        code = bytearray(patch[1])
        if rearm:
            code[0] = INT3
        for space in spaces:
            self._text_poke(space, addr, bytes(code), patch)
        del self.jumps[addr]
        if rearm:
            self.armed[addr] = patch[1][0]

    def _text_poke(
        self,
        space: Tracee,
        addr: int,
        new: bytes,
        patch: tuple[bytes, bytes],
        *,
        only_ours: bool = False,
    ) -> None:
        """Make the bytes of the jump site ``addr`` (``patch``: its jump and original bytes)
        ``new``, from whatever of ours is there, in the kernel's ``text_poke_bp`` order.

        Step 1: an int3 over the first byte, unless the other bytes stay as they are.
        Step 2: the other bytes. Step 3: the first byte (an int3 wanted stays as it is).
        At every instant the site holds a whole instruction or an int3 followed by the other
        bytes of the old or of the new one: what the rescue knows how to finish (rescue.c).
        With ``only_ours`` (a detach, a child's copy), bytes that are neither ours nor the
        original's are someone else's (the code was unmapped and replaced): left alone.
        """
        now = space.read(addr, len(new))
        if now == new or (only_ours and not _is_ours(now, *patch)):
            return
        try:
            with uninterrupted():  # no signal's exception between two of the steps
                self._three_steps(space, addr, now, new)
        except BaseException:
            # A write that failed between two steps (or an exception of a test): the world
            # runs again after it, and the bookkeeping still says what was there, so that
            # goes back, by the same steps. Left as an int3 followed by the new bytes, the
            # site's next trap would run the old instruction's out-of-line plan into them.
            self._three_steps(space, addr, space.read(addr, len(new)), now)
            raise

    def _three_steps(self, space: Tracee, addr: int, now: bytes, new: bytes) -> None:
        first = now[0]
        if now[1:] != new[1:]:
            # Step 1
            if first != INT3:
                self._poke(space, addr, b"\xcc", PokeStep.INT3)
                first = INT3
            # Step 2
            self._poke(space, addr + 1, new[1:], PokeStep.TAIL)
        # Step 3
        if first != new[0]:
            self._poke(space, addr, new[:1], PokeStep.FIRST)

    def _poke(self, space: Tracee, addr: int, data: bytes, step: PokeStep) -> None:
        """One step of ``_text_poke`` (the SIGKILL tests stop the tool after each)."""
        space.write(addr, data)

    def is_stale_trap(self, addr: int) -> bool:
        """A trap at ``addr`` came from an int3 of ours that has since been removed."""
        return addr in self.ever_patched and addr not in self.armed

    def original(self, space: Tracee, addr: int, size: int) -> bytes:
        """The program's bytes at [addr, addr+size) with our patches undone.

        Every address we ever patched is undone, whatever it holds now: an int3 goes only
        where the original byte is not one, and a jump site's bytes are the original's or
        ours (a jump, an int3, or a step of one being written, see ``_text_poke``).
        """
        data = space.read_some(addr, size)
        if not self.ever_patched and not self.ever_jumped:
            return data
        end = addr + len(data)
        patched_all, jumped_all = self.ever_patched, self.ever_jumped
        # Whichever is shorter to walk, the bytes read or the addresses patched: thousands
        # of probes are each checked by a decode of their function (arming.py).
        if len(data) < len(patched_all):
            patched = [a for a in range(addr, end) if a in patched_all]
        else:
            patched = [a for a in patched_all if addr <= a < end]
        if len(data) + JUMP_LEN < len(jumped_all):
            near = [a for a in range(addr - JUMP_LEN + 1, end) if a in jumped_all]
        else:
            near = list(jumped_all)
        jumped = [a for a in near if addr - len(jumped_all[a][1]) < a < end]
        if not patched and not jumped:
            return data
        out = bytearray(data)
        for a in patched:
            out[a - addr] = self.ever_patched[a]
        for a in jumped:
            for i, byte in enumerate(self.ever_jumped[a][1]):
                if addr <= a + i < end:
                    out[a + i - addr] = byte
        return bytes(out)

    def restore_all(self, space: Tracee) -> None:
        """Put back every byte we ever patched (detach; a fork child being released)."""
        for addr, original in self.ever_patched.items():
            if addr in self.ever_jumped:
                continue  # below, all five bytes
            try:
                if space.read(addr, 1)[0] == INT3:
                    space.write(addr, bytes((original,)))
            except TargetError:  # the mapping may be gone (munmap, exec)
                continue
        for addr, patch in self.ever_jumped.items():
            try:
                self._text_poke(space, addr, patch[1], patch, only_ours=True)
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
        for addr, patch in self.ever_jumped.items():
            now = bytearray(patch[0] if addr in self.jumps else patch[1])
            if addr in self.armed:
                now[0] = INT3
            try:
                self._text_poke(space, addr, bytes(now), patch, only_ours=True)
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


def _is_ours(now: bytes, jmp: bytes, original: bytes) -> bool:
    """``now`` is what we may have left at a jump site: each byte the original's or the
    jump's, the first one an int3 too (anything else was put there by someone else)."""
    if now[0] not in (INT3, jmp[0], original[0]):
        return False
    return all(b in (j, o) for b, j, o in zip(now[1:], jmp[1:], original[1:], strict=True))
