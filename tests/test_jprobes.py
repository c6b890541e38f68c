"""Jprobes (the document's §1.2, §4.2) on live processes: the probed function's arguments,
typed from DWARF, from the handler's annotations, or raw; and the mirroring principle.

tests/programs/jprobe.c calls mixed() with nine arguments that use every integer register,
two xmm registers and the stack, and by_value() with a struct in a register and one in memory.
The expected values are the ones main() passes, computed here the same way.
"""

from __future__ import annotations

import ctypes
import errno
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import support

import kprobes
from kprobes import Jprobe, Kretprobe, errors

pytestmark = pytest.mark.ptrace
N = 3


def expected_mixed(i: int) -> tuple[Any, ...]:
    return (i, f"name-{i}", i + 0.5, -i, i * 0.25, 200 + i, 7, 8, 9 + i)


def start(spawn: Callable[..., Any], tmp_path: Path, argv: list[Any]) -> tuple[Any, Path]:
    out = tmp_path / f"stdout.{len(list(tmp_path.iterdir()))}"
    with open(out, "wb") as f:
        proc = spawn(argv, stdout=f)
    return proc, out


def run_to_exit(proc: Any) -> None:
    assert proc.run(timeout=60)
    assert proc.exit_code == 0


def test_arguments_typed_from_dwarf(spawn, build, tmp_path):
    prog = build("jprobe")
    proc, out = start(spawn, tmp_path, [prog, N])
    calls: list[tuple[Any, ...]] = []
    structs: list[tuple[bytes, bytes]] = []
    jm = Jprobe(symbol="mixed", entry=lambda *args: calls.append(args))
    jb = Jprobe(symbol="by_value", entry=lambda p, q: structs.append((p, q)))
    proc.register_jprobes([jm, jb])
    assert [(e.kind, e.where) for e in proc.list()] == [("j", "mixed+0x0"), ("j", "by_value+0x0")]
    assert jm.plan.source == "dwarf"
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([prog, N])
    assert calls == [expected_mixed(i) for i in range(N)]
    assert structs == [
        (struct.pack("<ii", i, -i), struct.pack("<qqq", i, 2 * i, 3 * i)) for i in range(N)
    ]
    assert jm.nhit == N and jb.nhit == N


class Pt(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int)]


class Big(ctypes.Structure):
    _fields_ = [("a", ctypes.c_long), ("b", ctypes.c_long), ("c", ctypes.c_long)]


def test_arguments_typed_from_annotations_without_debug_info(spawn, build, tmp_path):
    prog = build("jprobe-nodebug")
    proc, out = start(spawn, tmp_path, [prog, N])
    calls: list[tuple[Any, ...]] = []
    structs: list[tuple[int, int, int, int, int]] = []

    def j_mixed(
        a: ctypes.c_int,
        s: str,
        d: float,
        b: int,
        f: ctypes.c_float,
        c: ctypes.c_ubyte,
        e: int,
        g: int,
        h: int,
    ) -> None:
        calls.append((a, s, d, b, f, c, e, g, h))

    def j_by_value(p: Pt, q: Big) -> None:
        structs.append((p.x, p.y, q.a, q.b, q.c))

    jm = Jprobe(symbol="mixed", entry=j_mixed)
    jb = Jprobe(symbol="by_value", entry=j_by_value)
    proc.register_jprobes([jm, jb])
    assert jm.plan.source == "annotations"
    run_to_exit(proc)
    assert out.read_bytes() == support.reference_output([prog, N])
    assert calls == [expected_mixed(i) for i in range(N)]
    assert structs == [(i, -i, i, 2 * i, 3 * i) for i in range(N)]


def test_raw_integers_without_types(spawn, build, tmp_path):
    prog = build("jprobe-nodebug")
    proc, _ = start(spawn, tmp_path, [prog, N])
    calls: list[tuple[int, int, int]] = []
    jm = Jprobe(symbol="mixed", entry=lambda a, s, third: calls.append((a, s, third)))
    proc.register_jprobe(jm)
    assert jm.plan.source == "raw"
    run_to_exit(proc)
    # Untyped, every argument is the next integer register: the third is rdx, which holds
    # b = -i (d went to xmm0); a keeps the int's upper bits as the caller left them.
    assert [(a & 0xFFFFFFFF, third) for a, _, third in calls] == [
        (i, (-i) & (2**64 - 1)) for i in range(N)
    ]
    assert all(s > 0x1000 for _, s, _ in calls)


def test_mirroring_undoes_what_the_handler_writes_to_the_stack(spawn, build, tmp_path):
    prog = build("jprobe")
    proc, out = start(spawn, tmp_path, [prog, N])
    rsp: list[int] = []
    seen: list[int] = []
    kp = kprobes.Kprobe(symbol="mixed", pre_handler=lambda p, regs: rsp.append(regs.rsp))

    def vandal(a: int, s: str, d: float, b: int, f: float, c: int, e: int, g: int, h: int) -> None:
        seen.append(h)
        proc.write(rsp[-1] + 8, (123456).to_bytes(8, "little"))  # h's stack slot

    proc.register_kprobe(kp)  # runs first: it records rsp for the vandal
    jp = Jprobe(symbol="mixed", entry=vandal)
    proc.register_jprobe(jp)
    run_to_exit(proc)
    assert seen == [9 + i for i in range(N)]
    assert out.read_bytes() == support.reference_output([prog, N])


def test_jprobe_and_kretprobe_on_one_function(spawn, build, tmp_path):
    prog = build("jprobe")
    proc, _ = start(spawn, tmp_path, [prog, N])
    order: list[str] = []
    jp = Jprobe(symbol="mixed", entry=lambda *a: order.append(f"j{a[0]}"))
    rp = Kretprobe(symbol="mixed", handler=lambda ri, regs: order.append("r"))
    proc.register_jprobe(jp)
    proc.register_kretprobe(rp)
    assert sorted(e.kind for e in proc.list()) == ["j", "r"]
    run_to_exit(proc)
    assert order == [x for i in range(N) for x in (f"j{i}", "r")]


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, nothing registered, nothing patched


def _untouched(proc: Any, prog: Path, name: str) -> bool:
    addr = support.runtime_address(proc.pid, prog, name)
    return support.raw_read(proc.pid, addr, 1) == support.file_bytes(
        prog, support.symbol(prog, name).value, 1
    )


def test_handler_that_cannot_take_the_arguments_is_refused(spawn, build, tmp_path):
    prog = build("jprobe")
    proc, _ = start(spawn, tmp_path, [prog, 1])
    jp = Jprobe(symbol="mixed", entry=lambda a, b: None)
    with pytest.raises(errors.ProbeRejected, match="cannot take the 9 arguments") as info:
        proc.register_jprobe(jp)
    assert info.value.errno == errno.EINVAL
    assert proc.list() == [] and not jp.is_registered and _untouched(proc, prog, "mixed")
    run_to_exit(proc)


def test_unknown_annotation_is_refused(spawn, build, tmp_path):
    prog = build("jprobe-nodebug")
    proc, _ = start(spawn, tmp_path, [prog, 1])

    def bad(a: list) -> None:  # type: ignore[type-arg]
        return None

    with pytest.raises(errors.ProbeRejected, match="cannot fetch an argument of type"):
        proc.register_jprobe(Jprobe(symbol="mixed", entry=bad))
    assert proc.list() == []
    run_to_exit(proc)


def test_two_jprobes_on_one_function_are_refused(spawn, build, tmp_path):
    prog = build("jprobe")
    proc, _ = start(spawn, tmp_path, [prog, 1])
    proc.register_jprobe(Jprobe(symbol="mixed", entry=lambda *a: None))
    second = Jprobe(symbol="mixed", entry=lambda *a: None)
    with pytest.raises(errors.ProbeRejected, match="already has a jprobe") as info:
        proc.register_jprobe(second)
    assert info.value.errno == errno.EEXIST
    assert len(proc.list()) == 1 and not second.is_registered
    run_to_exit(proc)


def test_jprobe_not_at_function_entry_is_refused(spawn, build, tmp_path):
    prog = build("jprobe")
    proc, _ = start(spawn, tmp_path, [prog, 1])
    second = support.boundaries(prog, "mixed")[1]
    with pytest.raises(errors.ProbeRejected, match="function entry"):
        proc.register_jprobe(Jprobe(symbol="mixed", offset=second, entry=lambda *a: None))
    assert proc.list() == [] and _untouched(proc, prog, "mixed")
    run_to_exit(proc)
