"""The names of one function (symbols/aliases.py): grouped by address, the row's name first,
for the process targets (ELF symbols) and the kernel (kallsyms)."""

from __future__ import annotations

from kprobes.symbols.aliases import function_key, group_aliases
from kprobes.symbols.kallsyms import Kallsyms


def test_names_of_one_address_are_one_function_named_by_the_plainest() -> None:
    found = [
        ("__open64", 0x10),
        ("close", 0x20),
        ("open64", 0x10),
        ("open", 0x10),
        ("__open", 0x10),
        ("strtoq", 0x30),
        ("strtol", 0x30),
    ]
    assert group_aliases(found) == [
        ("open", "open64", "__open", "__open64"),  # no underscore, the shortest, a to z
        ("close",),
        ("strtol", "strtoq"),
    ]


def test_a_name_is_taken_once_and_an_unknown_address_groups_nothing() -> None:
    # Two static functions of one name (the kernel has many): the first address only.
    assert group_aliases([("init", 0x10), ("init", 0x20), ("setup", 0x20)]) == [
        ("init",),
        ("setup",),
    ]
    # kptr_restrict: every address reads 0, and no two names are one function.
    assert group_aliases([("a", 0), ("b", 0)]) == [("a",), ("b",)]


def test_an_ifunc_is_not_one_function_with_its_resolver() -> None:
    # plug_fast's symbol holds its resolver's address; it names what the resolver picks.
    found = [
        ("plug_resolve", function_key(0x110E)),
        ("plug_fast", function_key(0x110E, is_ifunc=True)),
        ("__plug_fast", function_key(0x110E, is_ifunc=True)),
    ]
    assert group_aliases(found) == [("plug_resolve",), ("plug_fast", "__plug_fast")]


def test_kernel_functions_of_one_address_from_kallsyms() -> None:
    kallsyms = Kallsyms(
        b"ffffffff81001000 T __x64_sys_ni_syscall\n"
        b"ffffffff81001000 T sys_ni_syscall\n"
        b"ffffffff81002000 t vfs_read\n"
        b"ffffffff81003000 d sys_data\n"
        b"ffffffffc0001000 t sys_mod\t[mymod]\n"
    )
    found = kallsyms.iter_function_addrs("*sys_*")
    assert group_aliases(found) == [("sys_ni_syscall", "__x64_sys_ni_syscall"), ("sys_mod",)]
    assert kallsyms.iter_function_addrs("sys_*", "mymod") == [("sys_mod", 0xFFFFFFFFC0001000)]
