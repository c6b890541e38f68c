"""The rescue's machine code and layout (kprobes/arch/x86_64/rescue.c, rescue.py).

The bytes in rescue_code.py are generated from rescue.c by scripts/build-rescue; these tests
rebuild them and compare (an edit of rescue.c without a rebuild fails here), check that the
Python layout matches the C structure's (offsetof, compiled), and run the handler in a small C
harness for each rule, bytes in, behaviour out.
"""

from __future__ import annotations

import re
import signal
import struct
import subprocess
from pathlib import Path

import pytest

from kprobes.arch.x86_64 import rescue, rescue_code, sigframe
from kprobes.arch.x86_64.abi import FETCH_FAULT_MAGIC

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "kprobes" / "arch" / "x86_64" / "rescue.c"


def test_generated_bytes_match_the_source(tmp_path):
    out = tmp_path / "rescue_code.py"
    subprocess.run(
        ["sh", REPO / "scripts" / "build-rescue", out],
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert out.read_text() == (REPO / "kprobes/arch/x86_64/rescue_code.py").read_text(), (
        "rescue.c changed: run scripts/build-rescue"
    )


def test_code_fits_before_the_header():
    assert len(rescue_code.CODE) <= rescue.HEADER
    assert rescue_code.CODE[rescue_code.STUB : rescue_code.STUB + 4] == b"\x0f\x05\xcc\xcc"
    # glibc's __restore_rt, byte for byte: libgcc's unwinder and gdb know it for a signal
    # frame, and unwind through it into the code that was interrupted
    restorer = rescue_code.CODE[rescue_code.RESTORER : rescue_code.RESTORER + 9]
    assert restorer == bytes.fromhex("48c7c00f0000000f05")
    assert rescue.stub_trap(0x1000) == 0x1000 + rescue_code.STUB + 2
    # a self-restoring injection's syscall, then its ret into the frame's restorer
    way = rescue_code.CODE[rescue_code.SYSCALL_RET : rescue_code.SYSCALL_RET + 3]
    assert way == b"\x0f\x05\xc3"
    assert rescue.syscall_ret(0x1000) == 0x1000 + rescue_code.SYSCALL_RET
    # its restarter: restart_syscall, the result into the frame's rax, rt_sigreturn
    restarter = rescue_code.CODE[rescue_code.RESTARTER : rescue_code.RESTARTER + 24]
    assert restarter == bytes.fromhex("b8db000000 0f05 48898424") + sigframe.UC_RAX.to_bytes(
        4, "little"
    ) + bytes.fromhex("48c7c00f000000 0f05")
    assert rescue.restarter(0x1000) == 0x1000 + rescue_code.RESTARTER


FIELDS = {
    "tramp": rescue.H_TRAMP,
    "inject_trap": rescue.H_INJECT_TRAP,
    "nbp": rescue.H_NBP,
    "bps": rescue.H_BPS,
    "nredirect": rescue.H_NREDIRECT,
    "redirects": rescue.H_REDIRECTS,
    "nrange": rescue.H_NRANGE,
    "ranges": rescue.H_RANGES,
    "npage": rescue.H_NPAGE,
    "pages": rescue.H_PAGES,
    "old": rescue.H_OLD,
    "saved": rescue.H_SAVED,
    "old_fault": rescue.H_OLD_FAULT,
}


def test_header_layout_matches_the_c_structure(tmp_path):
    text = SOURCE.read_text()
    start = text.index("typedef unsigned long u64;")
    end = text.index("};", text.index("struct header {")) + 2
    prints = "".join(
        f'printf("{name} %zu\\n", offsetof(struct header, {name}));' for name in FIELDS
    )
    program = (
        "#include <stdio.h>\n#include <stddef.h>\n"
        + text[start:end]
        + f'\nint main(void) {{ {prints} printf("size %zu\\n", sizeof(struct header)); }}\n'
    )
    src = tmp_path / "layout.c"
    src.write_text(program)
    subprocess.run(["gcc", "-o", tmp_path / "layout", src], check=True, timeout=60)
    out = subprocess.run([tmp_path / "layout"], capture_output=True, text=True, check=True)
    got = dict(line.split() for line in out.stdout.splitlines())
    for name, offset in FIELDS.items():
        assert int(got[name]) == offset, name
    assert int(got["size"]) == rescue.H_SIZE
    assert rescue.H_SIZE <= rescue.H_NEW_ACTION
    assert rescue.H_NEW_ACTION + rescue.SIGACTION_SIZE <= rescue.H_NEW_FAULT
    assert rescue.H_NEW_FAULT + 2 * rescue.SIGACTION_SIZE <= rescue.BP_TABLE - rescue.HEADER


def test_the_magic_is_the_abis():
    m = re.search(r"#define FETCH_FAULT_MAGIC (0x[0-9a-f]+)UL", SOURCE.read_text())
    assert m is not None
    assert int(m.group(1), 16) == FETCH_FAULT_MAGIC


def test_fault_action_takes_the_programs_mask_and_stack():
    """The rescue's SIGSEGV/SIGBUS action, bytes in, bytes out: the program's mask,
    SA_NODEFER, SA_ONSTACK and SA_RESTART when it has a handler (SA_RESETHAND is the
    rescue's to do), nothing of SIG_DFL's or SIG_IGN's."""
    area = 0x7F0000000000
    ours = area + rescue_code.FAULT_HANDLER, rescue.restorer(area)
    sa_resethand = 0x80000000
    kept = rescue.SA_ONSTACK | rescue.SA_NODEFER | rescue.SA_RESTART
    flags = rescue.SA_SIGINFO | kept | sa_resethand
    own = struct.pack("<QQQQ", 0x401000, flags | rescue.SA_RESTORER, 0x402000, 0b1010)
    handler, got, restorer, mask = struct.unpack("<QQQQ", rescue.fault_sigaction(area, own))
    assert (handler, restorer) == ours and mask == 0b1010
    assert got == rescue.SA_SIGINFO | rescue.SA_RESTORER | kept
    for disposition in (0, 1):  # SIG_DFL, SIG_IGN
        own = struct.pack("<QQQQ", disposition, flags, 0, 0b1010)
        handler, got, restorer, mask = struct.unpack("<QQQQ", rescue.fault_sigaction(area, own))
        assert (handler, restorer) == ours and mask == 0
        assert got == rescue.SA_SIGINFO | rescue.SA_RESTORER


def test_header_and_tables_pack():
    area = 0x7F0000000000
    head = rescue.header(area)
    assert len(head) == rescue.H_NEW_ACTION + rescue.SIGACTION_SIZE
    assert int.from_bytes(head[rescue.H_BPS : rescue.H_BPS + 8], "little") == area + rescue.BP_TABLE
    assert head[rescue.H_NEW_ACTION :] == rescue.sigaction(area)
    handler, flags, restorer, mask = (
        int.from_bytes(rescue.sigaction(area)[i : i + 8], "little") for i in range(0, 32, 8)
    )
    assert handler == area + rescue_code.HANDLER and restorer == area + rescue_code.RESTORER
    assert flags == rescue.SA_SIGINFO | rescue.SA_RESTORER and mask == 0
    assert rescue.record(1, 2, 3) == bytes.fromhex(
        "01" + "00" * 7 + "02" + "00" * 7 + "03" + "00" * 7
    )
    assert re.fullmatch(r"[0-9a-f]+", rescue_code.CODE.hex())
    assert rescue.RECORD_MAX > 100_000


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """tests/programs/rescue_harness.c: the rescue in a process, driven rule by rule."""
    out = tmp_path_factory.mktemp("rescue") / "harness"
    src = REPO / "tests" / "programs" / "rescue_harness.c"
    subprocess.run(["gcc", "-O1", "-o", out, src], check=True, timeout=60)
    blob = out.with_suffix(".bin")
    blob.write_bytes(rescue_code.CODE)
    return out, blob


@pytest.mark.parametrize(
    "case",
    [
        "breakpoint",
        "jump-int3-new",  # a tool killed between two writes of a jump: finished
        "jump-int3-old",  # or taken back
        "trampoline",
        "trampoline-next",
        "step-end",
        "step-next",
        "injection",
        "own-trap-default",
        "own-trap-handler",
    ],
)
def test_rescue_rule(harness, case):
    exe, blob = harness
    result = subprocess.run(
        [exe, blob, hex(rescue_code.HANDLER), hex(rescue_code.RESTORER), case],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if case == "own-trap-default":
        assert result.returncode == -5, result  # the program's own trap kills it, as before
        assert "ok" not in result.stdout
    else:
        assert result.returncode == 0, result
        assert result.stdout.strip().endswith("ok"), result


# Fault cases: the rescue as SIGSEGV and SIGBUS handler. A fetch of ours goes on at r10; any
# other fault or SIGSEGV goes to the program's own action, and those that killed the program
# before must still kill it, with the same signal.
FAULT_CASES = {
    "fetch": 0,  # NULL, a non-canonical address (SI_KERNEL) and past a file's end (SIGBUS)
    "fetch-outside": -signal.SIGSEGV,  # marked, but not in a page of ours
    "fetch-nomagic": -signal.SIGSEGV,  # in a page of ours, not marked
    "fetch-sent-handler": 0,  # a timer's SIGSEGV in a marked load: the program's handler
    "own-segv-default": -signal.SIGSEGV,
    "own-segv-ignored": -signal.SIGSEGV,  # a fault cannot be ignored
    "own-segv-handler": 0,  # SA_SIGINFO: si_code, si_addr and the context's rip checked
    "own-segv-plain": 0,
    "own-segv-resethand": 0,  # SA_RESETHAND: SIG_DFL once the handler runs
    "own-bus-default": -signal.SIGBUS,
    "own-bus-handler": 0,
    "sent-default": -signal.SIGSEGV,
    "sent-ignored": 0,
    "sent-handler": 0,  # SI_USER reaches the handler
}


@pytest.mark.parametrize("case", list(FAULT_CASES))
def test_rescue_fault_rule(harness, case):
    exe, blob = harness
    handler, restorer = hex(rescue_code.FAULT_HANDLER), hex(rescue_code.RESTORER)
    result = subprocess.run(
        [exe, blob, hex(rescue_code.HANDLER), restorer, case, handler],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == FAULT_CASES[case], result
    if FAULT_CASES[case] == 0:
        assert result.stdout.strip().endswith("ok"), result
    else:
        assert result.stdout == "", result
