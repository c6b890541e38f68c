"""One traced thread: its ptrace state machine, its register buffer, its held signals.

The state says who owns the thread right now. RUNNING and STEPPING threads belong to the
kernel (their next stop will be reported); STOPPED and GROUP_STOPPED threads are held by us.
STEPPING means the thread was resumed into an out-of-line slot and its next trap completes
the probed instruction. NEW is a thread announced by a clone/fork event whose first stop has
not been reported yet: it cannot run until we resume it.
"""

from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING, Any

from kprobes.arch.x86_64.plan import PlanKind
from kprobes.arch.x86_64.regs import REG_INDEX, Regs
from kprobes.core.retprobes import KretprobeInstance, Task
from kprobes.errors import InternalError
from kprobes.linux import ptrace
from kprobes.process.engine.cpus import WINDOW
from kprobes.values import replace

if TYPE_CHECKING:
    from kprobes.core.table import ProbeSite
    from kprobes.process.engine.tracee import Tracee


class ThreadState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STEPPING = "stepping"
    STOPPED = "stopped"
    GROUP_STOPPED = "group-stopped"


S = ThreadState
_ALLOWED: dict[ThreadState, frozenset[ThreadState]] = {
    S.NEW: frozenset({S.STOPPED, S.GROUP_STOPPED}),
    S.RUNNING: frozenset({S.STOPPED, S.GROUP_STOPPED}),
    S.STEPPING: frozenset({S.STOPPED, S.GROUP_STOPPED}),
    S.STOPPED: frozenset({S.RUNNING, S.STEPPING, S.GROUP_STOPPED, S.STOPPED}),
    S.GROUP_STOPPED: frozenset({S.STOPPED, S.RUNNING}),
}

RUNNING_STATES = frozenset({S.RUNNING, S.STEPPING})
_RUNNING = S.RUNNING  # an Enum class attribute costs ~900 instructions a read in 3.11
_STEPPING = S.STEPPING

_RIP = REG_INDEX["rip"]
RIP_OFFSET = _RIP * 8  # rip in struct user, whose first member is the registers
STACK_SCAN = 0x10000  # bytes above a stack pointer searched for a saved rip (stack_words)


class Thread:
    __slots__ = (
        "busy",
        "event_stopped",
        "exec_landing",
        "held_signals",
        "interrupt_sent",
        "lost",
        "pending",
        "pending_from",
        "regs",
        "regs_struct",
        "req",
        "reraised",
        "resume_stepping",
        "rets",
        "rip_word",
        "skip_hit",
        "state",
        "step_prep",
        "step_site",
        "stops_to_check",
        "task",
        "tid",
        "to_syscall_entry",
        "tracee",
        "unhooked",
        "words",
    )

    def __init__(self, tid: int, tracee: Tracee, state: ThreadState) -> None:
        self.tid = tid
        self.tracee = tracee
        self.state = state
        self.regs = Regs(tid)
        self.regs_struct = ptrace.StructBuffer(self.regs.buffer)
        self.words = self.regs.words  # the hit path's access to the registers
        self.req = ptrace.bind_requests(tid, self.regs_struct, RIP_OFFSET)  # poke_user: rip
        self.rip_word = ptrace.Word()  # rip, as store_rip hands it to the syscall layer
        self.step_site: ProbeSite | None = None  # the site whose slot it is executing
        self.step_prep: Any = None  # that site's out-of-line state when the step began
        self.held_signals: list[tuple[int, bytes]] = []  # (signo, siginfo) to deliver later
        self.pending: int | None = None  # a wait status received while the world was stopping
        self.pending_from = state  # the state the thread was in when that status came
        self.interrupt_sent = False
        self.busy = False  # a handler is running for it: nobody else may resume it
        self.skip_hit: tuple[int, int] | None = None  # (addr, rsp): handlers already ran
        self.task = Task(tracee.pid, tid)  # what return-probe handlers see as ri.task
        self.rets: list[KretprobeInstance] = []  # live return-probe instances, oldest first
        self.lost: dict[int, int] = {}  # stack slot → real return address of released ones
        self.unhooked = False  # the unwinder has the real return addresses in its frames
        self.resume_stepping = False  # held back onto its step's int3: resumes STEPPING
        self.event_stopped = False  # held in an event stop, where no signal can be injected
        self.reraised: list[bytes] = []  # siginfo of held signals sent again with tgkill
        self.exec_landing = False  # its next syscall stop is the exit of execve
        self.stops_to_check = WINDOW  # traps until cpus.py looks at its pace again
        # Resumed with PTRACE_SYSCALL to the entry of its step's `syscall`, holding the
        # signals that came before the syscall began (signals.py).
        self.to_syscall_entry = False

    def to(self, state: ThreadState) -> None:
        """The one place a thread changes state; impossible transitions are bugs."""
        if state not in _ALLOWED[self.state]:
            raise InternalError(f"thread {self.tid}: {self.state.value} -> {state.value}")
        self.state = state

    def stack_words(self, rsp: int, size: int = STACK_SCAN) -> memoryview:
        """The 8-byte words in ``size`` bytes from ``rsp`` up (fewer where the stack ends):
        where a return address, or the rip a signal frame saved, would be found."""
        data = self.tracee.read_some(rsp & ~7, size)
        return memoryview(data[: len(data) & ~7]).cast("Q")

    def load_regs(self) -> Regs:
        getregs = self.req.getregs  # not self.req.getregs(): see Tracer.run
        if getregs() == -1:
            ptrace.raise_error()
        self.regs.dirty = False
        return self.regs

    def store_regs(self) -> None:
        setregs = self.req.setregs
        if setregs() == -1:
            ptrace.raise_error()
        self.regs.dirty = False

    def store_rip(self) -> None:
        """Write back rip alone: the view differs from the kernel's registers in rip only."""
        word = self.rip_word
        word.value = self.words[_RIP]
        poke_user = self.req.poke_user
        if poke_user(word) == -1:
            ptrace.raise_error()

    def store_changes(self) -> None:
        """Write back a view in which we changed rip: all registers if anyone else wrote one."""
        if self.regs.dirty:
            self.store_regs()
        else:
            self.store_rip()

    def resume(self, sig: int = 0) -> None:
        """PTRACE_CONT, delivering a held signal (with its original siginfo) if there is one.

        Not to a thread going back into its step (the signal waits for the step's end), and
        not by PTRACE_CONT from an event stop, which injects nothing: there the signal is
        sent again (tgkill), and its own siginfo is put back when it is reported.
        """
        stepping = self.resume_stepping and self.step_site is not None
        if not sig and self.held_signals and not stepping:
            if self.event_stopped:
                for held, info in self.held_signals:
                    self.reraised.append(info)
                    ptrace.tgkill(self.tracee.pid, self.tid, held)
                self.held_signals.clear()
            else:
                sig, info = self.held_signals.pop(0)
                ptrace.setsiginfo(self.tid, info)
        self.event_stopped = False
        if sig:
            (ptrace.syscall_cont if self.is_tracing_syscalls else ptrace.cont)(self.tid, sig)
        elif stepping and self.to_syscall_entry:
            ptrace.syscall_cont(self.tid, 0)  # on to its syscall's entry, as before the stop
        elif stepping and self.step_prep.kind is PlanKind.BOOST:
            ptrace.singlestep(self.tid, 0)  # a boosted copy has no int3 to end the step at
        else:
            cont = self.req.cont
            if cont() == -1:
                ptrace.raise_error()
        if self.resume_stepping and self.step_site is not None:
            self.resume_stepping = False
            self.to(_STEPPING)
        else:
            self.resume_stepping = False
            self.to(_RUNNING)

    def trace_syscalls(self, on: bool) -> None:
        """Resume it with PTRACE_SYSCALL from now on (stopping at each syscall's entry and
        exit), or with PTRACE_CONT again."""
        req = self.req
        want = req.syscall_cont if on else req.plain_cont
        if req.cont is not want:
            self.req = replace(req, cont=want)

    @property
    def is_tracing_syscalls(self) -> bool:
        return self.req.cont is self.req.syscall_cont

    def step(self) -> None:
        ptrace.singlestep(self.tid, 0)
        self.to(_STEPPING)

    def __repr__(self) -> str:
        return f"<Thread {self.tid} {self.state.value}>"


def siginfo_code(info: bytes) -> int:
    """si_code of a raw siginfo (int si_signo, si_errno, si_code)."""
    return int(struct.unpack_from("<i", info, 8)[0])
