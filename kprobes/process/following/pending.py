"""Probes that follow the program's code: pending probes, the loader's rendezvous, exec.

A probe names a file and a symbol, so, like the kernel's uprobes (which hang on the inode),
it belongs in every image of that file the program maps, whenever it maps it. Three moments
bring code in or take it away, and each is seen here as it happens:

- **exec.** The tracer stops the thread at the exit of ``execve`` (``PTRACE_SYSCALL`` from
  the exec event): the new image is there, the executable and the dynamic loader are
  mapped, and not one instruction of it has run. Every probe waits again and is placed in
  the new image at once where it can be.
- **The loader's startup.** The loader maps the program's libraries, relocates them (their
  ifunc resolvers run) and only then says so through its debugger rendezvous. So from the
  exec until the rendezvous says ``RT_CONSISTENT`` the thread runs under ``PTRACE_SYSCALL``,
  and the exit of each ``mmap`` that maps code places the probes of the library just
  mapped, before any of its code runs: the moment the kernel's ``uprobe_mmap()`` places
  its own. About 40 syscall stops per exec, once.
- **dlopen and dlclose.** A hidden probe on the loader's ``_dl_debug_state`` (``r_brk``,
  GDB's shared-library breakpoint) sees every change of ``_r_debug.r_state``: in
  ``dlopen`` the loader announces ``RT_CONSISTENT`` after mapping the new objects and
  before relocating them or running their constructors; in ``dlclose``, after unmapping.

What is mapped is read from /proc/PID/maps at those moments (the resolver); ``r_debug``
says when. Rejected: polling /proc/PID/maps (late by a poll period, and blind to a library
loaded and unloaded in between), and the loader's ``RT_CONSISTENT`` at startup alone (it
comes after relocation, so ifunc resolvers and the loader's own calls into a library would
be missed where the kernel counts them).

``Following`` is a part of ``Process`` (target.py); the tracer calls it at every syscall stop.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from kprobes.core.probes import Kprobe
from kprobes.errors import ProbeRejected, TargetError
from kprobes.linux import procfs
from kprobes.linux.syscalls import NR_MMAP
from kprobes.process.engine.trampoline import UnwindGuard

if TYPE_CHECKING:
    from kprobes.core.manager import ProbeManager
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.returns import ReturnProbes
    from kprobes.process.engine.threads import Thread
    from kprobes.process.fast.state import JumpState

AT_BASE = 7  # auxv: where the program interpreter (the dynamic loader) is loaded
RT_CONSISTENT = 0  # r_debug.r_state: the link map is complete and stable
_R_STATE = 24  # offsetof(struct r_debug, r_state): int r_version, r_map, r_brk, then r_state
_PROT_EXEC = 0x4
_MAP_ANONYMOUS = 0x20
_MAX_ERRNO = 4095


class ProbeNotice(UserWarning):
    """Something the user should know that is not an error of the call that caused it:
    a pending probe whose library was mapped without the symbol, say."""


class LoaderWatch:
    """The owner of the hidden probe on the loader's rendezvous (never listed)."""


class _Watch(enum.Enum):
    NONE = "none"  # not looked for in this image yet
    PLACED = "placed"
    UNAVAILABLE = "unavailable"  # a static program, or a loader without the rendezvous


def _warn(message: str) -> None:
    warnings.warn(message, ProbeNotice, stacklevel=2)


class Following:
    """What keeps probes placed while the program's code comes and goes, for ``Process``."""

    def __init__(
        self,
        program: Attachment,
        manager: ProbeManager,
        returns: ReturnProbes,
        jumps: JumpState,
        *,
        batch: Callable[[], AbstractContextManager[None]],
        publish: Callable[[], None],
        forget_image: Sequence[Callable[[], None]],
        pending: bool,
    ) -> None:
        self._program = program
        self.pid = program.pid
        self._tracer = program.tracer
        self._manager = manager
        self._returns = returns
        self._jumps = jumps
        self._batch = batch  # Process.batch
        self._publish = publish  # Process's probe list, for cleanup (cleanup.py)
        self._forget_image = forget_image  # what the other parts knew of an old image
        # A member of a family (family.py) gets its root's probes with its first image.
        self.first_image_hook: Callable[[], None] | None = None
        self._manager.allow_pending = pending
        self._watch = _Watch.NONE
        self._r_debug = 0
        self._watch_probe: Kprobe | None = None
        self.is_starting = False  # the loader is mapping and relocating the startup libraries
        self._noticed: set[tuple[int, str]] = set()
        self.misses: dict[int, str] = {}  # id(probe) → why a library that came lacked it
        self.on_notice: Callable[[str], None] = _warn
        # Called in the stop where code came (a new image, a library mapped), before the
        # pending probes are placed: a glob over a library's functions (the command line's
        # ``count -c CMD 'libc:str*'``) is matched there, in each library as it comes.
        self.code_watchers: list[Callable[[], None]] = []
        self._tracer.on_syscall = self.on_syscall_stop

    def iter_pending(self) -> Iterator[Kprobe]:
        """The registered probes that wait for their library (never mapped, or unmapped)."""
        return (p for p in self._manager.pending if not isinstance(p.owner, LoaderWatch))

    # -- the loader's rendezvous ----------------------------------------------------------

    def watch_loader(self) -> None:
        """Probe the loader's ``_dl_debug_state`` in this image (once per image)."""
        if self._watch is not _Watch.NONE:
            return
        self._watch = _Watch.UNAVAILABLE
        try:
            base = procfs.read_auxv(self.pid).get(AT_BASE, 0)
        except OSError:
            return
        module = self._program.symbols().get_module_at(base) if base else None
        if module is None:
            return  # a static program: nothing is loaded behind its back
        state = module.image.lookup("_dl_debug_state")
        r_debug = module.image.lookup("_r_debug")
        if state is None or r_debug is None:
            return
        probe = Kprobe(addr=module.bias + state.value, pre_handler=self._on_loader_hit)
        probe.owner = LoaderWatch()
        try:
            self._manager.register(probe)
        except ProbeRejected:
            return
        self._r_debug = module.bias + r_debug.value
        self._watch_probe = probe
        self._watch = _Watch.PLACED
        if not self.is_starting and not self._loader_is_done():
            # Attached in the first milliseconds of the program's life: the loader is still
            # mapping and relocating its libraries, and no ifunc resolver may run before the
            # rendezvous says RT_CONSISTENT (an injected call of libc's faulted there).
            self.is_starting = True

    def _loader_is_done(self) -> bool:
        """The rendezvous says the startup's libraries are in and relocated (``r_version``
        set by the loader, ``r_state`` RT_CONSISTENT)."""
        try:
            head = self._program.memory().read(self._r_debug, _R_STATE + 4)
        except TargetError:
            return True  # unreadable: as before, nothing waits for it
        version = int.from_bytes(head[:4], "little")
        return version != 0 and int.from_bytes(head[_R_STATE:], "little") == RT_CONSISTENT

    def _on_loader_hit(self, _probe: Kprobe, _regs: Any) -> None:
        data = self._program.memory().read(self._r_debug + _R_STATE, 4)
        if int.from_bytes(data, "little") != RT_CONSISTENT:
            return  # RT_ADD, RT_DELETE: the change is under way
        self.is_starting = False  # relocated: ifunc resolvers may run now
        self.follow_maps()
        main = self._tracer.main
        for thread in main.threads.values() if main is not None else ():
            thread.trace_syscalls(False)  # the startup's libraries are all in

    # -- code that came or went ------------------------------------------------------------

    def follow_maps(self) -> None:
        """The program mapped or unmapped code: take out the sites whose code went, place
        the pending probes whose library came."""
        reader = self._jumps.reader
        if reader is not None and reader.is_active:
            reader.drain()  # stacks in records are named while the code they name is known
        resolver = self._program.symbols()
        resolver.refresh()

        def is_unmapped(site: Any) -> bool:
            # Gone if no mapped object holds the address any more, or another one does.
            # Not by path: a file replaced on disk while mapped reads "(deleted)" in maps.
            module = resolver.get_module_at(site.addr)
            return module is None or module.bias != site.location.bias

        with self._batch():
            for probe in self._manager.unmap(is_unmapped):
                if probe.addr is None and probe.location is not None:
                    self._returns.forget_guard(probe.location.addr)
            for watcher in self.code_watchers:
                watcher()
            for probe, exc in self._manager.resolve_pending():
                self._missed(probe, exc)
            if self._tracer.trampoline.addr:
                self._returns.ensure_unwind_guard()  # libgcc_s and the like come late

    def _missed(self, probe: Kprobe, exc: Exception) -> None:
        """A library came without what the pending ``probe`` names: said once, and kept as
        the reason it is still pending (``misses``)."""
        self.misses[id(probe)] = str(exc)
        self._notice(probe, f"pending probe {probe.symbol} stays pending: {exc}")

    def _notice(self, probe: Kprobe, message: str) -> None:
        key = (id(probe), message)
        if key not in self._noticed:
            self._noticed.add(key)
            self.on_notice(message)

    def _wants_thread_pointer(self, t: Thread) -> bool:
        """Record probes name threads by their thread pointer, which the loader sets only
        after the exec (``arch_prctl``): note it at the first syscall stop that has it."""
        reader = self._jumps.reader
        if reader is None or not reader.is_active:
            return False
        fs_base = t.regs.fs_base
        if fs_base:
            reader.note_thread(fs_base, t.tid, t.tracee.number)
        return not fs_base

    def on_syscall_stop(self, t: Thread) -> None:
        """A syscall stop: the exit of ``execve`` (a new image), or of an ``mmap`` of code
        while the loader starts the program; the others pass."""
        if t.exec_landing:
            t.exec_landing = False
            self._new_image(t)
            return
        wants_tls = self._wants_thread_pointer(t)
        if not self._is_waiting():
            # Nothing waits for a library: the syscall stops of the startup are of no use
            # (a probe registered later still gets its library at the rendezvous).
            if not wants_tls:
                t.trace_syscalls(False)
            return
        regs = t.regs  # loaded by the tracer at the stop
        result = regs.rax
        if (
            regs.orig_rax == NR_MMAP
            and regs.rdx & _PROT_EXEC
            and not regs.r10 & _MAP_ANONYMOUS  # code from a file, not a JIT's page
            and result < (1 << 64) - _MAX_ERRNO  # not an error; at the entry rax is -ENOSYS
        ):
            self.follow_maps()

    def _is_waiting(self) -> bool:
        """Some probe given by symbol, or some watcher of code, waits for a library."""
        return bool(self.code_watchers) or any(p.symbol is not None for p in self._manager.pending)

    def _new_image(self, t: Thread) -> None:
        """``t`` stands at the exit of ``execve``: place every probe the new image allows,
        and follow its loader's startup."""
        # What we knew of the old image: its symbols, its code, its syscall instruction, its
        # ifuncs, its trampoline and guards.
        for forget in self._forget_image:
            forget()
        self._returns.forget_image()
        self._tracer.guarding = False
        self._watch = _Watch.NONE
        self._watch_probe = None
        self.is_starting = True
        # Our own probes of the old image (the rendezvous, the unwinder's guards) went with it.
        own = [p for p in self._manager.pending if isinstance(p.owner, (LoaderWatch, UnwindGuard))]
        for probe in own:
            self._manager.pending.remove(probe)
        try:
            with self._batch():
                hook, self.first_image_hook = self.first_image_hook, None
                if hook is not None:
                    hook()  # a member's probes (family.py)
                for watcher in self.code_watchers:
                    watcher()
                self._returns.reequip()
                self.watch_loader()
                for probe, exc in self._manager.resolve_pending():
                    self._missed(probe, exc)
        except TargetError as exc:
            self.on_notice(f"the new image of process {self.pid}: {exc}")
        self.is_starting = self._watch is _Watch.PLACED
        t.trace_syscalls(self.is_starting)
        self._publish()
