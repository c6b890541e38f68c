"""The kernel tests' VM, started as soon as the session knows it will run them.

Booting the stock kernel under software emulation and running tests/vm/guest in it takes
about three minutes of one CPU, most of it the emulation. Run last, it added them to the
suite's wall time, while the rest of the suite keeps about one of the two CPUs busy (its user
and system time are about 1.1 times its wall time). So once collection is over, if the VM
test is among the tests to run, its VM is started in a thread (``start``) and runs beside the
rest; the test itself (test_kernel_vm.py) takes its result (``result``), or boots it then if
nothing started it. A session that ends first (``-x``, Ctrl-C) powers it off (``stop``).
"""

from __future__ import annotations

import threading

from .harness import REPO, RUNNING, VmError, VmResult, run

GUEST_TESTS = "tests/vm/guest"
# Seconds for the whole boot + test run (software emulation), only to catch a hang: a full
# `make test` beside other work on a 2-CPU host once took more than 240.
BUDGET = 900
# One virtual CPU. With two, a full `make test` once saw the guest kernel lock up (soft lockup
# in a `kprobes` command, RCU stalls on the other vCPU) under software emulation; one vCPU
# has no cross-CPU waits to starve, and runs the guest tests as fast.
CPUS = 1
NODE = "vm/test_kernel_vm.py::test_kernel_tests_pass_in_a_vm"

_lock = threading.Lock()
_thread: threading.Thread | None = None
_outcome: list[VmResult | VmError] = []


def _argv() -> list[str]:
    argv = [str(REPO / ".venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return [*argv, "--durations=5", "-rfE", GUEST_TESTS]


def _boot() -> None:
    try:
        _outcome.append(run(_argv(), timeout=BUDGET, cpus=CPUS))
    except VmError as exc:
        _outcome.append(exc)


def start() -> None:
    """Boot the VM and run the guest tests in a thread of this process (once)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_boot, name="kernel-vm", daemon=True)
            _thread.start()


def result() -> VmResult:
    """The guest's run: the one ``start`` began (waited for), or one run now. Raises VmError
    when the VM could not run the tests."""
    start()
    assert _thread is not None
    _thread.join(BUDGET + 60)
    if not _outcome:
        raise VmError(f"the VM thread gave no result in {BUDGET + 60} s")
    outcome = _outcome[0]
    if isinstance(outcome, VmError):
        raise outcome
    return outcome


def stop() -> None:
    """Power off a VM still running (the session ends before its test took the result)."""
    for vm in list(RUNNING):
        vm.kill()
