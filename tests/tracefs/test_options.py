"""An option the kernel's tracefs probes cannot honour is refused, naming the target and the
option, and nothing is registered (issue 19).

The Uprobes cases run on this machine's kernel, with tracefs checked before and after; the
Kernel target's are the same rule (``tracefs/options.py``) with the Kernel's reasons, checked
here as sentences and for real in the VM (tests/vm/guest/test_kernel.py).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest

from kprobes.core.probes import Kprobe
from kprobes.core.retprobes import Jprobe, Kretprobe
from kprobes.errors import ProbeRejected, UnsupportedOption
from kprobes.tracefs import Uprobes
from kprobes.tracefs.options import check_options
from tracefs.conftest import TRACEFS, Waiting

pytestmark = pytest.mark.tracefs


def _nothing(*_: Any) -> None:
    return None


# (register method, probe, option named, the message's start)
REFUSED: dict[str, tuple[str, Callable[[], Any], str, str]] = {
    "optimize": (
        "register_kprobe",
        lambda: Kprobe(symbol="work", optimize=True),
        "optimize",
        "Uprobes cannot honour optimize=True on a Kprobe: the kernel's uprobes place their own "
        "breakpoint (use Process for jump-optimized probes)",
    ),
    "entry_handler": (
        "register_kretprobe",
        lambda: Kretprobe(symbol="work", handler=_nothing, entry_handler=_nothing),
        "entry_handler",
        "Uprobes cannot honour entry_handler on a Kretprobe: an entry_handler runs at each "
        "call's entry",
    ),
    "maxactive": (
        "register_kretprobe",
        lambda: Kretprobe(symbol="work", maxactive=8),
        "maxactive",
        "Uprobes cannot honour maxactive=8 on a Kretprobe: the kernel's uretprobes keep no "
        "instance pool",
    ),
    "jprobe": (
        "register_jprobe",
        lambda: Jprobe(symbol="work", entry=_nothing),
        "entry",
        "Uprobes cannot honour entry on a Jprobe: a jprobe's entry is called in the probed "
        "thread with the function's arguments",
    ),
}


def _ours(u: Uprobes) -> list[str]:
    """What of the session's group is in tracefs: its uprobe_events lines, its events."""
    lines = (TRACEFS / "uprobe_events").read_text().splitlines()
    left = [line for line in lines if f":{u.group}/" in line]
    if (TRACEFS / "events" / u.group).exists():
        left.append(f"events/{u.group}")
    return left


@pytest.mark.parametrize("case", REFUSED)
def test_uprobes_refuses_what_it_cannot_honour(start: Callable[..., Waiting], case: str) -> None:
    method, make, option, message = REFUSED[case]
    prog = start(3)
    with Uprobes(pid=prog.pid) as u:
        before = (TRACEFS / "uprobe_events").read_text()
        probe = make()
        with pytest.raises(UnsupportedOption) as info:
            getattr(u, method)(probe)
        exc = info.value
        assert str(exc).startswith(message), str(exc)
        assert isinstance(exc, ProbeRejected) and exc.errno == errno.EINVAL
        assert (exc.target, exc.option) == ("Uprobes", option)
        assert not probe.is_registered and u.iter_probes() == []
        assert (TRACEFS / "uprobe_events").read_text() == before and _ours(u) == []
        # The session is unharmed: a probe it can honour still counts every call.
        kp = Kprobe(symbol="work")
        u.register_kprobe(kp)
        prog.go()
        assert u.run(timeout=10)
        assert kp.nhit == 3


def test_a_refused_member_leaves_its_batch_unregistered(start: Callable[..., Waiting]) -> None:
    prog = start(1)
    with Uprobes(pid=prog.pid) as u:
        good, bad = Kprobe(symbol="work"), Kprobe(symbol="work", optimize=True)
        with pytest.raises(UnsupportedOption, match="optimize=True"):
            u.register_kprobes([good, bad])
        assert not good.is_registered and u.iter_probes() == [] and _ours(u) == []
        rets = [Kretprobe(symbol="work"), Kretprobe(symbol="work", maxactive=2)]
        with pytest.raises(UnsupportedOption, match="maxactive=2"):
            u.register_kretprobes(rets)
        assert not rets[0].is_registered and _ours(u) == []
        with pytest.raises(UnsupportedOption, match="on a Jprobe"):
            u.register_jprobes([Jprobe(symbol="work", entry=_nothing)])
        assert _ours(u) == []
        prog.go()


def test_a_definition_line_with_maxactive_is_refused_on_uprobes(
    start: Callable[..., Waiting],
) -> None:
    """``rN`` in a line: the kernel's own parser says "Maxactive is not for uprobe" of a
    PATH:OFFSET; a symbol's was dropped without a word."""
    prog = start(1)
    with Uprobes(pid=prog.pid) as u:
        with pytest.raises(UnsupportedOption, match=r"^Uprobes cannot honour maxactive=4 on a"):
            u.add("r4 work")
        assert u.iter_probes() == [] and _ours(u) == []
        prog.go()


@pytest.mark.parametrize(
    ("probe", "start_of_message"),
    [
        (
            Kprobe(symbol="vfs_read", optimize=True),
            "Kernel cannot honour optimize=True on a Kprobe: the kernel jump-optimizes its "
            "kprobes by itself where it can",
        ),
        (
            Kretprobe(symbol="vfs_read", entry_handler=_nothing),
            "Kernel cannot honour entry_handler on a Kretprobe",
        ),
        (Jprobe(symbol="vfs_read", entry=_nothing), "Kernel cannot honour entry on a Jprobe"),
        (
            Kprobe(symbol="vfs_read", async_handler=_nothing, with_regs=True),
            "Kernel cannot honour with_regs=True on a Kprobe: the kernel's events hold the "
            "fetch-args alone",
        ),
    ],
)
def test_the_kernels_reasons(probe: Any, start_of_message: str) -> None:
    with pytest.raises(UnsupportedOption) as info:
        check_options("Kernel", probe, is_kernel=True)
    assert str(info.value).startswith(start_of_message), str(info.value)
    assert info.value.errno == errno.EINVAL and info.value.target == "Kernel"


def test_what_the_kernel_honours_passes() -> None:
    """The kernel's kretprobes have a pool (``r8:``); plain probes and handlers are events;
    fetch-args on the probe and an async_handler are every target's."""
    for probe in (
        Kprobe(symbol="vfs_read", async_handler=_nothing, args=("a=%di", "b=%si")),
        Kretprobe(symbol="vfs_read", maxactive=8, data_size=8, handler=_nothing),
        Kprobe(symbol="vfs_read", pre_handler=_nothing, post_handler=_nothing, disabled=True),
    ):
        check_options("Kernel", probe, is_kernel=True)
    check_options("Uprobes", Kretprobe(symbol="work", handler=_nothing), is_kernel=False)
