"""Return probes on a process: the trampoline, per-thread instance stacks, abandoned frames.

At a kretprobe's entry hit the return address at ``[rsp]`` is saved in an instance from the
probe's pool and replaced by the address of our trampoline, an ``int3`` in an injected page.
When the function returns it traps there: the thread's newest live instance whose stack slot
is ``rsp - 8`` is the call returning, its handler runs and ``rip`` is set to the real return
address. One stop per return, and no limit on nesting but ``maxactive``.

Frames can vanish without returning (``longjmp``, C++ exceptions, ``pthread_exit``). Stacks
grow down, so an instance whose slot is at or below the current stack pointer at a later
entry (or below the returning slot at a trampoline hit) belongs to a frame that no longer
exists: it is released and counted in ``nabandoned``, never paired with another return. Its
real return address is remembered per thread (``Thread.lost``), so that if the guess was wrong
(a handler on an alternate signal stack) the frame still returns to the right place.

The C++ unwinder finds each frame's unwind table entry from its return address, and finds
none for our trampoline: an exception thrown through a hooked frame would end the program in
``std::terminate``. So the unwinder's entry points (``_Unwind_RaiseException`` and friends)
carry internal probes that put the real return address back in every live frame of the
thread first; ``__cxa_begin_catch`` (the unwinding is over) hooks the surviving frames again.
Without that, as with the kernel's uretprobes, exceptions through probed frames would crash.

Rejected: a shadow stack kept by hooking every call and return (two stops per call), and
per-instance trampolines with unwind information (an FDE per instance, registered in the
program's unwinder: far more machinery for the same result).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from kprobes.arch.x86_64.regs import REG_INDEX
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Kretprobe, KretprobeInstance
from kprobes.errors import InternalError, TargetError

if TYPE_CHECKING:
    from kprobes.process.engine.threads import Thread
    from kprobes.process.engine.tracee import Tracee
    from kprobes.process.engine.tracer import Tracer

_Q = struct.Struct("<Q")
_RECORD = struct.Struct("<QQQ")  # the rescue's return record: slot, real address, sequence
_RIP = REG_INDEX["rip"]
_RSP = REG_INDEX["rsp"]
LOST_LIMIT = 4096  # return addresses remembered per thread for released instances

# Where the unwinder starts walking the stack (unhook first) and where it is done (rehook).
UNWIND_ENTRIES = (
    "_Unwind_RaiseException",
    "_Unwind_Resume",
    "_Unwind_Resume_or_Rethrow",
    "_Unwind_ForcedUnwind",
    "_Unwind_Backtrace",
)
UNWIND_DONE = ("__cxa_begin_catch",)
# Where a C++ exception starts: the optimized tier's frames are unhooked there, in the program.
UNHOOK_ENTRIES = ("__cxa_throw", "__cxa_rethrow")


class UnwindGuard:
    """Marks the internal probes on the unwinder (``Kprobe.owner``); hidden from list()."""

    def __repr__(self) -> str:
        return "<UnwindGuard>"


class UnwindUnhook(UnwindGuard):
    """Marks the probes on the unwinder that the optimized tier turns into an in-program
    unhook of the frames it hooked (fast/returns.py): they need no trap."""

    def why_on_traps(self) -> str | None:
        return None

    def __repr__(self) -> str:
        return "<UnwindUnhook>"


class Trampoline:
    """The return trampoline of one traced program and every thread's live instances."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.addr = 0  # the int3; 0 until the first kretprobe is registered
        self.guard = UnwindGuard()
        self.unhook_guard = UnwindUnhook()
        self.guard_probes: list[Kprobe] = []
        self.retprobes: list[Kretprobe] = []

    # -- entry -----------------------------------------------------------------------------

    def entry_handler_for(self, rp: Kretprobe) -> Callable[[Kprobe, Any], None]:
        """The pre handler of ``rp``'s entry probe (``on_entry`` with ``rp`` bound)."""
        return partial(self.on_entry, rp)

    def on_entry(self, rp: Kretprobe, _kp: Kprobe, regs: Any) -> None:
        t = self.tracer.threads[regs.tid]
        sp: int = t.words[_RSP]
        mem = t.tracee
        ret_addr = mem.read_word(sp)
        # Step 1: frames below this call's slot are gone, and so is one at the slot itself
        # unless a tail call chained this call to it (its return address is our trampoline).
        rets = t.rets
        if rets:
            chained = ret_addr == self.addr
            while rets and (rets[-1].stack < sp or (rets[-1].stack == sp and not chained)):
                self._abandon(t, rets.pop())
        if t.unhooked:
            self._rehook(t)
        if self.tracer.fast is not None:  # and the optimized tier's frames that survived
            self.tracer.fast.rehook_returns(t, sp)
        # Step 2: an instance from the pool, or a miss (and no entry handler).
        pool = rp.pool
        assert pool is not None
        ri = pool.get()
        if ri is None:
            rp.nmissed += 1
            return
        # Step 3: capture the call.
        ri.ret_addr = ret_addr
        ri.stack = sp
        ri.task = t.task
        if ri.data:
            ri.data[:] = bytes(len(ri.data))
        # Step 4: the entry handler may decline this call.
        if rp.entry_handler is not None:
            try:
                declined = rp.entry_handler(ri, regs)
            except BaseException:
                pool.put(ri)
                raise
            if declined:
                pool.put(ri)
                return
        # Step 5: hook the return; the rescue's record of the call goes first, so that the
        # program finds its way back even if the tool dies right after (rescue.py).
        if ri.ret_addr != self.addr:
            if ri.record:
                rescue = self.tracer.rescue
                rescue.seq += 1
                mem.write(ri.record, _RECORD.pack(sp, ri.ret_addr, rescue.seq))
            mem.write_word(sp, self.addr)
        rets.append(ri)
        if t.lost:
            t.lost.pop(sp, None)

    # -- return ----------------------------------------------------------------------------

    def on_return(self, t: Thread) -> None:
        """``t`` trapped on the trampoline: report the return and send it home."""
        chain = self.take_return(t)
        if chain:
            self.report_return(t, chain)

    def take_return(self, t: Thread) -> list[KretprobeInstance]:
        """Pair the return of ``t`` (stopped on the trampoline) with its instances, newest
        first, and set rip in its view to the real return address.

        Sending it home changes rip alone, through ``t.words`` so that the view is not marked
        dirty: unless a handler writes a register, the tracer writes back rip only. The
        tracer writes it before the handlers run (``report_return``).
        """
        w = t.words
        slot = w[_RSP] - 8
        rets = t.rets
        # Step 1: instances of deeper frames that vanished without returning.
        while rets and rets[-1].stack < slot:
            self._abandon(t, rets.pop())
        # Step 2: the instances of this slot: one, or several when tail calls chained them.
        chain: list[KretprobeInstance] = []
        while rets and rets[-1].stack == slot:
            chain.append(rets.pop())
        if not chain:
            real = t.lost.pop(slot, None)
            if real is None:
                raise InternalError(
                    f"thread {t.tid} returned into the kretprobe trampoline from stack slot "
                    f"{slot:#x}, which no live instance owns"
                )
            w[_RIP] = real
            return chain
        real = chain[-1].ret_addr  # the oldest holds the caller's address
        if real == self.addr:
            raise InternalError(f"thread {t.tid}: no real return address for slot {slot:#x}")
        w[_RIP] = real
        for ri in chain:
            ri.ret_addr = real
        return chain

    def report_return(self, t: Thread, chain: list[KretprobeInstance]) -> None:
        """Step 3: handlers, newest call first (as the kernel's trampoline handler).

        A probe unregistered meanwhile (by a handler of this chain) has no pool any more and
        is not reported, as the kernel's get_kretprobe() returns NULL once rp is unregistered.
        """
        regs = t.regs
        for ri in chain:
            rp = ri.probe
            if rp.pool is None:
                continue
            rp.nhit += 1
            handler = rp.handler
            if handler is not None:
                t.busy = True
                try:
                    handler(ri, regs)
                except Exception as exc:
                    self.tracer.manager.table.park(exc)
                finally:
                    t.busy = False
            pool = rp.pool
            if pool is not None:
                pool.put(ri)

    # -- unwinding -------------------------------------------------------------------------

    def on_unwind(self, regs: Any) -> None:
        """The unwinder is about to walk this thread's stack: real return addresses back."""
        t = self.tracer.threads[regs.tid]
        mem = t.tracee
        for ri in _real_slots(t.rets, self.addr):
            if _Q.unpack(mem.read(ri.stack, 8))[0] == self.addr:
                mem.write(ri.stack, _Q.pack(ri.ret_addr))
        t.unhooked = bool(t.rets)
        if self.tracer.fast is not None:  # and the frames the optimized tier hooked, for good
            self.tracer.fast.unhook_returns([t])

    def on_unwind_fast(self, regs: Any) -> None:
        """The in-program unhook's site is on traps: the tool does its work."""
        if self.tracer.fast is not None:
            self.tracer.fast.unhook_returns([self.tracer.threads[regs.tid]])

    def on_unwound(self, regs: Any) -> None:
        """A catch block begins: frames above it survive and are hooked again."""
        t = self.tracer.threads[regs.tid]
        sp: int = regs.rsp
        rets = t.rets
        while rets and rets[-1].stack <= sp:
            self._abandon(t, rets.pop())
        if t.unhooked:
            self._rehook(t)
        if self.tracer.fast is not None:  # and the optimized tier's frames that survived
            self.tracer.fast.rehook_returns(t, sp)

    def _rehook(self, t: Thread) -> None:
        mem = t.tracee
        for ri in _real_slots(t.rets, self.addr):
            try:
                current = _Q.unpack(mem.read(ri.stack, 8))[0]
            except TargetError:
                continue
            if current == ri.ret_addr:
                mem.write(ri.stack, _Q.pack(self.addr))
        t.unhooked = False

    # -- releasing -------------------------------------------------------------------------

    def _abandon(self, t: Thread, ri: KretprobeInstance) -> None:
        if ri.ret_addr != self.addr:
            lost = t.lost
            if len(lost) >= LOST_LIMIT:
                del lost[next(iter(lost))]
            lost[ri.stack] = ri.ret_addr
        rp = ri.probe
        rp.nabandoned += 1
        if rp.pool is not None:
            rp.pool.put(ri)

    def forget_thread(self, t: Thread) -> None:
        """The thread is gone: its instances go back to their pools."""
        for ri in t.rets:
            if ri.probe.pool is not None:
                ri.probe.pool.put(ri)
        t.rets.clear()
        t.lost.clear()

    def unhook(self, threads: Iterable[Thread], rp: Kretprobe | None = None) -> None:
        """Put the real return address back in every live frame hooked for ``rp`` (or all).

        Every thread is stopped here. Instances of other probes stay; where one shares the
        slot (a tail-call chain), the oldest of them inherits the real address instead.
        """
        tramp = self.addr
        for t in threads:
            if not t.rets:
                continue
            keep: list[KretprobeInstance] = []
            real_of: dict[int, int] = {}
            dropped: set[int] = set()
            for ri in t.rets:
                if ri.ret_addr != tramp:
                    real_of[ri.stack] = ri.ret_addr
                if rp is None or ri.probe is rp:
                    dropped.add(ri.stack)
                    if ri.probe.pool is not None:
                        ri.probe.pool.put(ri)
                else:
                    keep.append(ri)
            for slot in dropped:
                real = real_of.get(slot)
                if real is None:
                    continue
                t.lost[slot] = real  # a thread already trapped on the trampoline still finds it
                heirs = [ri for ri in keep if ri.stack == slot]
                if heirs:
                    heirs[0].ret_addr = real  # the oldest of a chain holds the real address
                else:
                    _restore_slot(t.tracee, slot, tramp, real)
            t.rets[:] = keep
            if not keep:
                t.unhooked = False

    def home_of(self, t: Thread, rsp: int) -> int | None:
        """Where a thread stopped on the trampoline (``rsp`` after the ret) really returns."""
        slot = rsp - 8
        for ri in reversed(t.rets):
            if ri.stack == slot and ri.ret_addr != self.addr:
                return ri.ret_addr
        return t.lost.get(slot)

    def snapshot(self, parent: Thread) -> list[tuple[int, int]]:
        """The forking thread's hooked slots, as its child's copy of the stack has them."""
        return [(ri.stack, ri.ret_addr) for ri in _real_slots(parent.rets, self.addr)]

    def restore_child(self, child: Tracee) -> None:
        """Put the real return addresses in a forked child's copy of the stack.

        The child's returns from frames entered before the fork are not reported.
        """
        for slot, real in child.inherited_returns:
            _restore_slot(child, slot, self.addr, real)
        child.inherited_returns = []

    def forget(self) -> None:
        """The address space was replaced (exec): the trampoline and its pages are gone."""
        self.addr = 0
        self.guard_probes.clear()


def _real_slots(rets: list[KretprobeInstance], tramp: int) -> list[KretprobeInstance]:
    """One instance per hooked slot: the one holding the real return address."""
    return [ri for ri in rets if ri.ret_addr != tramp]


def _restore_slot(mem: Tracee, slot: int, tramp: int, real: int) -> None:
    try:
        if _Q.unpack(mem.read(slot, 8))[0] == tramp:
            mem.write(slot, _Q.pack(real))
    except TargetError:
        return
