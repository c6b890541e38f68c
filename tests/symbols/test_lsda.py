"""Landing pads read from the LSDA of C++ functions (symbols/lsda.py), against the code g++
wrote: in ``catcher`` the pad is the instruction right after the ``ret`` of the path without
an exception, the only place that starts with the exception object in rax; a function
without a handler has no LSDA."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kprobes.arch.x86_64.jumpopt import Refusal, find_region
from kprobes.symbols.cfi import find_fde, find_lsda
from kprobes.symbols.elf import ElfImage
from kprobes.symbols.lsda import LsdaError, landing_pads, parse_landing_pads

SOURCE = r"""
#include <stdexcept>
#include <cstdio>
__attribute__((noinline)) void thrower(int i) { if (i % 3 == 0) throw std::runtime_error("x"); }
__attribute__((noinline)) int catcher(int i) {
  int r = 0;
  try { thrower(i); r = 1; } catch (const std::exception &e) { r = 2; }
  return r;
}
__attribute__((noinline)) int plain(int i) { return i + 1; }
int main() {
  int s = 0;
  for (int i = 0; i < 10; i++) s += catcher(i) + plain(i);
  printf("%d\n", s);
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lsda")
    (d / "lp.cpp").write_text(SOURCE)
    subprocess.run(["g++", "-O1", "-g", "-o", d / "lp", d / "lp.cpp"], check=True)
    return d / "lp"


def instructions(path: Path, name: str) -> list[tuple[int, str]]:
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--disassemble={name}", path],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = []
    for line in out.splitlines():
        addr, sep, text = line.strip().partition(":\t")
        if sep:
            rows.append((int(addr, 16), text.split()[0]))
    return rows


def test_the_pad_of_a_catch(program: Path) -> None:
    image = ElfImage.open(str(program))
    sym = image.lookup("_Z7catcheri")
    assert sym is not None
    fde = find_fde(str(program), sym.value)
    assert fde is not None and fde.lsda is not None
    code = instructions(program, "_Z7catcheri")
    after_ret = next(code[i + 1][0] for i, (_, op) in enumerate(code) if op.startswith("ret"))
    assert landing_pads(str(program), fde.lsda, fde.start) == (after_ret,)


def test_no_lsda_without_a_handler(program: Path) -> None:
    sym = ElfImage.open(str(program)).lookup("_Z5plaini")
    assert sym is not None
    fde = find_fde(str(program), sym.value)
    assert fde is not None and fde.lsda is None


def test_a_region_over_a_pad_is_refused(program: Path) -> None:
    image = ElfImage.open(str(program))
    sym = image.lookup("_Z7catcheri")
    assert sym is not None
    fde = find_fde(str(program), sym.value)
    assert fde is not None and fde.lsda is not None
    (pad,) = landing_pads(str(program), fde.lsda, fde.start)
    data = program.read_bytes()
    off = image.vaddr_to_offset(sym.value)
    assert off is not None
    body = data[off : off + sym.size]
    code = instructions(program, "_Z7catcheri")
    # The boundaries whose 5-byte region would contain the pad (strictly inside).
    before = [a for a, _ in code if a < pad < a + 5]
    assert before, code
    boundaries = {a for a, _ in code}
    for addr in (a for a in before if a in boundaries):
        refusal = find_region(body, sym.value, addr, sym.size, entries=[pad])
        assert isinstance(refusal, Refusal), addr
        assert f"{pad:#x} inside the region is entered from elsewhere" in refusal.reason
        without = find_region(body, sym.value, addr, sym.size)
        assert not isinstance(without, Refusal) or without.reason != refusal.reason


def test_an_fdes_lsda_read_from_its_header_is_the_full_decoders(program: Path) -> None:
    """``find_lsda`` reads the FDE's header alone (ehframe.py); pyelftools' decode of the whole
    FDE (``find_fde``) is the reference, over every function of C++ programs and libraries
    (with exception tables) and of libc (a few, for thread cancellation)."""
    files = [
        program,
        *(Path("/usr/lib/x86_64-linux-gnu") / n for n in ("libstdc++.so.6", "libc.so.6")),
    ]
    with_lsda = 0
    for path in (str(f) for f in files if f.exists()):
        for start in sorted({s.value for s in ElfImage.open(path).iter_functions()}):
            fde = find_fde(path, start)
            expected = (fde.start, fde.lsda) if fde is not None and fde.lsda is not None else None
            assert find_lsda(path, start) == expected, (path, hex(start))
            with_lsda += expected is not None
    assert with_lsda > 0


def test_bytes_in_pads_out() -> None:
    # lpstart omitted, ttype pcrel sdata4 at uleb 0x11, uleb128 call sites, 8 bytes of table:
    # (start 4, len 5, pad 0x13, action 1), (start 0x1c, len 5, pad 0, action 0)
    lsda = bytes.fromhex("ff9b110108040513011c050000")
    assert parse_landing_pads(lsda, 0x1000) == (0x1013,)
    with pytest.raises(LsdaError):
        parse_landing_pads(bytes.fromhex("ff9b1101"), 0x1000)
    with pytest.raises(LsdaError):
        parse_landing_pads(bytes.fromhex("ffff0c0400000000"), 0x1000)  # sleb call sites
