"""tests/vm: the host side boots the VM (test_kernel_vm.py); guest/ runs inside it only.

The kernel tests need a kernel with CONFIG_KPROBES, which the development machines do not run.
They are not skipped on the host: the host-side test boots a stock Debian kernel under qemu
(``harness.py``) and runs ``guest/`` there, failing with the guest's output if any of them
fails. ``/init`` of the guest sets KPROBES_IN_VM=1; without it, guest/ is not collected.
"""

from __future__ import annotations

import os

import pytest

from . import early

IN_VM = os.environ.get("KPROBES_IN_VM") == "1"

collect_ignore = [] if IN_VM else ["guest"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vm: boots a stock kernel under qemu and runs tests/vm/guest inside it"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """The kernel tests' VM boots now, beside the rest of the suite, if they are to run."""
    if not IN_VM and any(item.nodeid.endswith(early.NODE) for item in session.items):
        early.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not IN_VM:
        early.stop()
