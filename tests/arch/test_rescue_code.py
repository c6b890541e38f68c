"""The rescue's machine code and layout (kprobes/arch/x86_64/rescue.c, rescue.py).

The bytes in rescue_code.py are generated from rescue.c by scripts/build-rescue; these tests
rebuild them and compare (an edit of rescue.c without a rebuild fails here), check that the
Python layout matches the C structure's (offsetof, compiled), and run the handler in a small C
harness for each rule, bytes in, behaviour out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kprobes.arch.x86_64 import rescue, rescue_code

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
    assert rescue.stub_trap(0x1000) == 0x1000 + rescue_code.STUB + 2


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
    assert rescue.H_NEW_ACTION + rescue.SIGACTION_SIZE <= rescue.BP_TABLE - rescue.HEADER


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
