"""A record probe's events where its site keeps the int3: the same ``Event`` at the trap.

A probe with an ``async_handler`` is written as a record in the program where its site takes
a jump (reader.py reads the records); where the site keeps the trap tier's int3 (no jump
possible, ``--no-optimize``, a probe beside it that must run at a trap), its handler is
called at the trap with the event a record would have given, built from the live thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kprobes.model import ArgValue, EntryData, Event

if TYPE_CHECKING:
    from kprobes.core.probes import Kprobe
    from kprobes.core.retprobes import Kretprobe, KretprobeInstance, RetHandler
    from kprobes.process.fast.probe import FastProbe
    from kprobes.process.fetch.evaluate import CpuReader


def trap_delivery(fp: FastProbe, cpu: CpuReader) -> Callable[[Kprobe, Any], None]:
    """The trap tier's pre handler for an asynchronous handler: the same ``Event``, built
    from the live thread, handed over at once."""
    group, event, pid, memory, fetch = fp.group, fp.event, fp.pid, fp.memory, fp.fetcher.fetch
    comm, symbolize, with_regs = memory.comm, memory.symbolize, fp.with_regs
    trap_stack = fp.trap_stack

    def deliver(kp: Kprobe, regs: Any) -> None:
        handler = kp.async_handler
        assert handler is not None
        tid = regs.tid
        ip = regs.ip
        handler(
            kp,
            Event(
                group, event, pid, tid, comm(tid), cpu(tid), time.monotonic(), ip,
                symbolize(ip), fetch(regs, memory),
                regs=regs.frozen() if with_regs else None,
                stack=None if trap_stack is None else trap_stack(regs),
            ),
        )  # fmt: skip

    return deliver


def return_trap_delivery(
    rp: Kretprobe, fp: FastProbe, cpu: CpuReader, drain: Callable[[], None]
) -> tuple[RetHandler, RetHandler]:
    """The trap tier's entry handler and handler for a return probe's ``async_handler``:
    the event a record of its return would give (``(caller <- func)``, the entry time, the
    ``$argN`` taken at the entry), built from the live thread at the return, after the
    records written before it (``drain``)."""
    group, event, pid, memory, fetcher = fp.group, fp.event, fp.pid, fp.memory, fp.fetcher
    comm, symbolize, with_regs = memory.comm, memory.symbolize, fp.with_regs
    action = fp.entry
    entered: dict[int, tuple[float, tuple[ArgValue, ...], EntryData | None]] = {}

    def at_entry(ri: KretprobeInstance, regs: Any) -> None:
        args = fetcher.entry(regs, memory) if fetcher.has_entry_args else ()
        data = None if action is None else action.data(regs, memory)
        entered[id(ri)] = (time.monotonic(), args, data)

    def at_return(ri: KretprobeInstance, regs: Any) -> None:
        drain()
        handler = rp.async_handler
        start, args, data = entered.pop(id(ri), (0.0, (), None))
        if handler is None:
            return
        tid, ret, func_ip = regs.tid, ri.ret_addr, rp.addr or 0
        handler(
            rp,
            Event(
                group, event, pid, tid, comm(tid), cpu(tid), time.monotonic(), ret,
                symbolize(ret), fetcher.fetch(regs, memory, args), is_return=True,
                func=symbolize(func_ip).split("+")[0], func_ip=func_ip, entry_timestamp=start,
                regs=regs.frozen() if with_regs else None, data=data,
            ),
        )  # fmt: skip

    return at_entry, at_return
