"""Aliases: the names of one function (one address of one file), and which one names it.

A library gives one function several names: weak and versioned aliases, the internal ``__``
names (libc's ``open``, ``open64``, ``__open``, ``__open64``; ``strtol``, ``strtoll``,
``strtoq``, ``strtoimax``); the kernel has its own (``sys_ni_syscall`` and company). A probe
goes on an address, so a glob that matches several names of one address is one function:
one probe, one row of ``count``, as bcc's funccount does (it skips an address it has
placed a probe on). Each target groups the names it matched here, with the addresses it
knows (runtime addresses for a process, the file's for a file, kallsyms' for the kernel).
A GNU ifunc's symbol holds its resolver's address, but it names the function the resolver
picks (what the program calls, and what we probe): it is never one function with the
resolver, only with the other names of its ifunc (``function_key``).

The row is named by the name a programmer calls: the first without a leading underscore,
then the shortest, then in alphabetical order (``open``, ``strtol``). Rejected: funccount's
first name in symbol-table order, which the link decides (``__open64`` could name the row
of ``open``, and another build of the library another name).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def alias_order(name: str) -> tuple[bool, int, str]:
    """The sort key of one function's names: the one that names the row sorts first."""
    return (name.startswith("_"), len(name), name)


def function_key(addr: int, *, is_ifunc: bool = False) -> Hashable:
    """What two names must share to be one function: the address, and being an ifunc or not
    (0: unknown, nothing is one function with it)."""
    return ("ifunc", addr) if is_ifunc and addr else addr


def group_aliases(functions: Iterable[tuple[str, Hashable]]) -> list[tuple[str, ...]]:
    """``(name, function_key)`` pairs as one tuple of names per function, the row's name
    first, in the order each function first came. A name is taken once (its first
    address), and an address of 0 is unknown (kallsyms hides addresses from unprivileged
    users): its names stay apart."""
    by_key: dict[Hashable, list[str]] = {}
    order: list[Hashable] = []  # the functions' keys, and the names of unknown address
    seen: set[str] = set()
    for name, key in functions:
        if name in seen:
            continue
        seen.add(name)
        if not key:
            order.append(name)  # a function of its own
        elif key in by_key:
            by_key[key].append(name)
        else:
            by_key[key] = [name]
            order.append(key)
    return [
        tuple(sorted(by_key[key], key=alias_order)) if key in by_key else (str(key),)
        for key in order
    ]
