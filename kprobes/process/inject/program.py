"""Making the program run code for us: its own mmap calls, its ifunc resolvers, its rescue.

The out-of-line pages and the rescue's mapping must be mapped by the program itself, and an
ifunc resolver must run in the program to say which implementation it picked. Each borrows
one thread, held while the world is stopped (``calls.py`` saves and restores it). Which
thread may be lent, and what to say when none can be, is decided here.

``ProgramCalls`` is a part of ``Process`` (target.py); the parts that need the program to
run something for them (arming, the fast tier) hold it.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from kprobes.errors import InternalError, NotRelocatable, TargetError
from kprobes.linux import ptrace
from kprobes.linux.syscalls import NR_MMAP, NR_MUNMAP
from kprobes.process.engine.threads import Thread, ThreadState
from kprobes.process.engine.xol import FLAGS, PROT, XolArea, candidate_addresses
from kprobes.process.inject import calls, selfrestore
from kprobes.symbols.maps import Mapping, read_maps

if TYPE_CHECKING:
    from kprobes.process.engine.attachment import Attachment
    from kprobes.process.engine.rescue import Syscall
    from kprobes.process.engine.tracee import Tracee

_MAP_FIXED_NOREPLACE = 0x100000
_PROT_RW = 0x3  # PROT_READ | PROT_WRITE
_MAP_PRIVATE_ANONYMOUS = 0x22
_SIGACTION_ROOM = 64  # scratch for the struct sigaction an injected rt_sigaction reads


class ProgramCalls:
    """Injected calls into the program, for the parts of ``Process`` that need one."""

    def __init__(self, program: Attachment) -> None:
        self._program = program
        self.pid = program.pid
        self._tracer = program.tracer
        self._syscall_insn: int | None = None
        self._ifuncs: dict[int, int] = {}  # resolver → the implementation it picked

    def forget_image(self) -> None:
        """exec replaced the program's image: its syscall instruction and ifuncs too."""
        self._syscall_insn = None
        self._ifuncs.clear()

    def xol(self) -> XolArea:
        """The out-of-line area, its pages mapped by the program as they are needed."""
        if self._tracer.xol is None:
            self._tracer.xol = XolArea(self.map_xol_page)
        return self._tracer.xol

    def map_xol_page(self, near: int, size: int) -> int:
        """Have the program mmap an executable page in a free gap within reach of ``near``."""
        with self.injection_thread() as thread:
            maps = read_maps(self.pid)
            insn = self.find_syscall(maps)
            for cand in candidate_addresses(maps, near, size):
                rescue = self._tracer.rescue
                result = calls.run_syscall(
                    thread,
                    insn,
                    NR_MMAP,
                    cand,
                    size,
                    PROT,
                    FLAGS,
                    (1 << 64) - 1,
                    0,
                    rescue=rescue,
                )
                if result == cand:
                    self._program.memory().write(cand, b"\xcc" * size)
                    self._map_in_children(insn, cand, size)
                    self.note_own_code(cand, cand + size)
                    return cand
                if result >= 0:  # munmap: wrong place
                    calls.run_syscall(thread, insn, NR_MUNMAP, result, size, rescue=rescue)
                    continue
                if result == -errno.EEXIST:
                    continue
                raise TargetError(f"mmap of an out-of-line page failed: {os.strerror(-result)}")
        raise NotRelocatable(
            f"no free address within ±2 GiB of {near:#x} for an out-of-line page",
            errno=errno.ERANGE,
        )

    def _map_in_children(self, insn: int, at: int, size: int) -> None:
        """The page just mapped at ``at``, mapped at the same address in each followed fork
        child too (the world is held): a child has its own copy of the code our probes
        patch, and runs our slots and detours from its own copy of our pages. A page mapped
        before the fork is there already; one mapped after is not, unless we map it. A child
        that cannot take it fails the registration, with the page unmapped nowhere (the
        program keeps it, unused, as it keeps its out-of-line pages)."""
        rescue = self._tracer.rescue
        for tracee in self._tracer.own_memories():
            if tracee is self._tracer.main:
                continue
            try:
                thread = self._tracer.world.held_thread(tracee)
            except InternalError as exc:
                raise TargetError(
                    f"followed child {tracee.pid} has no thread held still to map a page of "
                    "ours in (each fork child needs its own copy of the probe's page)"
                ) from exc
            # On the rescue's stub where the child has its copy of the rescue (mapped before
            # the fork), else on the program's syscall instruction, the same in its copy.
            has_rescue = rescue.is_installed and _is_mapped(tracee, rescue.area)
            result = calls.run_syscall(
                thread,
                insn,
                NR_MMAP,
                at,
                size,
                PROT,
                FLAGS,
                (1 << 64) - 1,
                0,
                rescue=rescue if has_rescue else None,
            )
            if result != at:
                if result >= 0:
                    calls.run_syscall(thread, insn, NR_MUNMAP, result, size)
                    result = -errno.EEXIST
                raise TargetError(
                    f"followed child {tracee.pid} could not map a page of ours at {at:#x} "
                    f"where its parent has it: {os.strerror(-result)}"
                )
            tracee.write(at, b"\xcc" * size)

    def find_syscall(self, maps: list[Mapping]) -> int:
        """The address of an existing ``syscall`` instruction (0f 05) in the program."""
        if self._syscall_insn is not None:
            return self._syscall_insn
        mem = self._program.memory()
        ordered = sorted(
            (m for m in maps if "x" in m.perms and m.path not in ("[vsyscall]", "")),
            key=lambda m: (m.path != "[vdso]", "libc" not in m.path),
        )
        for m in ordered:
            for start in range(m.start, m.end, 0x10000):
                data = mem.read_some(start, min(0x10001, m.end - start))
                at = data.find(b"\x0f\x05")
                if at >= 0:
                    self._syscall_insn = start + at
                    return start + at
        raise TargetError("no syscall instruction found in the program's code")

    def ifunc_target(self, resolver_addr: int) -> int:
        """Run a GNU ifunc resolver in the program: the implementation it picks."""
        impl = self._ifuncs.get(resolver_addr)
        if impl is None:
            with self.world_held():
                self.ensure_rescue()
                trap = self.xol().ensure_page(resolver_addr).start
                with self.injection_thread() as thread:
                    impl = calls.call_function(
                        thread, resolver_addr, trap, rescue=self._tracer.rescue
                    )
            self._ifuncs[resolver_addr] = impl
        return impl

    @contextmanager
    def world_held(self) -> Iterator[None]:
        """Every thread held for the block (a nested stop of the world only counts)."""
        self._program.require()
        self._tracer.world.stop()
        try:
            yield
        finally:
            self._tracer.world.resume()

    @contextmanager
    def injection_thread(self) -> Iterator[Thread]:
        """A thread held still to run code for us (an ``mmap``, an ifunc resolver).

        The world is held here, whoever the caller is. In a held world a thread may have
        stopped for a reason of its own (a hit, a signal) before our interrupt reached it:
        that status is ``pending``, handled once the world runs again, and the tracer does
        not lend such a thread. A busy single-threaded program, stopped again while a probe
        is armed on its loop, has no other thread. Then we borrow one whose pending status is
        a signal-delivery stop: the signal was already taken from the thread, the injection
        resumes it with none and puts back every register, and its siginfo is put back
        here, so the pending stop is handled later exactly as it came. Its interrupt was
        still due (a ptrace-stop does not consume one): the injection's first resume
        reports it and consumes it (``calls._wait_for_trap``), so it is no longer awaited.
        Rejected: failing the registration (the user can do nothing about it), or running
        the pending stop's handlers from here, in the middle of a registration.
        """
        with self.world_held():
            tracer = self._tracer
            try:
                thread = tracer.world.held_thread()
            except InternalError:
                thread = self._thread_stopped_by_signal()
            else:
                yield thread
                return
            info = ptrace.getsiginfo(thread.tid)
            try:
                yield thread
            finally:
                thread.interrupt_sent = False
                with suppress(ProcessLookupError):
                    ptrace.setsiginfo(thread.tid, info)

    def _thread_stopped_by_signal(self) -> Thread:
        """A held thread whose pending status is a signal-delivery stop (see above)."""
        main = self._tracer.main
        for thread in main.threads.values() if main is not None else ():
            status = thread.pending
            if (
                thread.state is ThreadState.STOPPED
                and status is not None
                and os.WIFSTOPPED(status)
                and status >> 16 == 0
            ):
                return thread
        threads = list(main.threads.values()) if main is not None else []
        if threads and all(_is_group_stopped(t) for t in threads):
            raise TargetError(
                f"process {self.pid} is stopped (SIGSTOP or the like): kprobes needs one of "
                "its threads to run a moment to place this probe; continue it (kill -CONT) "
                "and try again",
                errno=errno.EAGAIN,
            )
        stops = ", ".join(
            f"{t.tid}: {t.state.name} {'-' if t.pending is None else hex(t.pending)}"
            for t in threads
        )
        raise InternalError(
            f"no held thread to run code in: every thread is in an event stop ({stops})"
        )

    def ensure_rescue(self) -> None:
        """Give the program its rescue before anything of ours goes in (``rescue.py``)."""
        rescue = self._tracer.rescue
        if rescue.is_installed or rescue.unavailable or self._tracer.main is None:
            return
        # A program that cannot have it (a seccomp filter refusing mmap or rt_sigaction) is
        # still probed, as before the rescue existed: only the tool's death would hurt it.
        with self.injection_thread() as thread:
            try:
                rescue.install(
                    list(self._tracer.own_memories()),
                    lambda size: self._map_rescue(thread, size),
                )
                rescue.activate(*self._rescue_calls(thread))
            except TargetError as exc:
                rescue.unavailable = str(exc)

    def note_own_code(self, start: int, end: int) -> None:
        """Executable code of ours at [start, end) (an out-of-line or detour page): the rescue
        knows it, and a fault of a fetch of ours in it gives ``(fault)`` (faults.py).

        ``map_xol_page`` notes each page it maps; tests note code of their own with it.
        """
        self._tracer.fetch_faults.note_code(start, end)
        self._tracer.rescue.note_page(self._tracer.own_memories(), start, end)

    def activate_fetch_faults(self) -> bool:
        """Before the first detour that may fault on a fetch goes in: make the rescue the
        program's SIGSEGV and SIGBUS handler too, so that the program survives such a fault
        when the tool is dead (while it lives, the tracer fixes it anyway). Once per address
        space (exec forgets it); the world may be held or not.

        False when the program has no rescue (``rescue.unavailable`` says why) or refused
        the actions: its fetch faults are fixed while the tool lives, and would kill it once
        the tool is dead.
        """
        rescue = self._tracer.rescue
        if rescue.is_fetch_faults_active:
            return True
        with self.world_held():
            self.ensure_rescue()
            if not rescue.is_installed:
                return False
            with self.injection_thread() as thread:
                try:
                    rescue.activate_fetch_faults(*self._rescue_calls(thread))
                except TargetError:
                    return False
        return True

    def _rescue_calls(self, thread: Thread) -> tuple[Tracee, Syscall, int]:
        """What the rescue needs to change the program's signal actions through ``thread``
        (held): its memory, an injected syscall on the rescue's stub, and scratch memory
        below its stack for the kernel's ``struct sigaction``."""
        rescue = self._tracer.rescue
        sp = thread.regs.rsp if thread.busy else thread.load_regs().rsp
        return (
            thread.tracee,
            lambda nr, *args: calls.run_syscall(thread, 0, nr, *args, rescue=rescue),
            calls.scratch_below(sp, _SIGACTION_ROOM),
        )

    def map_records(self, size: int) -> int:
        """More room for the rescue's return records (many large kretprobe pools)."""
        with self.injection_thread() as thread:
            result = calls.run_syscall(
                thread,
                0,
                NR_MMAP,
                0,
                size,
                PROT,
                FLAGS & ~_MAP_FIXED_NOREPLACE,
                (1 << 64) - 1,
                0,
                rescue=self._tracer.rescue,
            )
        if result < 0:
            raise TargetError(f"mmap of the rescue's records failed: {os.strerror(-result)}")
        return result

    def map_data(self, size: int) -> int:
        """Private read-write memory of ``size`` bytes the program maps anywhere (the stack
        walks' frame tables: process/fast/frametables.py); the tool writes it."""
        with self.injection_thread() as thread:
            result = calls.run_syscall(
                thread,
                0,
                NR_MMAP,
                0,
                size,
                _PROT_RW,
                _MAP_PRIVATE_ANONYMOUS,
                (1 << 64) - 1,
                0,
                rescue=self._tracer.rescue,
            )
        if result < 0:
            raise TargetError(f"mmap of the frame tables failed: {os.strerror(-result)}")
        return result

    def _map_rescue(self, thread: Thread, size: int) -> int:
        """The one injection the rescue cannot undo: the mapping it lives in. It brings its
        thread home by itself if the tool dies (``selfrestore.py``), where the program's code
        allows; else it runs as any injection did before the rescue."""
        args = (0, size, PROT, FLAGS & ~_MAP_FIXED_NOREPLACE, (1 << 64) - 1, 0)
        way = selfrestore.find_way_home(thread)
        if way is not None:
            result = selfrestore.run_syscall(thread, way, NR_MMAP, *args)
        else:
            insn = self.find_syscall(read_maps(self.pid))
            result = calls.run_syscall(thread, insn, NR_MMAP, *args)
        if result < 0:
            raise TargetError(f"mmap of the rescue area failed: {os.strerror(-result)}")
        return result


def _is_group_stopped(thread: Thread) -> bool:
    """In a job-control stop (SIGSTOP and the like), reported or still pending."""
    if thread.state is ThreadState.GROUP_STOPPED:
        return True
    status = thread.pending
    return (
        status is not None
        and os.WIFSTOPPED(status)
        and (status >> 16) == ptrace.PTRACE_EVENT_STOP
        and os.WSTOPSIG(status) != signal.SIGTRAP
    )


def _is_mapped(tracee: Tracee, addr: int) -> bool:
    try:
        tracee.read(addr, 1)
    except TargetError:
        return False
    return True
