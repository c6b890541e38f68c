"""The kernel tests, run in a VM: a stock Debian kernel (with CONFIG_KPROBES, CONFIG_OPTPROBES)
under qemu, on the host's own files (see harness.py). This test fails with the guest's output
when a guest test fails, and with the console when the VM itself fails."""

from __future__ import annotations

import re

import pytest

from . import early
from .harness import VmError


@pytest.mark.vm
@pytest.mark.deadline(early.BUDGET + 90)
def test_kernel_tests_pass_in_a_vm() -> None:
    """The VM was booted when collection ended (early.py): here its result is taken."""
    try:
        result = early.result()
    except VmError as exc:
        pytest.fail(f"the VM could not run the kernel tests: {exc}")
    report = f"guest output:\n{result.output}\n--- console (tail) ---\n{result.console[-3000:]}"
    assert result.returncode == 0, report
    summary = re.search(r"(\d+) passed", result.output)
    assert summary is not None and int(summary.group(1)) >= 9, report
    assert "skipped" not in result.output, report
