"""Aliases: the names of one function (one address of one file), and which one names it.

A library gives one function several names: weak and versioned aliases, the internal ``__``
names (libc's ``open``, ``open64``, ``__open``, ``__open64``; ``strtol``, ``strtoll``,
``strtoq``, ``strtoimax``); the kernel has its own (``sys_ni_syscall`` and company). A probe
goes on an address, so a glob that matches several names of one address is one function:
one probe, one row of ``count``, as bcc's funccount does (it skips an address it has
placed a probe on). Each target groups the names it matched here, with the addresses it
knows (runtime addresses for a process, the file's for a file, kallsyms' for the kernel).

The row is named by the name a programmer calls: the first without a leading underscore,
then the shortest, then in alphabetical order (``open``, ``strtol``). Rejected: funccount's
first name in symbol-table order, which the link decides (``__open64`` could name the row
of ``open``, and another build of the library another name).
"""

from __future__ import annotations

from collections.abc import Iterable


def alias_order(name: str) -> tuple[bool, int, str]:
    """The sort key of one function's names: the one that names the row sorts first."""
    return (name.startswith("_"), len(name), name)


def group_aliases(functions: Iterable[tuple[str, int]]) -> list[tuple[str, ...]]:
    """``(name, address)`` pairs as one tuple of names per address, the row's name first,
    in the order each address first came. A name is taken once (its first address), and an
    address of 0 is unknown (kallsyms hides addresses from unprivileged users): its names
    stay apart."""
    by_addr: dict[int, list[str]] = {}
    order: list[int | str] = []
    seen: set[str] = set()
    for name, addr in functions:
        if name in seen:
            continue
        seen.add(name)
        if not addr:
            order.append(name)  # a group of its own
        elif addr in by_addr:
            by_addr[addr].append(name)
        else:
            by_addr[addr] = [name]
            order.append(addr)
    return [
        (key,) if isinstance(key, str) else tuple(sorted(by_addr[key], key=alias_order))
        for key in order
    ]
