"""``Event`` and ``EventArg``: named tuples since the kernel targets' decoder makes them by the
hundred thousand a second, they must still behave as the values users wrote code against."""

from __future__ import annotations

import copy
import pickle

import pytest

from kprobes.model import Event, EventArg


def sample(**changes: object) -> Event:
    fields: dict[str, object] = {
        "group": "kprobes",
        "event": "open",
        "pid": 10,
        "tid": 11,
        "comm": "cat",
        "cpu": 1,
        "timestamp": 12.5,
        "ip": 0x1000,
        "location": "do_sys_openat2+0x0/0x170",
        "args": (EventArg("dfd", "s32", -100), EventArg("name", "string", "/etc/hosts")),
    }
    fields.update(changes)
    return Event(**fields)  # type: ignore[arg-type]


def test_fields_defaults_and_queries() -> None:
    ev = sample()
    assert (ev.pid, ev.tid, ev.comm, ev.cpu, ev.timestamp) == (10, 11, "cat", 1, 12.5)
    assert (ev.is_return, ev.func, ev.func_ip, ev.entry_timestamp) == (False, "", 0, 0.0)
    assert ev.name == "kprobes/open"
    assert ev.arg("name") == "/etc/hosts" and ev.arg("dfd") == -100
    with pytest.raises(KeyError):
        ev.arg("missing")
    arg = ev.args[1]
    assert (arg.name, arg.type, arg.value) == ("name", "string", "/etc/hosts")
    # Positional construction, as the Process target's hot path does it.
    assert Event("kprobes", "open", 10, 11, "cat", 1, 12.5, 0x1000, sample().location,
                 sample().args) == ev  # fmt: skip


def test_immutable() -> None:
    ev = sample()
    with pytest.raises(AttributeError):
        ev.pid = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ev.args[0].value = 3  # type: ignore[misc]
    assert ev._replace(pid=3).pid == 3 and ev.pid == 10


def test_equality_and_hashing_are_by_value() -> None:
    assert sample() == sample() and hash(sample()) == hash(sample())
    assert sample() != sample(pid=11) and sample() != sample(args=())
    assert EventArg("a", "u8", 1) == EventArg("a", "u8", 1) != EventArg("a", "u8", 2)
    assert len({sample(), sample(), sample(cpu=0)}) == 2
    assert sample(args=(EventArg("buf", "u8[2]", (1, None)),)) in {
        sample(args=(EventArg("buf", "u8[2]", (1, None)),))
    }


def test_match_by_keyword_and_by_position() -> None:
    match sample():
        case Event(event="open", args=(EventArg("dfd", _, fd), *_)):
            assert fd == -100
        case _:
            pytest.fail("no match")
    match sample(is_return=True, func="f"):
        case Event(_, "open", pid, tid, is_return=True, func=func):
            assert (pid, tid, func) == (10, 11, "f")
        case _:
            pytest.fail("no match")


def test_repr_names_every_field() -> None:
    text = repr(sample())
    assert text.startswith("Event(group='kprobes', event='open', pid=10, tid=11, comm='cat'")
    assert "EventArg(name='dfd', type='s32', value=-100)" in text
    assert text.endswith(
        "is_return=False, func='', func_ip=0, entry_timestamp=0.0, regs=None, stack=None, "
        "data=None)"
    )


def test_copies_and_pickles() -> None:
    ev = sample()
    assert pickle.loads(pickle.dumps(ev)) == ev
    assert type(pickle.loads(pickle.dumps(ev))) is Event
    assert copy.deepcopy(ev) == ev
