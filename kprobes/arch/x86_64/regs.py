"""The saved registers of one stopped thread, as handlers see them.

The buffer is the kernel's ``struct user_regs_struct`` byte for byte, so the syscall layer
fills it with one PTRACE_GETREGS and writes it back with one PTRACE_SETREGS. Access goes
through a ``memoryview`` cast to unsigned 64-bit words: indexing it costs a few tens of
nanoseconds, against microseconds for a ctypes structure field.

Writes by name (``regs.rax = 1``, ``regs.set()``, ``regs["rax"]``) mark the view ``dirty``.
Writes through ``words`` do not: that is the tracer's and the emulator's own access, and they
know what they changed. So after a hit whose handlers wrote nothing, and whose out-of-line
plan moves only rip, the tracer writes back rip alone (one PTRACE_POKEUSER, about half the
cost of the PTRACE_SETREGS that a dirty view needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, overload

# Word index of each register in struct user_regs_struct (arch/x86/include/asm/user_64.h).
REG_INDEX: Final[dict[str, int]] = {
    "r15": 0,
    "r14": 1,
    "r13": 2,
    "r12": 3,
    "rbp": 4,
    "rbx": 5,
    "r11": 6,
    "r10": 7,
    "r9": 8,
    "r8": 9,
    "rax": 10,
    "rcx": 11,
    "rdx": 12,
    "rsi": 13,
    "rdi": 14,
    "orig_rax": 15,
    "rip": 16,
    "cs": 17,
    "eflags": 18,
    "rsp": 19,
    "ss": 20,
    "fs_base": 21,
    "gs_base": 22,
    "ds": 23,
    "es": 24,
    "fs": 25,
    "gs": 26,
}
NREGS: Final = 27
REGS_SIZE: Final = NREGS * 8

# Names used by the kernel's pt_regs and by kprobe_events (%ax, %ip, ...), and the usual aliases.
ALIASES: Final[dict[str, str]] = {
    "ip": "rip",
    "sp": "rsp",
    "bp": "rbp",
    "flags": "eflags",
    "rflags": "eflags",
    "ax": "rax",
    "bx": "rbx",
    "cx": "rcx",
    "dx": "rdx",
    "si": "rsi",
    "di": "rdi",
    "orig_ax": "orig_rax",
    "return_value": "rax",
}

MASK64: Final = (1 << 64) - 1

# EFLAGS bits used by emulation.
CF: Final = 1 << 0
PF: Final = 1 << 2
ZF: Final = 1 << 6
SF: Final = 1 << 7
TF: Final = 1 << 8
IF: Final = 1 << 9
DF: Final = 1 << 10
OF: Final = 1 << 11


def canonical_name(name: str) -> str:
    """``"ip"`` → ``"rip"``; raises KeyError for names that are not registers."""
    name = ALIASES.get(name, name)
    if name not in REG_INDEX:
        raise KeyError(name)
    return name


class _Reg(property):
    """One register as a typed attribute of ``Regs``: a property over the word view.

    A property is a descriptor written in C that calls a small Python getter; a descriptor
    class with its own ``__get__`` (the first version) costs twice as much per read, since
    the interpreter then looks ``__get__`` up and calls it with three arguments on every access.
    Handlers read registers on every hit.
    """

    __slots__ = ()

    def __init__(self, name: str) -> None:
        index = REG_INDEX[canonical_name(name)]

        def get(regs: Regs) -> int:
            return regs._words[index]

        def set_(regs: Regs, value: int) -> None:
            regs._words[index] = value & MASK64
            regs.dirty = True

        super().__init__(get, set_, None, name)

    if TYPE_CHECKING:

        @overload
        def __get__(self, obj: None, owner: type | None = None) -> _Reg: ...

        @overload
        def __get__(self, obj: Regs, owner: type | None = None) -> int: ...

        def __get__(self, obj: Regs | None, owner: type | None = None) -> int | _Reg: ...

        def __set__(self, obj: Regs, value: int) -> None: ...


class Regs:
    """Readable and writable registers of the thread ``tid``, by name (``regs.rdi``...)."""

    __slots__ = ("_buf", "_words", "dirty", "tid")

    def __init__(self, tid: int = 0, buf: bytearray | None = None) -> None:
        self._buf = bytearray(REGS_SIZE) if buf is None else buf
        self._words = memoryview(self._buf).cast("Q")
        self.tid = tid
        self.dirty = False

    @property
    def words(self) -> memoryview:
        """The registers as unsigned 64-bit words, indexed by ``REG_INDEX`` (for emulation)."""
        return self._words

    @property
    def buffer(self) -> bytearray:
        """The raw user_regs_struct bytes (the syscall layer reads and writes these)."""
        return self._buf

    def get(self, name: str) -> int:
        return int(self._words[REG_INDEX[canonical_name(name)]])

    def set(self, name: str, value: int) -> None:
        self._words[REG_INDEX[canonical_name(name)]] = value & MASK64
        self.dirty = True

    def copy(self) -> Regs:
        """A detached snapshot (handlers that keep regs past their call get this)."""
        clone = Regs(self.tid, bytearray(self._buf))
        return clone

    def frozen(self) -> Regs:
        """A read-only snapshot: every write raises TypeError (asynchronous handlers get
        these: what they would change has already run)."""
        clone = Regs(self.tid, bytearray(self._buf))
        clone._words = memoryview(bytes(self._buf)).cast("Q")
        return clone

    def as_dict(self) -> dict[str, int]:
        return {name: int(self._words[i]) for name, i in REG_INDEX.items()}

    def __getitem__(self, name: str) -> int:
        return self.get(name)

    def __setitem__(self, name: str, value: int) -> None:
        self.set(name, value)

    def __repr__(self) -> str:
        w = self._words
        return (
            f"<Regs tid={self.tid} rip={w[16]:#x} rsp={w[19]:#x} rax={w[10]:#x} "
            f"rdi={w[14]:#x} rsi={w[13]:#x} rdx={w[12]:#x} flags={w[18]:#x}>"
        )

    # Every register by name, and the kernel's pt_regs names as aliases.
    r15 = _Reg("r15")
    r14 = _Reg("r14")
    r13 = _Reg("r13")
    r12 = _Reg("r12")
    rbp = _Reg("rbp")
    rbx = _Reg("rbx")
    r11 = _Reg("r11")
    r10 = _Reg("r10")
    r9 = _Reg("r9")
    r8 = _Reg("r8")
    rax = _Reg("rax")
    rcx = _Reg("rcx")
    rdx = _Reg("rdx")
    rsi = _Reg("rsi")
    rdi = _Reg("rdi")
    orig_rax = _Reg("orig_rax")
    rip = _Reg("rip")
    cs = _Reg("cs")
    eflags = _Reg("eflags")
    rsp = _Reg("rsp")
    ss = _Reg("ss")
    fs_base = _Reg("fs_base")
    gs_base = _Reg("gs_base")
    ds = _Reg("ds")
    es = _Reg("es")
    fs = _Reg("fs")
    gs = _Reg("gs")
    ip = _Reg("ip")
    sp = _Reg("sp")
    bp = _Reg("bp")
    flags = _Reg("flags")
    ax = _Reg("ax")
    bx = _Reg("bx")
    cx = _Reg("cx")
    dx = _Reg("dx")
    si = _Reg("si")
    di = _Reg("di")
    return_value = _Reg("return_value")
