"""User stacks on the command line (issue 23, items 1-4): ``trace --stack`` and ``stackcount``
on our own backend, on code built at -O2 without frame pointers.

The program ``stacks`` (tests/programs/stacks.c) calls ``leaf`` by three known paths a known
number of times (main → a → leaf 3, main → b → leaf 5, main → stk_through → leaf 2, the last
through libstk.so); rbp is an ordinary register there, so only the unwind tables can walk its
frames. The references are the program's own counts and objdump (the return address after each
call), and GDB's ``bt`` at the same hits. ``stacks-nocfi`` is the same program without unwind
tables for its own functions: the walk must stop there and say so. A real program, zstd, must
be unwound from libc's malloc through zstd up to its main, libc's start and ``_start`` (a
worker thread's up to libc's ``clone3``).

The flame graph is opened in a real browser (Chromium, headless): the frames' names must be
in the document it renders, its script must have run (it lays the frames out, zooms and
searches when the address asks), and the screenshot must not be blank.

Every command runs through the command line's ``main()`` in this process (the round trip
through a ``kprobes`` process is the other CLI tests'). The kernel's uprobes backend
(``--backend uprobes``) is tested in test_stacks_uprobes.py.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import support
from support import run_main as kprobes

pytestmark = pytest.mark.ptrace

Build = Callable[[str], Path]
COUNTS = {"a": 3, "b": 5, "stk_through": 2}


@pytest.fixture
def program(build: Build) -> Path:
    return build("stacks")


@functools.cache
def return_offsets(path: Path, caller: str, callee: str | None) -> frozenset[int]:
    """Offsets in ``caller`` of the instructions after its calls to ``callee`` (objdump);
    None: its calls through a register (a function pointer)."""
    target = r"\*%\w+" if callee is None else rf"[0-9a-f]+ <{re.escape(callee)}(@plt)?>"
    call = re.compile(rf"^call\s+{target}$")
    insns = support.function_insns(path, caller)
    return frozenset(a for (_, text), (a, _) in itertools.pairwise(insns) if call.match(text))


def size_of(path: Path, name: str) -> int:
    return support.symbol(path, name).size


def test_folded_stacks_count_each_path_exactly(program: Path) -> None:
    out, err = kprobes("stackcount", "--folded", "-c", program, "leaf")
    assert "kprobes:" not in err, err  # counted in the program: no tier note
    lines = out.splitlines()
    assert len(lines) == 3, out
    # Most frequent first; every stack reaches _start (no marker: the walk was complete).
    outer = "_start;__libc_start_main;[libc.so.6];main"
    assert lines == [f"{outer};{f};leaf {COUNTS[f]}" for f in ("b", "a", "stk_through")]


def test_trace_prints_each_event_s_stack_as_the_kernel_does(program: Path) -> None:
    out, _ = kprobes("trace", "-U", "-c", program, "leaf", "r leaf")
    lib = program.parent / "libstk.so"
    context = re.compile(r"^\s+stacks-(\d+)\s+\[\d{3}\]\s+\d+\.\d{6}: ")
    blocks = [b for b in re.split(r"\n(?=\s+stacks-\d+ )", out) if context.match(b)]
    events = [b for b in blocks if "<user stack trace>" not in b.splitlines()[0]]
    stacks = [b.splitlines() for b in blocks if b.splitlines()[0].endswith("<user stack trace>")]
    assert len(events) == len(stacks) == 20  # 10 entries, 10 returns, each with its stack
    paths: dict[str, int] = {}
    for lines in stacks:
        frames = [line.removeprefix(" => ") for line in lines[1:] if line.startswith(" => ")]
        assert frames == [line[4:] for line in lines[1:]], lines  # nothing but frames follows
        if frames[0].startswith("leaf+"):  # an entry: leaf, exactly at its start
            assert frames[0] == f"leaf+0x0/{size_of(program, 'leaf'):#x}"
            frames = frames[1:]
        caller = frames[0].split("+")[0]  # a return: the stack is the caller's, from the
        paths[caller] = paths.get(caller, 0) + 1  # address the call returns to
        where = lib if caller == "stk_through" else program
        offset = int(frames[0].split("+")[1].split("/")[0], 16)
        callee = None if caller == "stk_through" else "leaf"  # stk_through calls f(x)
        assert offset in return_offsets(where, caller, callee), frames
        suffix = " [libstk.so]" if caller == "stk_through" else ""
        assert frames[0] == f"{caller}+{offset:#x}/{size_of(where, caller):#x}{suffix}"
        main = re.fullmatch(r"main\+0x([0-9a-f]+)/(0x[0-9a-f]+)", frames[1])
        assert main is not None, frames
        assert int(main[1], 16) in return_offsets(program, "main", caller)
        assert all(f.endswith("[libc.so.6]") for f in frames[2:-1]), frames
        assert re.fullmatch(r"_start\+0x[0-9a-f]+/0x[0-9a-f]+", frames[-1]), frames
    assert paths == {name: 2 * n for name, n in COUNTS.items()}


def test_json_and_perfetto_carry_the_stack_cut_at_the_depth(program: Path, tmp_path) -> None:
    trace = tmp_path / "trace.json"
    out, _ = kprobes(
        "trace", "--stack", "--stack-depth", "3", "--json", "--perfetto", trace, "-c", program,
        "leaf",
    )  # fmt: skip
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(records) == 10
    for record in records:
        stack = record["stack"]
        assert [f["func"] for f in stack][::2] == ["leaf", "main"], stack
        assert stack[1]["func"] in COUNTS and record["stack_stop"] == "depth limit"
        assert stack[0] == {
            "ip": record["ip"],
            "func": "leaf",
            "offset": 0,
            "size": size_of(program, "leaf"),
            "module": None,
            "text": record["location"],
        }
        assert stack[1]["module"] == ("libstk.so" if stack[1]["func"] == "stk_through" else None)
    instants = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "i"]
    assert [e["args"]["stack"] for e in instants] == [
        [f["text"] for f in r["stack"]] + ["[depth limit]"] for r in records
    ]


def test_a_frame_without_unwind_info_ends_the_walk_and_says_so(build: Build) -> None:
    out, _ = kprobes("stackcount", "--folded", "-c", build("stacks-nocfi"), "leaf")
    assert out == "[no unwind info];leaf 10\n"
    out, _ = kprobes("trace", "-U", "-n", "1", "-c", build("stacks-nocfi"), "leaf")
    assert out.splitlines()[-2:] == [" => leaf+0x0/0x18", " => [no unwind info]"]


def _start_call(zstd: str) -> tuple[int, int]:
    """Link-time addresses in zstd of main (what _start hands to __libc_start_main in rdi:
    zstd is stripped) and of the instruction after _start's call (the outermost return
    address), from objdump."""
    header = subprocess.run(["readelf", "-h", zstd], capture_output=True, text=True).stdout
    found = re.search(r"Entry point address:\s+(0x[0-9a-f]+)", header)
    assert found is not None, header
    entry = int(found[1], 16)
    insns = support.disassemble(zstd, entry, entry + 0x30)
    lea = [re.search(r"# ([0-9a-f]+)", t) for _, t in insns if t.endswith(">") and "%rdi" in t]
    assert lea and lea[0] is not None, insns
    after = next(b for (_, t), (b, _) in itertools.pairwise(insns) if t.startswith("call"))
    return int(lea[0][1], 16), after


def test_stacks_of_a_real_program_reach_its_main(tmp_path) -> None:
    zstd = shutil.which("zstd")
    assert zstd is not None, "scripts/ensure-system-deps installs zstd"
    data = tmp_path / "data"
    data.write_bytes(b"".join(b"%d kprobes stacks\n" % i for i in range(20000)))
    command = f"{zstd} -q -f -o {tmp_path / 'data.zst'} {data}"
    out, _ = kprobes("stackcount", "-c", command, "libc:malloc")
    stacks = [s.split("\n") for s in out.strip().split("\n\n")]
    main, after = _start_call(zstd)
    assert sum(int(s[-1]) for s in stacks) >= 10
    mains = 0
    for stack in stacks:
        frames = [line.strip() for line in stack[:-1]]
        assert frames[0].startswith("malloc+0x0/") and frames[0].endswith("[libc.so.6]")
        assert not any(f.startswith("[") for f in frames), frames  # every walk was complete
        if frames[-1].endswith("[libc.so.6]"):
            continue  # a worker thread's: from libc's clone3 and start_thread
        # The main thread's, outermost first: zstd's _start (stripped: an address), libc's
        # start, then zstd's main.
        assert frames[-2].startswith("__libc_start_main+"), frames
        assert frames[-3].endswith("[libc.so.6]") and "[" not in frames[-4], frames
        bias = int(frames[-1], 16) - after
        assert 0 < int(frames[-4], 16) - bias - main < 0x8000, frames  # inside main
        mains += 1
    assert mains >= len(stacks) // 2, stacks


def _png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the rows of an 8-bit RGB or RGBA PNG, unfiltered."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(png):
        (length,), kind = struct.unpack(">I", png[pos : pos + 4]), png[pos + 4 : pos + 8]
        body = png[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    bpp = 3 if color == 2 else 4
    raw, rows, prev = zlib.decompress(idat), [], bytes(width * bpp)
    for y in range(height):
        line = raw[y * (width * bpp + 1) : (y + 1) * (width * bpp + 1)]
        kind, row = line[0], bytearray(line[1:])
        for i in range(len(row)):
            left = row[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                row[i] = (row[i] + left) & 0xFF
            elif kind == 2:
                row[i] = (row[i] + up) & 0xFF
            elif kind == 3:
                row[i] = (row[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                row[i] = (row[i] + pred) & 0xFF
        prev = bytes(row)
        rows.append(prev)
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, len(r), bpp)]


def test_the_flame_graph_opens_in_a_browser(program: Path, tmp_path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium: scripts/ensure-system-deps installs it")
    svg = tmp_path / "leaf.svg"
    kprobes("stackcount", "-c", program, "--svg", svg, "leaf")
    text = svg.read_text()
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")  # nothing to fetch
    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu"]
    png, uri, size = tmp_path / "leaf.png", svg.as_uri(), ["--window-size=1200,300"]
    # Both at once (Chromium takes seconds to start), each with a profile of its own: the
    # picture, and the document its script made, zoomed on b and searched for leaf.
    shot = subprocess.Popen(
        [*browser, f"--user-data-dir={tmp_path / 'p1'}", f"--screenshot={png}", *size, uri],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    view = uri + "?zoom=b&s=%5Eleaf%24"
    dumped = subprocess.run(
        [*browser, f"--user-data-dir={tmp_path / 'p2'}", "--dump-dom", view],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.wait(timeout=120) == 0
    dom = dumped.stdout
    for name in ("main", "a", "b", "stk_through", "leaf", "__libc_start_main"):
        assert f'data-n="{name}"' in dom and f"<title>{name} (" in dom, name
    for hits, share in ((3, 30), (5, 50), (2, 20)):  # leaf under a, b, stk_through
        assert f"<title>leaf ({hits} hits, {share}.00%)</title>" in dom
    assert "Matched: 100.0%" in dom  # the search found leaf in every stack
    # Laid out again by the script: zoomed on b, b spans the whole width, a is hidden.
    b = re.search(r'data-d="5" style="[^"]*"><title>b \(.*?<rect x="10" [^>]*width="1180"', dom)
    assert b is not None, dom
    assert re.search(r"<title>a \(3 hits[^<]*</title>", dom)
    a_style = re.search(r'style="([^"]*)"><title>a \(', dom)
    assert a_style is not None and "display: none" in a_style[1]
    width, height, pixels = _png_pixels(png.read_bytes())
    assert (width, height) == (1200, 300)
    colours = set(pixels)
    assert len(colours) > 10  # not blank: frames of many colours, text
    assert any(r > 200 and g < 150 and bl < 80 for r, g, bl in colours)  # a warm frame


GDB_BT = r"""
import gdb
gdb.execute("set pagination off")
gdb.execute("set confirm off")
gdb.execute("starti")  # relocated: leaf's address is its run-time one, kept as a number
gdb.execute(f"break *{int(gdb.parse_and_eval('(long) &leaf')):#x}")
gdb.execute("continue")
while True:
    try:
        frame = gdb.newest_frame()
    except gdb.error:
        break  # the program has exited
    names = []
    while frame is not None:
        where = gdb.execute(f"info symbol {frame.pc():#x}", to_string=True)
        names.append(where.split(" in section")[0].strip())
        if frame.name() == "main":
            break
        frame = frame.older()
    print("BT " + "|".join(names), flush=True)
    try:
        gdb.execute("continue")
    except gdb.error:
        break
"""


def _our_frames(out: str) -> list[list[str]]:
    """Each event's stack in ``trace -U``'s text, from the hit to ``main``, as GDB's ``info
    symbol`` names an address: ``func + OFF`` (``func`` alone at its start)."""
    stacks = []
    for block in re.split(r"\n(?=\s+stacks-\d+ )", out):
        lines = block.splitlines()
        if not lines or not lines[0].endswith("<user stack trace>"):
            continue
        names = []
        for line in lines[1:]:
            m = re.fullmatch(r" => (\w+)\+0x([0-9a-f]+)/0x[0-9a-f]+(?: \[.*\])?", line)
            assert m is not None, line
            offset = int(m[2], 16)
            names.append(m[1] if offset == 0 else f"{m[1]} + {offset}")
            if m[1] == "main":
                break
        stacks.append(names)
    return stacks


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb (apt install gdb)")
@pytest.mark.parametrize("tier", [["--no-optimize"], []], ids=["traps", "jumps"])
def test_stacks_are_gdb_s_backtraces(program: Path, tier: list[str], tmp_path: Path) -> None:
    """The same ten hits of ``leaf`` under GDB (a breakpoint at its first instruction,
    ``bt`` at each) and under ``trace -U``, on the trap tier and the optimized one: frame for
    frame from the hit to ``main``, the same functions at the same return addresses."""
    script = tmp_path / "bt.py"
    script.write_text(GDB_BT)
    gdb = subprocess.run(
        ["gdb", "-nx", "-batch", "-x", str(script), str(program)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    theirs = [line[3:].split("|") for line in gdb.stdout.splitlines() if line.startswith("BT ")]
    assert len(theirs) == sum(COUNTS.values()), gdb.stdout + gdb.stderr
    out, err = kprobes("trace", *tier, "-U", "-c", program, "leaf")
    assert tier or "uses a breakpoint" not in err, err  # the jumps' walk, in the program
    assert _our_frames(out) == theirs, err
