"""The kernel tests' VM, started as soon as the session knows it will run them.

Booting the stock kernel under software emulation and running tests/vm/guest in it takes
about three minutes of one CPU, most of it the emulation. Run last, it added them to the
suite's wall time, while the rest of the suite keeps about one of the two CPUs busy (its user
and system time are about 1.1 times its wall time). So once collection is over, if the VM
test is among the tests to run, ``start`` launches the harness (``harness.py --result``) in a
session of its own, and the test (test_kernel_vm.py) takes its result from the file it
writes (``result``), or boots it then if nothing started it. A session that ends first
(``-x``, Ctrl-C) powers it off (``stop``).

The harness is started through ``setsid --fork``, so that it is not a child of the test
session: the tests trace programs in this process, and the tracer waits for any child
(``waitid(P_ALL)``): it would reap the harness's exit. Rejected: a thread of this process
running qemu, which also made qemu one of those children (and one such start failed with
EFAULT in its exec while a test traced).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import REPO, VmError, VmResult

GUEST_TESTS = "tests/vm/guest"
# Seconds for the whole boot + test run (software emulation), only to catch a hang: a full
# `make test` beside other work on a 2-CPU host once took more than 240.
BUDGET = 900
# One virtual CPU. With two, a full `make test` once saw the guest kernel lock up (soft lockup
# in a `kprobes` command, RCU stalls on the other vCPU) under software emulation; one vCPU
# has no cross-CPU waits to starve, and runs the guest tests as fast.
CPUS = 1
NODE = "vm/test_kernel_vm.py::test_kernel_tests_pass_in_a_vm"
_SLACK = 60  # seconds beyond BUDGET for the harness to start and to power the VM off

_run_dir: Path | None = None


def start() -> None:
    """Launch the harness (once), detached; it writes ``result.json`` in a fresh directory."""
    global _run_dir
    if _run_dir is not None:
        return
    _run_dir = Path(tempfile.mkdtemp(prefix="kprobes-vm-early-"))
    python = str(REPO / ".venv/bin/python")
    guest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", "-rfE"]
    harness = [sys.executable, str(REPO / "tests/vm/harness.py"), "--timeout", str(BUDGET)]
    harness += ["--cpus", str(CPUS), "--result", str(_run_dir / "result.json")]
    # `sh -c 'echo $$ > pid; exec ...'`: the pid of the harness, the leader of its session.
    script = 'echo $$ > "$1"; shift; exec "$@"'
    argv = ["setsid", "--fork", "sh", "-c", script, "sh", str(_run_dir / "pid"), *harness]
    argv += ["--", *guest, GUEST_TESTS]
    with open(_run_dir / "log", "wb") as log:
        subprocess.run(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True)


def result() -> VmResult:
    """The guest's run, from the harness ``start`` launched (waited for). Raises VmError
    when the VM could not run the tests, or gave no result in time."""
    start()
    assert _run_dir is not None
    path = _run_dir / "result.json"
    deadline = time.monotonic() + BUDGET + _SLACK
    while not path.exists():
        if time.monotonic() > deadline:
            stop()
            log = (_run_dir / "log").read_text(errors="replace")
            raise VmError(f"no result from the VM in {BUDGET + _SLACK} s; harness log:\n{log}")
        time.sleep(0.5)
    found = json.loads(path.read_text())
    shutil.rmtree(_run_dir, ignore_errors=True)
    if "error" in found:
        raise VmError(found["error"])
    return VmResult(**found)


def stop() -> None:
    """Power off a VM still running (the session ends before its test took the result)."""
    if _run_dir is None or not _run_dir.exists() or (_run_dir / "result.json").exists():
        return
    try:
        pid = int((_run_dir / "pid").read_text())
        os.killpg(pid, signal.SIGKILL)  # the harness and its qemu
    except (OSError, ValueError):
        pass
    shutil.rmtree(_run_dir, ignore_errors=True)
