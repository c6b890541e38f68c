"""Return probes on a process: the trampoline's slot, the rescue's return records, the guards.

A kretprobe is an entry probe whose pre handler hooks the frame (trampoline.py). What it
needs besides, and keeps for as long as it is registered, is here:

- the **trampoline**: one int3 in a slot of the out-of-line area, noted in the rescue, made
  once per image;
- **return records**: one per instance, in the rescue's area (``rescue.py``), where each
  hooked frame's real return address is written at entry, so that a program whose tool died
  still returns to its callers;
- the **unwinder's guards**: hidden probes on ``_Unwind_RaiseException`` and its kin in every
  module that has them, so that a C++ exception or ``backtrace()`` walking through a hooked
  frame sees its real return address (trampoline.py says how).

exec takes all three away with the old image; ``reequip`` gives the return probes waiting
for the new one their trampoline and records again.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from kprobes.arch.x86_64.rescue import RECORD_SIZE
from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import InstancePool, Kretprobe, KretprobeInstance, default_maxactive
from kprobes.errors import ProbeRejected
from kprobes.process.engine.trampoline import UNHOOK_ENTRIES, UNWIND_DONE, UNWIND_ENTRIES

if TYPE_CHECKING:
    from kprobes.core.manager import ProbeManager
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.contracts import Injector
    from kprobes.symbols.maps import Module


class ReturnProbes:
    """The kretprobes of one ``Process``: registration and what each keeps in the program."""

    def __init__(
        self,
        program: Attachment,
        injector: Injector,
        manager: ProbeManager,
        batch: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._program = program
        self._tracer = program.tracer
        self._injector = injector
        self._manager = manager
        self._batch = batch  # Process.batch: the world held, the sweep at its end
        self._records: dict[int, list[int]] = {}  # id(kretprobe) → its blocks of records
        self._guarded: set[int] = set()  # addresses of the unwinder's entry points probed
        self._unhooks: set[int] = set()  # ... and those given an in-program unhook too
        self._in_program = False  # an optimized return probe was registered (fast/returns.py)

    def register(self, rps: Sequence[Kretprobe]) -> None:
        """Register return probes; a failure rolls back the ones already registered."""
        for rp in rps:
            if rp.data_size < 0:
                raise ProbeRejected(f"data_size {rp.data_size} is negative", errno=errno.EINVAL)
            if rp.is_registered:
                raise ProbeRejected(f"{rp!r} is already registered", errno=errno.EINVAL)
        if not rps:
            return  # no trampoline, no unwinder guard: nothing returns here
        self._in_program = self._in_program or any(rp.optimize for rp in rps)
        with self._batch():
            self.ensure_trampoline()
            done: list[Kretprobe] = []
            try:
                for rp in rps:
                    main = self._tracer.main
                    nthreads = len(main.threads) if main is not None else 0
                    size = rp.maxactive if rp.maxactive > 0 else default_maxactive(nthreads)
                    rp.pool = InstancePool(rp, size)
                    self.give_records(rp, rp.pool.free)
                    rp.kp.pre_handler = self._tracer.trampoline.entry_handler_for(rp)
                    try:
                        self._manager.register(rp.kp)
                    except BaseException:
                        rp.pool = None
                        raise
                    rp.nmissed = rp.nabandoned = rp.nhit = 0
                    done.append(rp)
                self.ensure_unwind_guard()
            except BaseException:
                for rp in reversed(done):
                    self.unregister(rp)
                raise

    def unregister(self, rp: Kretprobe) -> None:
        """Every frame still hooked for ``rp`` gets its real return address back."""
        self._manager.unregister(rp.kp)
        if self._program.is_attached and self._tracer.main is not None:
            self._tracer.trampoline.unhook(list(self._tracer.threads.values()), rp)
        for start in self._records.pop(id(rp), ()):
            self._tracer.rescue.free_records(start)
        rp.pool = None

    def give_records(self, rp: Kretprobe, instances: Sequence[KretprobeInstance]) -> None:
        """Each instance's place in the rescue's return records (``rescue.py``)."""
        start = self._tracer.rescue.alloc_records(
            self._tracer.own_memories(), len(instances), self._injector.map_records
        )
        if not start:
            return
        self._records.setdefault(id(rp), []).append(start)
        for i, ri in enumerate(instances):
            ri.record = start + i * RECORD_SIZE

    def ensure_trampoline(self) -> None:
        tramp = self._tracer.trampoline
        if tramp.addr:
            return
        with self._injector.world_held():  # the slot may need a new page, mapped by the program
            self._injector.ensure_rescue()
            xol = self._injector.xol()
            near = xol.pages[0].start if xol.pages else self._program.symbols().main_module().start
            slot = xol.alloc(near)
            self._tracer.rescue.note_trampoline(self._tracer.own_memories(), slot)
            for space in self._tracer.own_memories():
                space.write(slot, b"\xcc")
            tramp.addr = slot

    def ensure_unwind_guard(self) -> None:
        """Probe the unwinder's entry points in every module that has them (trampoline.py)."""
        tramp = self._tracer.trampoline
        resolver = self._program.symbols()
        resolver.refresh()
        for name, addr in _functions(resolver.modules(), UNWIND_ENTRIES + UNWIND_DONE):
            if addr in self._guarded:
                continue
            on = tramp.on_unwound if name in UNWIND_DONE else tramp.on_unwind
            kp = Kprobe(addr=addr, pre_handler=_guard_handler(on))
            kp.owner = tramp.guard
            try:
                self._manager.register(kp)
            except ProbeRejected:
                continue  # an instruction we cannot run out of line: no guard there
            self._guarded.add(addr)
            tramp.guard_probes.append(kp)
        if self._in_program:
            self._unhook_in_program(resolver.modules())

    def _unhook_in_program(self, modules: Iterable[Module]) -> None:
        """Hidden probes that ask for a jump where a C++ exception starts (``__cxa_throw``,
        ``__cxa_rethrow``): their detour puts the real return addresses back in the frames
        of the throwing thread that the optimized tier hooked, in the program itself, so
        that an exception thrown after the tool's death still unwinds (fast/returns.py).
        Not on the unwinder's own entry points: their indirect jumps (``uw_install_context``)
        keep every jump out of them. On traps, while the tool lives, their handler does
        the same through the tool."""
        tramp = self._tracer.trampoline
        for _, addr in _functions(modules, UNHOOK_ENTRIES):
            if addr in self._unhooks:
                continue
            kp = Kprobe(addr=addr, pre_handler=_guard_handler(tramp.on_unwind_fast), optimize=True)
            kp.owner = tramp.unhook_guard
            try:
                self._manager.register(kp)
            except ProbeRejected:
                continue
            self._unhooks.add(addr)
            tramp.guard_probes.append(kp)

    def forget_guard(self, addr: int) -> None:
        """The guard at ``addr`` went with its library (dlclose): placed again if it comes."""
        self._guarded.discard(addr)
        self._unhooks.discard(addr)

    def forget_image(self) -> None:
        """exec: the new image has no trampoline, no records, no guards."""
        self._guarded.clear()
        self._unhooks.clear()

    def reequip(self) -> None:
        """The return probes waiting to be placed in a new image get a trampoline and
        records again (every instance is free after an exec); their guards come with
        ``ensure_unwind_guard``."""
        retprobes = {
            id(p.owner): p.owner for p in self._manager.pending if isinstance(p.owner, Kretprobe)
        }
        if not retprobes:
            return
        self._records.clear()
        self.ensure_trampoline()
        for rp in retprobes.values():
            if rp.pool is not None:
                self.give_records(rp, list(rp.pool.free))


def _functions(modules: Iterable[Module], names: Sequence[str]) -> Iterator[tuple[str, int]]:
    """(name, runtime address) of each function of ``names`` each module defines."""
    for module in modules:
        for name in names:
            sym = module.image.lookup(name)
            if sym is not None and sym.kind.is_function:
                yield name, module.bias + sym.value


def _guard_handler(on: Callable[[Any], None]) -> Callable[[Kprobe, Any], None]:
    def pre_handler(_kp: Kprobe, regs: Any) -> None:
        on(regs)

    return pre_handler
