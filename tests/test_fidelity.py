"""Fidelity: a probe on every instruction boundary changes nothing but the hit counts.

The program (tests/programs/fidelity.c, -O2) runs hand() — rip-relative loads and stores, calls,
conditional jumps, a loop, pushf/popf and a switch compiled to a jump table —, libc's qsort()
driving the cmp_ints() callback, and a hashing loop. Every instruction boundary of those
functions (from objdump, as offsets from the symbol) and of libc's qsort and qsort_r gets a
probe. The program's output must be byte-identical to an unprobed run, and every probe's hit
count must equal what the kernel's own uprobes count at the same places, in the same program
with the same input (the kernel is the reference tool; places it refuses are left out of the
comparison only).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes

pytestmark = [pytest.mark.ptrace, pytest.mark.tracefs]

ARGS = ["200", "64", "1000"]
STDIN = b"go\n"
EXE_FUNCTIONS = ("hand", "leaf", "cmp_ints", "hash_buf")
LIBC_FUNCTIONS = ("qsort", "qsort_r")


@dataclass(frozen=True, slots=True)
class Site:
    path: Path  # the ELF file
    function: str
    offset: int  # from the function's symbol
    vaddr: int  # link-time address
    text: str  # objdump's rendering of the instruction
    spec: str  # the Kprobe symbol: "hand" or "libc:qsort_r"


def sites_of(path: Path, functions: tuple[str, ...], *, libc: bool) -> list[Site]:
    sites = []
    for name in functions:
        sym = support.symbol(path, name, dynamic=libc)
        for off, text in support.function_insns(path, name, dynamic=libc):
            spec = f"libc:{name}" if libc else name
            sites.append(Site(path, name, off, sym.value + off, text, spec))
    return sites


@pytest.fixture(scope="module")
def exe(build: Any) -> Path:
    path: Path = build("fidelity")
    return path


@pytest.fixture(scope="module")
def sites(exe: Path) -> list[Site]:
    libc = support.libc_path(exe)
    return sites_of(exe, EXE_FUNCTIONS, libc=False) + sites_of(libc, LIBC_FUNCTIONS, libc=True)


@pytest.fixture(scope="module")
def unprobed(exe: Path) -> bytes:
    out = support.reference_output([exe, *ARGS], stdin=STDIN)
    assert b" tf=0 flags=200\n" in out
    return out


def test_program_has_what_the_test_is_about(exe: Path, sites: list[Site]) -> None:
    hand = [s.text for s in sites if s.function == "hand"]
    assert any(t.startswith("pushf") for t in hand)
    assert any(t.startswith("popf") for t in hand)
    assert any("(%rip)" in t for t in hand)  # rip-relative
    assert any(t.startswith(("call", "callq")) for t in hand)
    assert any(t.startswith(("je", "jne", "jle", "ja", "jg", "jb", "js")) for t in hand)
    # The jump table's indirect jump.
    assert any("jmp" in t and "*%" in t for t in hand), hand
    # The loop: a jump back to an earlier address of hand().
    hand_sites = [s for s in sites if s.function == "hand"]
    assert any(
        (t := s.text.split()) and t[0].startswith("j") and len(t) > 1
        and t[1].isalnum() and int(t[1], 16) < s.vaddr
        for s in hand_sites
    )  # fmt: skip
    assert len([s for s in sites if s.function == "qsort_r"]) > 100


@dataclass
class ProbedRun:
    stdout: bytes
    exit_code: int | None
    nhit: list[int]
    nmissed: list[int]
    pre_calls: list[int]
    post_calls: list[int]
    bad_ip: list[tuple[int, int]]


def probed_run(exe: Path, sites: list[Site], tmp: Path, *, with_post: bool) -> ProbedRun:
    stdin_file = tmp / "stdin"
    stdin_file.write_bytes(STDIN)
    out = tmp / "stdout"
    pre_calls = [0] * len(sites)
    post_calls = [0] * len(sites)
    bad_ip: list[tuple[int, int]] = []
    where: list[int | None] = [None] * len(sites)

    def make(i: int) -> kprobes.Kprobe:
        def pre(p: Any, regs: Any) -> None:
            if not pre_calls[i]:  # placed where the file's own address says (libraries: late)
                where[i] = support.runtime_address_of(proc.pid, sites[i].path, sites[i].vaddr)
            pre_calls[i] += 1
            if regs.ip != p.addr:
                bad_ip.append((i, regs.ip))

        def post(p: Any, regs: Any, flags: int) -> None:
            post_calls[i] += 1

        return kprobes.Kprobe(
            symbol=sites[i].spec,
            offset=sites[i].offset,
            pre_handler=pre,
            post_handler=post if with_post else None,
        )

    kps = [make(i) for i in range(len(sites))]
    with open(stdin_file, "rb") as fin, open(out, "wb") as fout:
        proc = kprobes.spawn([str(exe), *ARGS], stdin=fin, stdout=fout)
    try:
        proc.register_kprobes(kps)
        assert proc.run(timeout=60), "the probed program did not finish within 60 s"
        for i, kp in enumerate(kps):
            assert where[i] in (None, kp.addr), sites[i]
    finally:
        support.cleanup_proc(proc)
    return ProbedRun(
        out.read_bytes(),
        proc.exit_code,
        [kp.nhit for kp in kps],
        [kp.nmissed for kp in kps],
        pre_calls,
        post_calls,
        bad_ip,
    )


@pytest.fixture(scope="module", params=["pre", "pre+post"])
def probed(request: Any, exe: Path, sites: list[Site], tmp_path_factory: Any) -> ProbedRun:
    """One run with every probe; "pre+post" adds post handlers (no boosting: stepped copies)."""
    tmp = tmp_path_factory.mktemp(f"fidelity-{request.param.replace('+', '-')}")
    return probed_run(exe, sites, tmp, with_post=request.param == "pre+post")


@pytest.fixture(scope="module")
def kernel(exe: Path, sites: list[Site], tmp_path_factory: Any) -> support.UprobeRun:
    if support.tracefs_root() is None:
        pytest.skip("tracefs with uprobe_events is not available (needs root)")
    return kernel_counts(exe, sites, tmp_path_factory.mktemp("fidelity-kernel"))


def kernel_counts(
    exe: Path,
    sites: list[Site],
    private: Path,
    args: Sequence[str] = ARGS,
    stdin: bytes = STDIN,
) -> support.UprobeRun:
    """The kernel's uprobes on the same places (``None``: refused, or a pushf), in a run of
    ``exe`` with ``args`` (a program that says "ready" on stderr, then reads ``stdin``).

    They run on private copies of the program and of libc (loaded through LD_LIBRARY_PATH),
    made in the directory ``private``: a uprobe patches every process that maps its file, and
    these copies are mapped by the reference run alone, not by the rest of the system nor by
    a concurrent probed run.

    Not on pushf: the kernel's uprobes single-step it with TF set and the copy pushes TF, so
    the popf after it traps and the program dies of SIGTRAP (seen on 6.x); a pushf's count is
    checked against the instruction after it instead."""
    libc = support.libc_path(exe)
    copies = {exe: private / exe.name, libc: private / "libc.so.6"}
    for original, copy in copies.items():
        shutil.copy2(original, copy)
    kept = [s for s in sites if not s.text.startswith("pushf")]
    run = support.kernel_uprobe_counts(
        [copies[exe], *args],
        [(copies[s.path], s.vaddr) for s in kept],
        stdin=stdin,
        env=dict(os.environ, LD_LIBRARY_PATH=str(private)),
    )
    counts: dict[Site, int | None] = {s: None for s in sites}
    counts.update(zip(kept, run.counts, strict=True))
    assert run.returncode == 0
    return support.UprobeRun([counts[s] for s in sites], run.stdout, run.returncode)


def test_output_is_identical(probed: ProbedRun, unprobed: bytes) -> None:
    assert probed.exit_code == 0
    assert probed.stdout == unprobed


def test_handlers_saw_the_probe_address(probed: ProbedRun) -> None:
    assert probed.bad_ip == []
    assert probed.pre_calls == probed.nhit
    if any(probed.post_calls):
        assert probed.post_calls == probed.nhit
    assert probed.nmissed == [0] * len(probed.nmissed)


def test_every_hit_counted_like_the_kernel(
    probed: ProbedRun, kernel: support.UprobeRun, sites: list[Site], unprobed: bytes
) -> None:
    assert kernel.stdout == unprobed
    compared = [i for i, c in enumerate(kernel.counts) if c is not None]
    # The comparison must cover nearly everything and real work, or it proves nothing.
    assert len(compared) >= 0.9 * len(sites)
    assert sum(kernel.counts[i] or 0 for i in compared) > 10_000
    mismatches = [
        (sites[i].spec, hex(sites[i].offset), sites[i].text, probed.nhit[i], kernel.counts[i])
        for i in compared
        if probed.nhit[i] != kernel.counts[i]
    ]
    assert mismatches == []


def test_pushf_counted_like_its_successor(
    probed: ProbedRun, kernel: support.UprobeRun, sites: list[Site]
) -> None:
    pushfs = [i for i, s in enumerate(sites) if s.text.startswith("pushf")]
    assert pushfs
    for i in pushfs:
        assert sites[i + 1].text.startswith("pop")  # the inline asm: pushf; pop; push; popf
        assert kernel.counts[i + 1] is not None and kernel.counts[i + 1] > 0
        assert probed.nhit[i] == probed.nhit[i + 1] == kernel.counts[i + 1]
