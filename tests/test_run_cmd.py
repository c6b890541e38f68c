"""``kprobes run MODULE.py``: instrumentation modules with init(target) and exit(target).

The samples that mirror the kernel's samples/kprobes run on the bundled demo program with
exact expected output; a module attached with -p to a running program is ended by Ctrl-C,
runs its exit(), and leaves the program running untouched.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import support

pytestmark = pytest.mark.ptrace

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"
KPROBES = Path(sys.executable).parent / "kprobes"


def kprobes_cli(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KPROBES), *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def demo() -> Path:
    exe = SAMPLES / "bin" / "demo"
    exe.parent.mkdir(exist_ok=True)
    subprocess.run(["gcc", "-O1", "-o", exe, SAMPLES / "demo.c"], check=True)
    return exe


def test_kretprobe_sample_prints_return_values_and_durations(demo):
    result = kprobes_cli("run", SAMPLES / "kretprobe_example.py", "-c", f"{demo} 3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # -c: the probe waits at the exec for the loader to map libc.
    assert lines[0] == "Planted return probe at libc:write: pending", lines
    body = lines[1:-2]
    assert body[0::2] == [f"demo: line {i} of 3" for i in (1, 2, 3)]
    for line in body[1::2]:
        assert re.fullmatch(r"libc:write returned 18 and took \d+ ns to execute", line), line
    assert re.fullmatch(r"kretprobe at 0x[0-9a-f]+ unregistered", lines[-2]), lines
    assert lines[-2:] == [
        lines[-2],
        "Missed probing 0 instances of libc:write",
    ]


def test_jprobe_sample_prints_the_arguments_of_every_call(demo):
    result = kprobes_cli("run", SAMPLES / "jprobe_example.py", "-c", f"{demo} 3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    planted = re.fullmatch(r"Planted jprobe at (0x[0-9a-f]+), handler addr 0x[0-9a-f]+", lines[0])
    assert planted, lines
    fractions = ("0.333333", "0.666667", "1.000000")
    assert lines[1:] == [
        *(
            line
            for i in (1, 2, 3)
            for line in (
                f"jprobe: fd = 1, text = 'demo: line {i} of 3\\n', number = {i}, "
                f"fraction = {fractions[i - 1]}",
                f"demo: line {i} of 3",
            )
        ),
        f"jprobe at {planted.group(1)} unregistered",
    ]


def test_module_parameters_are_set_before_init(demo):
    result = kprobes_cli(
        "run", SAMPLES / "kretprobe_example.py", "func=libc:snprintf", "-c", f"{demo} 2"
    )
    assert result.returncode == 0, result.stderr
    returned = [line for line in result.stdout.splitlines() if " returned " in line]
    assert [line.split(" and took")[0] for line in returned] == ["libc:snprintf returned 18"] * 2


def test_unknown_parameter_and_missing_init_are_usage_errors(demo, tmp_path):
    result = kprobes_cli("run", SAMPLES / "kretprobe_example.py", "nope=1", "-c", str(demo))
    assert result.returncode == 2
    assert "no parameter 'nope'" in result.stderr
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    result = kprobes_cli("run", empty, "-c", str(demo))
    assert result.returncode == 2
    assert "no init(target)" in result.stderr


def test_attached_module_ends_on_ctrl_c_runs_exit_and_leaves_the_program(build, popen, tmp_path):
    ticker = build("ticker")
    prog = popen([ticker, 100000, 2000], stdout=subprocess.DEVNULL)
    module = tmp_path / "count_work.py"
    module.write_text(
        textwrap.dedent(
            """
            import kprobes
            seen = []

            def pre(p, regs):
                if not seen:
                    seen.append(True)
                    print("hit", flush=True)

            kp = kprobes.Kprobe(symbol="work", pre_handler=pre)

            def init(target):
                target.register_kprobe(kp)
                print("init", flush=True)

            def exit(target):
                n = kp.nhit
                target.unregister_kprobe(kp)
                print(f"exit hits>0={n > 0}", flush=True)
            """
        )
    )
    cli = popen(
        [KPROBES, "run", module, "-p", prog.pid], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert cli.stdout is not None and cli.stderr is not None
    assert support.read_line(cli.stdout.fileno(), 20) == b"init\n"
    assert support.read_line(cli.stdout.fileno(), 60) == b"hit\n"  # work() runs every 2 ms
    os.kill(cli.pid, signal.SIGINT)
    out, err = cli.communicate(timeout=20)
    assert cli.returncode == 0, err
    assert out == b"exit hits>0=True\n"
    assert support.is_alive(prog.pid)
    work = support.runtime_address(prog.pid, ticker, "work")
    assert support.raw_read(prog.pid, work, 1) == support.file_bytes(
        ticker, support.symbol(ticker, "work").value, 1
    )
