"""Which probe sites can be jump-optimized, what the jump displaces, and its relocation.

The functions are assembled and linked by gcc (a shared object without libc) and read back
with pyelftools, so the bytes are what a program holds; a switch in C gives a real jump table.
"""

from __future__ import annotations

import errno

import pytest
from elf_bytes import Function, build
from iced_x86 import Decoder, FlowControl

from kprobes.arch.x86_64.jumpopt import Refusal, Region, find_region, relocate_region
from kprobes.errors import InternalError, NotRelocatable

GIB = 1 << 30

ASM = r"""
    .text
    .macro func name
    .globl \name
    .hidden \name
    .type \name, @function
\name:
    .endm
    .macro end name
    .size \name, .-\name
    .endm

    func fp_prologue
    push %rbp
    mov %rsp, %rbp
    sub $16, %rsp
    mov %rdi, -8(%rbp)
    mov -8(%rbp), %rax
    leave
    ret
    end fp_prologue

    func endbr_push
    endbr64
    push %rbx
    mov %rdi, %rbx
    mov %rbx, %rax
    pop %rbx
    ret
    end endbr_push

    func region_call
    push %rbp
    call helper
    pop %rbp
    ret
    end region_call

    func helper
    xor %eax, %eax
    ret
    end helper

    func jump_in
    xor %eax, %eax
1:  inc %rax
    cmp %rdi, %rax
    jb 1b
    ret
    end jump_in

    func jump_to_start
1:  add $1, %rax
    mov %rax, %rdx
    cmp %rdi, %rax
    jb 1b
    ret
    end jump_to_start

    func jump_to_end
    mov %rdi, %rax
    add $1, %rax
    test %rdi, %rdi
    je 1f
    jmp 2f
1:  ret
2:  jmp jump_to_end + 7
    end jump_to_end

    func call_into
    lea 1(%rdi), %rax
    mov %rax, %rdx
    call call_into + 3
    ret
    end call_into

    func near_end
    mov %rdi, %rax
    add $1, %rax
    ret
    end near_end

    func rip_load
    mov counter(%rip), %rax
    add %rdi, %rax
    ret
    end rip_load

    func rip_lea
    endbr64
    lea counter(%rip), %rax
    ret
    end rip_lea

    func with_int3
    push %rbp
    mov %rsp, %rbp
    sub $16, %rsp
    int3
    leave
    ret
    end with_int3

    func with_syscall
    xor %eax, %eax
    syscall
    ret
    end with_syscall

    func jcc_region
    test %rdi, %rdi
    jne 1f
    xor %eax, %eax
1:  ret
    end jcc_region

    func ret_region
    push %rbx
    pop %rbx
    ret
    nop
    nop
    end ret_region

    func cold_part
    jmp fp_prologue + 1
    end cold_part

    .data
counter:
    .quad 0
    .section .note.GNU-stack, "", @progbits
"""

SWITCH = r"""
long dispatch(long op, long x)
{
    switch (op) {
    case 0: return x + 1;
    case 1: return x * 3;
    case 2: return x - 7;
    case 3: return x << 2;
    case 4: return x ^ 0x55;
    case 5: return x / 5;
    case 6: return x | 9;
    default: return 0;
    }
}
"""


@pytest.fixture(scope="module")
def fns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Function]:
    out = tmp_path_factory.mktemp("jumpopt") / "sites.so"
    sources = {"sites.S": ASM, "switch.c": SWITCH}
    return build(out, sources, "-O2", "-fPIC", "-shared", "-nostdlib", "-fcf-protection=none")


def region(f: Function, offset: int = 0, **kw: object) -> Region | Refusal:
    return find_region(f.code, f.addr, f.at(offset), f.size, **kw)  # type: ignore[arg-type]


def refusal(f: Function, offset: int = 0, **kw: object) -> str:
    got = region(f, offset, **kw)
    assert isinstance(got, Refusal), got
    assert got.addr == f.at(offset)
    return got.reason


# ---- optimizable sites ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "offset", "texts", "lengths"),
    [
        ("fp_prologue", 0, ["push rbp", "mov rbp, rsp", "sub rsp, 0x10"], (1, 3, 4)),
        ("fp_prologue", 1, ["mov rbp, rsp", "sub rsp, 0x10"], (3, 4)),
        ("endbr_push", 0, ["endbr64", "push rbx"], (4, 1)),
        ("jump_to_start", 0, ["add rax, 1", "mov rdx, rax"], (4, 3)),
        ("jump_to_end", 0, ["mov rax, rdi", "add rax, 1"], (3, 4)),
        ("rip_load", 0, ["mov rax, [rip+0x{disp:x}]"], (7,)),
        ("rip_lea", 0, ["endbr64", "lea rax, [rip+0x{disp:x}]"], (4, 7)),
    ],
)
def test_optimizable(
    fns: dict[str, Function], name: str, offset: int, texts: list[str], lengths: tuple[int, ...]
) -> None:
    f = fns[name]
    got = region(f, offset)
    assert isinstance(got, Region), got
    assert got.addr == f.at(offset)
    assert got.lengths == lengths
    assert got.length == sum(lengths) >= 5
    assert got.end == f.at(offset) + got.length
    assert got.original == f.code[offset : offset + got.length]
    assert [i.addr for i in got.insns] == [
        f.at(offset + sum(lengths[:k])) for k in range(len(lengths))
    ]
    if "{disp" in texts[-1]:
        last = got.insns[-1]
        assert last.rip_relative
        disp = int.from_bytes(last.code[3:7], "little")
        texts = [*texts[:-1], texts[-1].format(disp=disp)]
    assert [i.text for i in got.insns] == texts
    assert got.contains(got.addr) and got.contains(got.end - 1) and not got.contains(got.end)


# ---- refused sites ----------------------------------------------------------------------------


def test_call_in_region(fns: dict[str, Function]) -> None:
    f = fns["region_call"]
    reason = refusal(f)
    assert reason.startswith("a call in the region (`call 0x")
    assert f"at {f.at(1):#x}" in reason


def test_jump_table_is_an_indirect_jump(fns: dict[str, Function]) -> None:
    f = fns["dispatch"]
    insns = list(Decoder(64, f.code, ip=f.addr))
    assert any(i.flow_control == FlowControl.INDIRECT_BRANCH for i in insns), "no jump table"
    reason = refusal(f)
    assert reason.startswith("indirect jump at 0x") and "jmp" in reason


def test_jump_into_region(fns: dict[str, Function]) -> None:
    f = fns["jump_in"]
    reason = refusal(f)
    assert reason.startswith("`jb 0x") and f"jumps into the region ({f.at(2):#x})" in reason


def test_call_into_region(fns: dict[str, Function]) -> None:
    f = fns["call_into"]
    assert f"jumps into the region ({f.at(3):#x})" in refusal(f)


def test_fewer_than_5_bytes_to_the_end(fns: dict[str, Function]) -> None:
    assert refusal(fns["helper"]) == "only 3 bytes to the function's end; the jump needs 5"
    assert refusal(fns["near_end"], 7) == "only 1 bytes to the function's end; the jump needs 5"


def test_region_past_the_end(fns: dict[str, Function]) -> None:
    f = fns["near_end"]  # mov (3) add (4) ret (1): from +3, add and ret end the function
    assert refusal(f, 3).startswith("a return in the region")
    # A function whose size cuts its last instruction (a wrong symbol size): nothing is trusted.
    cut = find_region(f.code, f.addr, f.addr, 5)
    assert isinstance(cut, Refusal)
    assert cut.reason == f"the instruction at {f.at(3):#x} runs past the end of the function"


def test_not_a_boundary(fns: dict[str, Function]) -> None:
    f = fns["fp_prologue"]
    assert refusal(f, 2) == f"{f.at(2):#x} is not an instruction boundary"


def test_int3_in_function(fns: dict[str, Function]) -> None:
    f = fns["with_int3"]
    assert refusal(f) == f"int3 at {f.at(8):#x} in the function"


def test_syscall_in_region(fns: dict[str, Function]) -> None:
    assert refusal(fns["with_syscall"]).startswith("a syscall in the region (`syscall` at")


def test_jcc_in_region(fns: dict[str, Function]) -> None:
    assert refusal(fns["jcc_region"]).startswith("a conditional jump in the region (`jne 0x")


def test_ret_in_region(fns: dict[str, Function]) -> None:
    assert refusal(fns["ret_region"]).startswith("a return in the region (`ret` at")


def test_fragment_jumping_into_region(fns: dict[str, Function]) -> None:
    f, cold = fns["fp_prologue"], fns["cold_part"]
    assert isinstance(region(f), Region)
    reason = refusal(f, fragments=[(cold.addr, cold.code)])
    assert reason.startswith("`jmp 0x") and f"jumps into the region ({f.at(1):#x})" in reason


def test_entries_inside_region(fns: dict[str, Function]) -> None:
    f = fns["fp_prologue"]
    assert isinstance(region(f, entries=[f.addr, f.at(8)]), Region)  # A and A+len are fine
    assert (
        refusal(f, entries=[f.at(4)]) == f"{f.at(4):#x} inside the region is entered from elsewhere"
    )


def test_undecodable(fns: dict[str, Function]) -> None:
    code = bytes.fromhex("55 4889e5 06 c3")  # 06 (push es) is invalid in 64-bit mode
    got = find_region(code, 0x1000, 0x1000, len(code))
    assert got == Refusal(0x1000, "undecodable bytes at 0x1004")


def test_unknown_size() -> None:
    assert find_region(b"\x55", 0x1000, 0x1000, 0) == Refusal(
        0x1000, "the function's size is unknown"
    )


def test_caller_bugs_raise() -> None:
    code = bytes.fromhex("55 4889e5 4883ec10 c9 c3")
    with pytest.raises(InternalError):
        find_region(code, 0x1000, 0x2000, len(code))
    with pytest.raises(InternalError):
        find_region(code[:4], 0x1000, 0x1000, len(code))


def test_plan_refusals_are_kept() -> None:
    # A far return in the region: plan.py refuses it, with its own reason.
    code = bytes.fromhex("55 cb 90 90 90 90")
    got = find_region(code, 0x1000, 0x1000, len(code))
    assert isinstance(got, Refusal)
    assert got.reason == "`ret far` at 0x1001 cannot run out of line: a far return (lret)"


# ---- relocation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rip_load", "rip_lea", "fp_prologue"])
@pytest.mark.parametrize("delta", [0x1000, -0x5000, GIB, -GIB])
def test_relocate_keeps_targets(fns: dict[str, Function], name: str, delta: int) -> None:
    f = fns[name]
    # The function placed high enough that the negative deltas stay in the address space.
    base = 0x5555_0000_0000
    moved_region = find_region(f.code, base + f.addr, base + f.addr, f.size)
    assert isinstance(moved_region, Region)
    original = list(Decoder(64, moved_region.original, ip=moved_region.addr))
    at = moved_region.addr + delta
    copy = relocate_region(moved_region, at)
    assert len(copy) == moved_region.length
    relocated = list(Decoder(64, copy, ip=at))
    assert [i.code for i in relocated] == [i.code for i in original]
    for old, new in zip(original, relocated, strict=True):
        assert new.ip - at == old.ip - moved_region.addr
        if old.is_ip_rel_memory_operand:
            assert new.ip_rel_memory_address == old.ip_rel_memory_address
        else:
            assert (
                copy[new.ip - at : new.ip - at + new.len]
                == moved_region.original[
                    old.ip - moved_region.addr : old.ip - moved_region.addr + old.len
                ]
            )


def test_relocate_out_of_reach(fns: dict[str, Function]) -> None:
    f = fns["rip_lea"]
    base = 0x5555_0000_0000
    got = find_region(f.code, base + f.addr, base + f.addr, f.size)
    assert isinstance(got, Region)
    with pytest.raises(NotRelocatable, match="out of rel32 reach") as info:
        relocate_region(got, got.addr + 3 * GIB)
    assert info.value.errno == errno.ERANGE
    # Without a rip-relative operand, any address will do.
    plain = region(fns["fp_prologue"])
    assert isinstance(plain, Region)
    assert relocate_region(plain, plain.addr + 100 * GIB) == plain.original
