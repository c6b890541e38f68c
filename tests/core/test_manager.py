"""The generic half (core/) against a fake target: no process, no x86, only the hooks."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kprobes.core.manager import ProbeManager
from kprobes.core.probes import Kprobe
from kprobes.core.table import ProbeSite
from kprobes.errors import NotABoundary, NotMapped, ProbeRejected


@dataclass(frozen=True)
class Loc:
    addr: int
    display: str
    module_name: str = "fake"


class FakeTarget:
    """Symbols are a dict; odd addresses are not instruction boundaries."""

    def __init__(self) -> None:
        self.symbols = {"f": 0x1000, "g": 0x2000}
        self.unmapped: dict[str, int] = {"lib:h": 0x3000}  # mapped by map_library()
        self.log: list[tuple[str, int]] = []
        self.armed: set[int] = set()
        self.batches = 0

    def resolve(self, probe: Kprobe) -> Loc:
        if probe.addr is not None:
            return Loc(probe.addr + probe.offset, hex(probe.addr))
        assert probe.symbol is not None
        if probe.symbol in self.unmapped:
            raise NotMapped(f"no module lib is mapped ({probe.symbol})")
        if probe.symbol not in self.symbols:
            raise ProbeRejected(f"no {probe.symbol}", errno=errno.ENOENT)
        return Loc(self.symbols[probe.symbol] + probe.offset, f"{probe.symbol}+{probe.offset:#x}")

    def check(self, probe: Kprobe, location: Loc) -> None:
        if location.addr % 2:
            raise NotABoundary("odd")

    def prepare(self, site: ProbeSite) -> None:
        site.ainsn = ("step" if site.has_post_handler else "boost", site.addr)
        self.log.append(("prepare", site.addr))

    def remove(self, site: ProbeSite) -> None:
        self.log.append(("remove", site.addr))

    def arm(self, site: ProbeSite) -> None:
        assert site.addr not in self.armed
        self.armed.add(site.addr)

    def disarm(self, site: ProbeSite) -> None:
        self.armed.remove(site.addr)

    def drop(self, site: ProbeSite) -> None:
        self.armed.discard(site.addr)
        self.log.append(("drop", site.addr))

    def map_library(self) -> None:
        self.symbols.update(self.unmapped)
        self.unmapped = {}

    def unmap_library(self) -> None:
        self.unmapped = {"lib:h": 0x3000}
        del self.symbols["lib:h"]

    @contextmanager
    def batch(self) -> Iterator[None]:
        self.batches += 1
        yield


@pytest.fixture
def target() -> FakeTarget:
    return FakeTarget()


@pytest.fixture
def manager(target: FakeTarget) -> ProbeManager:
    return ProbeManager(target)


def test_register_arms_and_unregister_removes(manager: ProbeManager, target: FakeTarget) -> None:
    kp = Kprobe(symbol="f", offset=4)
    manager.register(kp)
    assert kp.addr == 0x1004 and kp.is_registered
    assert target.armed == {0x1004}
    manager.unregister(kp)
    assert target.armed == set() and not kp.is_registered
    assert ("remove", 0x1004) in target.log
    assert kp.addr is None  # a symbol probe forgets its address, and can be registered again
    manager.register(kp)
    assert target.armed == {0x1004}


def test_two_probes_share_one_site_and_a_post_handler_replans(
    manager: ProbeManager, target: FakeTarget
) -> None:
    a = Kprobe(symbol="f")
    b = Kprobe(symbol="f", post_handler=lambda p, r, f: None)
    manager.register(a)
    assert manager.table.get(0x1000).ainsn[0] == "boost"  # type: ignore[union-attr]
    manager.register(b)
    site = manager.table.get(0x1000)
    assert site is not None and site.probes == [a, b] and site.ainsn[0] == "step"
    manager.unregister(b)
    assert site.ainsn[0] == "boost" and target.armed == {0x1000}


def test_batch_rolls_back_on_failure(manager: ProbeManager, target: FakeTarget) -> None:
    good = [Kprobe(symbol="f"), Kprobe(symbol="g")]
    bad = Kprobe(symbol="f", offset=1)
    with pytest.raises(NotABoundary):
        manager.register_many([*good, bad])
    assert target.armed == set()
    assert not any(p.is_registered for p in [*good, bad])
    assert len(manager.table) == 0
    assert target.batches == 1  # one stop of the world for the whole batch


@pytest.mark.parametrize(
    "kwargs",
    [{"symbol": "f", "addr": 0x1000}, {}, {"symbol": "f", "offset": -1}],
)
def test_invalid_probes_are_einval(manager: ProbeManager, kwargs: dict[str, object]) -> None:
    kp = Kprobe(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ProbeRejected) as info:
        manager.register(kp)
    assert info.value.errno == errno.EINVAL and not kp.is_registered


def test_registering_twice_is_einval(manager: ProbeManager) -> None:
    kp = Kprobe(symbol="f")
    manager.register(kp)
    with pytest.raises(ProbeRejected) as info:
        manager.register(kp)
    assert info.value.errno == errno.EINVAL


def test_disable_enable_and_the_global_knob(manager: ProbeManager, target: FakeTarget) -> None:
    a, b = Kprobe(symbol="f"), Kprobe(symbol="g", disabled=True)
    manager.register_many([a, b])
    assert target.armed == {0x1000}  # registered disabled: not armed
    manager.set_enabled(False)
    assert target.armed == set()
    manager.enable(b)
    assert target.armed == set()  # the knob wins while off
    manager.set_enabled(True)
    assert target.armed == {0x1000, 0x2000}
    manager.disable(a)
    assert target.armed == {0x2000} and a.is_disabled


def test_aggregate_site_stays_armed_while_one_child_is_enabled(
    manager: ProbeManager, target: FakeTarget
) -> None:
    a, b = Kprobe(symbol="f"), Kprobe(symbol="f")
    manager.register_many([a, b])
    manager.disable(a)
    assert target.armed == {0x1000}
    manager.disable(b)
    assert target.armed == set()


def test_handler_exceptions_go_to_the_fault_handler_or_are_parked(
    manager: ProbeManager,
) -> None:
    seen: list[int] = []

    def boom(p: Kprobe, regs: object) -> None:
        raise ValueError("boom")

    handled = Kprobe(
        symbol="f", pre_handler=boom, fault_handler=lambda p, r, t: seen.append(t) or True
    )
    unhandled = Kprobe(symbol="g", pre_handler=boom)
    manager.register_many([handled, unhandled])
    manager.table.get(0x1000).run_pre(object())  # type: ignore[union-attr]
    assert seen == [-1] and manager.table.take_error() is None
    manager.table.get(0x2000).run_pre(object())  # type: ignore[union-attr]
    assert isinstance(manager.table.take_error(), ValueError)
    assert handled.nhit == 1 and unhandled.nhit == 1


# -- pending probes: a library mapped later, unmapped, mapped again ---------------------------


def test_a_probe_on_an_unmapped_library_fails_unless_pending_is_allowed(
    manager: ProbeManager,
) -> None:
    with pytest.raises(NotMapped) as info:
        manager.register(Kprobe(symbol="lib:h"))
    assert info.value.errno == errno.ENOENT
    assert manager.pending == []


def test_pending_probe_is_placed_when_its_library_maps_and_waits_again_when_it_goes(
    manager: ProbeManager, target: FakeTarget
) -> None:
    manager.allow_pending = True
    kp = Kprobe(symbol="lib:h", offset=4)
    manager.register(kp)
    assert kp.is_registered and kp.is_pending and not kp.is_gone
    assert kp.addr is None and target.armed == set()
    assert manager.resolve_pending() == []  # still not mapped
    target.map_library()
    assert manager.resolve_pending() == []
    assert not kp.is_pending and kp.addr == 0x3004 and target.armed == {0x3004}
    target.unmap_library()
    assert manager.unmap(lambda site: site.addr >= 0x3000) == [kp]
    assert kp.is_pending and kp.is_gone and kp.addr is None
    assert ("drop", 0x3004) in target.log and ("remove", 0x3004) in target.log
    assert target.armed == set()
    target.map_library()
    manager.resolve_pending()
    assert not kp.is_pending and not kp.is_gone and target.armed == {0x3004}
    manager.unregister(kp)
    assert not kp.is_registered and target.armed == set()


def test_pending_probe_can_be_disabled_and_unregistered(
    manager: ProbeManager, target: FakeTarget
) -> None:
    manager.allow_pending = True
    kp = Kprobe(symbol="lib:h")
    manager.register(kp)
    manager.disable(kp)
    target.map_library()
    manager.resolve_pending()
    assert kp.is_disabled and kp.addr == 0x3000 and target.armed == set()
    manager.enable(kp)
    assert target.armed == {0x3000}
    other = Kprobe(symbol="lib:h")
    target.unmap_library()
    manager.unmap(lambda site: True)
    manager.register(other)
    assert {p.is_pending for p in manager.iter_probes()} == {True}
    manager.unregister(kp)
    manager.unregister(other)
    assert manager.pending == [] and not kp.is_registered and not other.is_disabled


def test_a_probe_given_by_address_in_unmapped_code_is_gone_for_good(
    manager: ProbeManager, target: FakeTarget
) -> None:
    manager.allow_pending = True
    kp = Kprobe(addr=0x1000)
    manager.register(kp)
    manager.unmap(lambda site: True)
    assert kp.is_gone and kp.is_registered
    manager.resolve_pending()
    assert kp.is_gone and target.armed == set()
    manager.unregister(kp)
    assert kp.addr == 0x1000 and not kp.is_registered


def test_a_pending_probe_that_cannot_be_placed_says_why_and_keeps_waiting(
    manager: ProbeManager, target: FakeTarget
) -> None:
    manager.allow_pending = True
    kp = Kprobe(symbol="lib:h", offset=1)  # odd: not an instruction boundary
    manager.register(kp)
    target.map_library()
    ((probe, exc),) = manager.resolve_pending()
    assert probe is kp and isinstance(exc, NotABoundary)
    assert kp.is_pending and target.armed == set()
