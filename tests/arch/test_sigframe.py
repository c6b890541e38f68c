"""The signal frame that takes an injection's thread home (kprobes/arch/x86_64/sigframe.py).

Bytes in, bytes out: the layout against the kernel's own headers (offsetof, compiled), each
field of a built frame, the FPU state as the kernel checks it, the registers a thread goes on
from, and the two pieces of code looked for. That the kernel really takes such a frame home
is tested on live programs (tests/test_survival_window.py, which also compares a frame of
ours with one the kernel built in the same thread).
"""

from __future__ import annotations

import struct
import subprocess

import pytest
import support

from kprobes.arch.x86_64 import sigframe
from kprobes.arch.x86_64.regs import REG_INDEX, REGS_SIZE

LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include <asm/sigcontext.h>
#include <asm/signal.h>
#include <asm/ucontext.h>
struct rt_sigframe { char *pretcode; struct ucontext uc; struct { char b[128]; } info; };
#define F(s, m) printf(#m " %zu\n", offsetof(struct s, m))
int main(void)
{
	printf("frame %zu\n", sizeof(struct rt_sigframe));
	printf("uc %zu\n", offsetof(struct rt_sigframe, uc));
	F(ucontext, uc_flags); F(ucontext, uc_stack); F(ucontext, uc_mcontext);
	F(ucontext, uc_sigmask);
	F(sigcontext, r8); F(sigcontext, r9); F(sigcontext, r10); F(sigcontext, r11);
	F(sigcontext, r12); F(sigcontext, r13); F(sigcontext, r14); F(sigcontext, r15);
	F(sigcontext, rdi); F(sigcontext, rsi); F(sigcontext, rbp); F(sigcontext, rbx);
	F(sigcontext, rdx); F(sigcontext, rax); F(sigcontext, rcx); F(sigcontext, rsp);
	F(sigcontext, rip); F(sigcontext, eflags); F(sigcontext, cs); F(sigcontext, ss);
	F(sigcontext, oldmask); F(sigcontext, fpstate);
	printf("sigcontext %zu\n", sizeof(struct sigcontext));
	F(_fpstate_64, sw_reserved);
	printf("UC_FP_XSTATE %d\nUC_SIGCONTEXT_SS %d\nUC_STRICT_RESTORE_SS %d\n",
		UC_FP_XSTATE, UC_SIGCONTEXT_SS, UC_STRICT_RESTORE_SS);
	printf("MAGIC1 %u\nMAGIC2 %u\n", FP_XSTATE_MAGIC1, FP_XSTATE_MAGIC2);
	return 0;
}
"""


def test_layout_matches_the_kernel_headers(tmp_path):
    src = tmp_path / "layout.c"
    src.write_text(LAYOUT_C)
    subprocess.run(["gcc", "-o", tmp_path / "layout", src], check=True, timeout=60)
    out = subprocess.run([tmp_path / "layout"], capture_output=True, text=True, check=True)
    got = {k: int(v) for k, v in (line.split() for line in out.stdout.splitlines())}
    assert got["frame"] == sigframe.FRAME_SIZE
    assert got["uc"] == sigframe.UC
    assert got["uc_flags"] == sigframe.UC_FLAGS
    assert got["uc_stack"] == sigframe.UC_STACK
    assert got["uc_mcontext"] == sigframe.UC_MCONTEXT
    assert got["uc_sigmask"] == sigframe.UC_SIGMASK
    for i, name in enumerate(sigframe.SIGCONTEXT_REGS):
        assert got[name] == 8 * i, name
    assert got["cs"] == 8 * len(sigframe.SIGCONTEXT_REGS)
    assert got["ss"] == got["cs"] + 6
    assert got["oldmask"] == sigframe.SC_FPSTATE - 16
    assert got["fpstate"] == sigframe.SC_FPSTATE
    assert got["sigcontext"] == sigframe._SIGCONTEXT.size == 256
    assert got["sw_reserved"] == sigframe.SW_BYTES
    assert got["UC_FP_XSTATE"] == sigframe.UC_FP_XSTATE
    assert got["UC_SIGCONTEXT_SS"] == sigframe.UC_SIGCONTEXT_SS
    assert got["UC_STRICT_RESTORE_SS"] == sigframe.UC_STRICT_RESTORE_SS
    assert got["MAGIC1"] == sigframe.FP_XSTATE_MAGIC1
    assert got["MAGIC2"] == sigframe.FP_XSTATE_MAGIC2


def regs_of(**values: int) -> bytes:
    """A user_regs_struct: every register a distinct value, unless given."""
    out = bytearray(REGS_SIZE)
    for name, index in REG_INDEX.items():
        value = values.get(name, 0x1111_0000_0000_0000 + index * 0x0101)
        struct.pack_into("<Q", out, 8 * index, value & (1 << 64) - 1)
    return bytes(out)


def word(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 8], "little")


def xsave_image(size: int = 2432, xcr0: int = 0xE7, present: int = 0x4) -> bytes:
    """An XSAVE image as PTRACE_GETREGSET gives it: the user's XCR0 in the first
    software-reserved word, the header's XSTATE_BV."""
    out = bytearray(range(256)) * (size // 256) + bytearray(size % 256)
    out[sigframe.SW_BYTES : sigframe.SW_BYTES + 48] = bytes(48)
    struct.pack_into("<Q", out, sigframe.SW_BYTES, xcr0)
    out[sigframe.XSTATE_BV : sigframe.XSTATE_BV + 64] = bytes(64)
    struct.pack_into("<Q", out, sigframe.XSTATE_BV, present)
    return bytes(out)


RSP = 0x7FFF_FFFF_E123


def test_a_frame_holds_the_registers_mask_and_fpu_state_below_the_red_zone():
    regs = regs_of(rsp=RSP, cs=0x33, ss=0x2B)
    fpu = sigframe.fpstate(xsave_image())
    frame = sigframe.build(regs, 0x8000_0000_0000_0201, fpu, restorer=0x7F00_0000_1234)
    data = frame.data
    assert frame.fpstate % 64 == 0
    assert frame.address % 16 == 8  # as at a function's entry: rsp + 8 aligned after ret
    assert frame.end == frame.fpstate + len(fpu) <= RSP - sigframe.RED_ZONE
    assert frame.fpstate - frame.address >= sigframe.FRAME_SIZE
    assert data[frame.fpstate - frame.address :] == fpu
    assert word(data, 0) == 0x7F00_0000_1234  # the return address: the restorer
    uc = sigframe.UC
    flags = sigframe.UC_FP_XSTATE | sigframe.UC_SIGCONTEXT_SS | sigframe.UC_STRICT_RESTORE_SS
    assert word(data, uc + sigframe.UC_FLAGS) == flags
    assert word(data, uc + 8) == 0  # uc_link
    ss_sp, ss_flags, ss_size = struct.unpack_from("<Qi4xQ", data, uc + sigframe.UC_STACK)
    assert (ss_sp, ss_flags, ss_size) == (0, sigframe.SS_REFUSED, 0)
    sc = uc + sigframe.UC_MCONTEXT
    for i, name in enumerate(sigframe.SIGCONTEXT_REGS):
        assert word(data, sc + 8 * i) == word(regs, 8 * REG_INDEX[name]), name
    cs, gs, fs, ss = struct.unpack_from("<4H", data, sc + 144)
    assert (cs, gs, fs, ss) == (0x33, 0, 0, 0x2B)
    assert word(data, sc + sigframe.SC_FPSTATE - 16) == 0x8000_0000_0000_0201  # oldmask
    assert word(data, sc + sigframe.SC_FPSTATE) == frame.fpstate
    assert word(data, uc + sigframe.UC_SIGMASK) == 0x8000_0000_0000_0201
    assert data[uc + sigframe.UC_SIGMASK + 8 : frame.fpstate - frame.address] == bytes(
        frame.fpstate - frame.address - uc - sigframe.UC_SIGMASK - 8
    )  # the siginfo and the padding


def test_an_fxsave_frame_says_so():
    fx = bytes(range(256)) * 2
    assert sigframe.fpstate(fx) == fx
    frame = sigframe.build(regs_of(rsp=RSP), 0, fx, restorer=1)
    assert not word(frame.data, sigframe.UC) & sigframe.UC_FP_XSTATE
    assert frame.end == frame.fpstate + 512


def test_the_frame_sits_where_the_kernel_would_put_its_own():
    """get_sigframe(): below the red zone, the FPU state rounded down to 64, then the frame
    rounded down to 16, minus 8."""
    for rsp in (0x7FFC_0000_1000, 0x7FFC_0000_1008, 0x7FFC_0000_0FF0, 0x7FFC_0000_0FC7):
        fpu = sigframe.fpstate(xsave_image())
        frame = sigframe.build(regs_of(rsp=rsp), 0, fpu, restorer=1)
        fp = (rsp - 128 - len(fpu)) // 64 * 64
        assert frame.fpstate == fp
        assert frame.address == (fp - sigframe.FRAME_SIZE) // 16 * 16 - 8


def test_the_xsave_state_gets_what_the_kernel_checks():
    image = xsave_image(size=2432, xcr0=0xE7, present=0x4)
    fpu = sigframe.fpstate(image)
    assert len(fpu) == 2432 + 4
    magic1, extended, xfeatures, size = struct.unpack_from("<IIQI", fpu, sigframe.SW_BYTES)
    assert (magic1, extended, xfeatures, size) == (sigframe.FP_XSTATE_MAGIC1, 2436, 0xE7, 2432)
    assert fpu[2432:] == struct.pack("<I", sigframe.FP_XSTATE_MAGIC2)
    assert word(fpu, sigframe.XSTATE_BV) == 0x4 | sigframe.XFEATURE_FPSSE
    assert fpu[:464] == image[:464]  # the legacy state itself untouched
    assert fpu[576:2432] == image[576:2432]


def test_pkru_is_loaded_from_the_frame_not_reset():
    fpu = sigframe.fpstate(xsave_image(size=2696, xcr0=0x2E7, present=0x0))
    assert word(fpu, sigframe.XSTATE_BV) == sigframe.XFEATURE_PKRU | sigframe.XFEATURE_FPSSE


def test_unused_amx_tiles_are_left_out():
    """The tile data (8 KiB, last) counts in a task's state only with its permission."""
    xcr0 = 0x60207  # x87, SSE, AVX, PKRU, XTILECFG, XTILEDATA
    fpu = sigframe.fpstate(xsave_image(size=11008, xcr0=xcr0, present=0x4))
    _, extended, xfeatures, size = struct.unpack_from("<IIQI", fpu, sigframe.SW_BYTES)
    assert (size, extended) == (11008 - 8192, 11008 - 8192 + 4)
    assert xfeatures == xcr0 & ~sigframe.XFEATURE_XTILEDATA
    magic2 = struct.pack("<I", sigframe.FP_XSTATE_MAGIC2)
    assert fpu[size : size + 4] == magic2 and fpu[-4:] == magic2 and len(fpu) == 11008 + 4
    used = sigframe.fpstate(xsave_image(size=11008, xcr0=xcr0, present=0x40004))
    assert struct.unpack_from("<IIQI", used, sigframe.SW_BYTES)[3] == 11008
    assert len(used) == 11008 + 4


# XSAVE layouts of real CPUs: (XCR0, size of the standard-format image). The offsets are the
# architecture's: a CPU without AVX-512 still puts PKRU where Intel's put it after the AVX-512
# state, or (AMD before Zen 4) right after AVX.
LAYOUTS = {
    "sse": (0x3, 576),  # XSAVE with x87 and SSE alone (a hypervisor hiding AVX)
    "avx": (0x7, 832),
    "avx-pkru-amd": (0x207, 2440),  # AMD EPYC (Zen 1-3), this 2-vCPU KVM guest: CPUID 0xD
    "avx512": (0xE7, 2688),
    "avx512-pkru": (0x2E7, 2696),  # Intel since Skylake-SP, AMD Zen 4
    "amx": (0x602E7, 11008),  # Intel Sapphire Rapids, tiles unused
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gets_what_the_kernel_checks(layout):
    """Whatever the CPU has: the software bytes name its features and the image's size, the
    end magic follows, FP/SSE (and PKRU) are marked present, the state itself is untouched."""
    xcr0, size = LAYOUTS[layout]
    image = xsave_image(size=size, xcr0=xcr0, present=0x4 & xcr0)
    fpu = sigframe.fpstate(image)
    magic1, extended, xfeatures, xstate_size = struct.unpack_from("<IIQI", fpu, sigframe.SW_BYTES)
    tiles = sigframe.XFEATURE_XTILEDATA if xcr0 & sigframe.XFEATURE_XTILEDATA else 0
    want_size = size - (sigframe.XTILEDATA_SIZE if tiles else 0)
    assert (magic1, xfeatures) == (sigframe.FP_XSTATE_MAGIC1, xcr0 & ~tiles)
    assert (xstate_size, extended) == (want_size, want_size + 4)
    assert fpu[want_size : want_size + 4] == struct.pack("<I", sigframe.FP_XSTATE_MAGIC2)
    pkru = xcr0 & sigframe.XFEATURE_PKRU
    assert word(fpu, sigframe.XSTATE_BV) == (0x4 & xcr0) | sigframe.XFEATURE_FPSSE | pkru
    assert fpu[: sigframe.SW_BYTES] == image[: sigframe.SW_BYTES]
    assert fpu[sigframe.XSTATE_MIN : want_size] == image[sigframe.XSTATE_MIN : want_size]
    frame = sigframe.build(regs_of(rsp=RSP), 0, fpu, restorer=1)
    assert word(frame.data, sigframe.UC) & sigframe.UC_FP_XSTATE
    assert frame.end == frame.fpstate + len(fpu) <= RSP - sigframe.RED_ZONE


@pytest.mark.parametrize("layout", ["avx512", "avx512-pkru", "amx"])
def test_a_cpu_with_avx512_masked_is_a_cpu_without(layout):
    """The frame of an AVX-512 machine's image with AVX-512 masked (support.xsave_without, as
    the live test_every_register_comes_home_without_avx512 does) is the frame of a CPU that
    never had it: the same features, the same size, none of AVX-512 marked present."""
    xcr0, size = LAYOUTS[layout]
    present = 0x4 | support.XFEATURES_AVX512
    masked = support.xsave_without(xsave_image(size=size, xcr0=xcr0, present=present), 0xE0)
    fpu = sigframe.fpstate(masked)
    without = xcr0 & ~support.XFEATURES_AVX512
    native = sigframe.fpstate(xsave_image(size=size, xcr0=without, present=0x4))
    sw = slice(sigframe.SW_BYTES, sigframe.SW_BYTES + 48)
    assert fpu[sw] == native[sw]
    assert struct.unpack_from("<IIQI", fpu, sigframe.SW_BYTES)[2] & support.XFEATURES_AVX512 == 0
    assert word(fpu, sigframe.XSTATE_BV) & support.XFEATURES_AVX512 == 0
    assert len(fpu) == len(native)
    assert support.xsave_without(bytes(512), 0xE0) == bytes(512)  # FXSAVE: nothing to mask


def test_a_short_xsave_image_is_refused():
    with pytest.raises(ValueError):
        sigframe.fpstate(bytes(520))
    with pytest.raises(ValueError):
        sigframe.build(bytes(8), 0, bytes(512), 1)


MINUS = 1 << 64


@pytest.mark.parametrize(
    ("orig_rax", "rax", "want_rax", "want_rip"),
    [
        (MINUS - 1, 0x1234, 0x1234, 0x5002),  # not in a syscall: as it is
        (0, 5, 5, 0x5002),  # a syscall that returned
        (202, MINUS - 512, 202, 0x5000),  # -ERESTARTSYS: restarted
        (202, MINUS - 513, 202, 0x5000),  # -ERESTARTNOINTR
        (7, MINUS - 514, 7, 0x5000),  # -ERESTARTNOHAND (no handler runs)
        (35, MINUS - 516, 35, 0x5000),  # -ERESTART_RESTARTBLOCK: made again from its start
        (0, MINUS - 4, MINUS - 4, 0x5002),  # -EINTR itself
        (0, MINUS - 11, MINUS - 11, 0x5002),
    ],
)
def test_the_registers_a_thread_goes_on_from(orig_rax, rax, want_rax, want_rip):
    regs = regs_of(orig_rax=orig_rax, rax=rax, rip=0x5002)
    out = sigframe.resumed(regs)
    assert word(out, 8 * REG_INDEX["rax"]) == want_rax
    assert word(out, 8 * REG_INDEX["rip"]) == want_rip
    others = [n for n in REG_INDEX if n not in ("rax", "rip")]
    assert all(word(out, 8 * REG_INDEX[n]) == word(regs, 8 * REG_INDEX[n]) for n in others)


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("b8 27 00 00 00 0f 05 c3", 5),  # getpid: mov eax, 39; syscall; ret
        ("0f 05 f3 c3", 0),  # rep ret
        ("0f 05 48 3d 01 f0 ff ff 73 01 c3", None),  # syscall(): the error path first
        ("0f 05 c2 08 00", None),  # ret 8 pops more than the return address
        ("0f 05 90 c3 0f 05 c3", 4),
        ("90 90 0f", None),
        ("0f 05", None),  # cut short
    ],
)
def test_find_syscall_ret(code, want):
    base = 0x40_0000
    found = sigframe.find_syscall_ret(bytes.fromhex(code), base)
    assert found == (None if want is None else base + want)


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("48 c7 c0 0f 00 00 00 0f 05 0f 1f 80 00 00 00 00", 0),  # glibc's __restore_rt
        ("90 b8 0f 00 00 00 0f 05", 1),  # mov eax, 15
        ("48 b8 0f 00 00 00 00 00 00 00 0f 05", 0),  # movabs
        ("b8 0e 00 00 00 0f 05", None),  # rt_sigprocmask
        ("b8 0f 00 00 00 90 0f 05", None),  # not followed by the syscall
        ("bb 0f 00 00 00 0f 05", None),  # mov ebx, 15
        ("0f 05", None),
    ],
)
def test_find_restorer(code, want):
    base = 0x7F00_0000_0000
    found = sigframe.find_restorer(bytes.fromhex(code), base)
    assert found == (None if want is None else base + want)
