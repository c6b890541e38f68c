"""Probe lines, the kernel's README grammar, error_log entries and the debugfs listings, as
text in and values out."""

from __future__ import annotations

import pytest

from kprobes.errors import ProbeRejected
from kprobes.model import BlacklistEntry, ProbeListing
from kprobes.spec import (
    AddressLocation,
    Command,
    FileOffsetLocation,
    Location,
    SymbolLocation,
    parse,
)
from kprobes.symbols.kallsyms import Kallsyms
from kprobes.tracefs.control import parse_error_log
from kprobes.tracefs.debugfs import parse_blacklist, parse_list
from kprobes.tracefs.lines import (
    Features,
    event_name_for,
    kernel_location,
    line_names,
    probe_line,
    profile_counts,
    uprobe_location,
)
from tracefs.captured import ERROR_LOG, README_OLD, README_TAIL


@pytest.mark.parametrize(
    ("command", "place", "args", "maxactive", "line"),
    [
        (Command.PROBE, SymbolLocation("vfs_read"), (), 0, "p:g/e vfs_read"),
        (
            Command.PROBE,
            SymbolLocation("vfs_read", 0x14),
            ("a=%di:u32", "$comm"),
            0,
            "p:g/e vfs_read+20 a=%di:u32 $comm",
        ),
        (
            Command.RETPROBE,
            SymbolLocation("vfs_read"),
            ("ret=$retval",),
            8,
            "r8:g/e vfs_read ret=$retval",
        ),
        (
            Command.RETPROBE,
            FileOffsetLocation("/bin/true", 0x2000),
            (),
            0,
            "r:g/e /bin/true:0x2000",
        ),
        (Command.PROBE, AddressLocation(0xFFFFFFFF81000000), (), 0, "p:g/e 0xffffffff81000000"),
    ],
)
def test_probe_line(
    command: Command, place: Location, args: tuple[str, ...], maxactive: int, line: str
) -> None:
    assert probe_line(command, "g", "e", place, args, maxactive=maxactive) == line
    assert parse(line).location == place  # the kernel's grammar, read back by ours


def test_places() -> None:
    assert kernel_location("vfs_read", 0, None) == SymbolLocation("vfs_read")
    assert kernel_location("ext4:ext4_file_open", 0x10, None) == SymbolLocation(
        "ext4_file_open", 0x10, "ext4"
    )
    assert kernel_location(None, 0, 0xFFFFFFFF81000000) == AddressLocation(0xFFFFFFFF81000000)
    assert uprobe_location("/usr/bin/prog", 0x1139) == FileOffsetLocation("/usr/bin/prog", 0x1139)
    with pytest.raises(ProbeRejected):
        uprobe_location("/tmp/a b", 0)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("r16:grp/ev vfs_read ret=$retval:s64 $comm", ("grp", "ev")),
        ("p:kprobes/p_vfs_read_0 vfs_read", ("kprobes", "p_vfs_read_0")),
        ("p:uprobes/p_x_0 /bin/true:0x0000000000001139 arg1=%di:u64", ("uprobes", "p_x_0")),
        ("p:g/e vfs_read future=$newsyntax:nosuchtype", ("g", "e")),  # a newer kernel's args
        ("garbage", None),
    ],
)
def test_line_names_read_only_the_names(text: str, names: tuple[str, str] | None) -> None:
    assert line_names(text) == names


def test_event_names_in_the_kernels_style() -> None:
    assert event_name_for("p", "vfs_read+0x0", set()) == "p_vfs_read_0x0"
    assert event_name_for("r", "work+0x0", {"r_work_0x0"}) == "r_work_0x0_2"
    assert event_name_for("p", "0x1234", set()) == "p_0x1234"


def test_readme_features_of_a_recent_kernel() -> None:
    features = Features.from_readme(README_TAIL)
    assert {"u8", "s64", "x32", "string", "ustring", "symstr", "%pd", "bitfield"} <= features.types
    assert features.has_arrays
    assert features.variables == {"$stack", "$retval", "$comm", "$arg"}
    assert features.check_arg("a=+0(%di):u32[4]", is_return=False, is_kernel=True) is None
    assert features.check_arg("b=%ax:b4@2/32", is_return=False, is_kernel=True) is None
    assert features.check_arg("$comm", is_return=True, is_kernel=True) is None
    assert "$retval" in str(features.check_arg("r=$retval", is_return=False, is_kernel=True))
    why = features.check_arg("x=%di:float", is_return=False, is_kernel=True)
    assert why is not None and "'float'" in why


def test_readme_features_of_an_old_kernel() -> None:
    features = Features.from_readme(README_OLD)
    assert not features.has_arrays
    assert "ustring" not in features.types
    assert "array" in str(features.check_arg("+0(%di):u8[4]", is_return=False, is_kernel=True))
    assert "ustring" in str(features.check_arg("+0(%di):ustring", is_return=False, is_kernel=True))
    assert "$arg" in str(features.check_arg("$arg1", is_return=False, is_kernel=True))


def test_error_log_entries_with_columns() -> None:
    first, second = parse_error_log(ERROR_LOG)
    assert (first.source, first.message) == ("trace_uprobe", "Unknown type is specified")
    assert first.command[first.column :] == "symbol"
    assert second.message == "String accepts only memory argument"
    assert second.command[second.column :] == "string"
    assert parse_error_log(str(second)) == [second]


LIST = """ffffffff812b9a20  k  vfs_read+0x0    [FTRACE]
ffffffff812b9a34  k  vfs_read+0x14    [OPTIMIZED]
ffffffff812b2f40  r  do_sys_openat2+0x0    [DISABLED][FTRACE]
ffffffffc0a01010  k  foo_open+0x0  foo_mod [GONE]
ffffffff81001000  k  bar+0x3
"""


def test_kprobes_list_flags() -> None:
    entries = parse_list(LIST)
    assert [(e.kind, e.where, e.module, e.plan) for e in entries] == [
        ("k", "vfs_read+0x0", "", "FTRACE"),
        ("k", "vfs_read+0x14", "", "OPTIMIZED"),
        ("r", "do_sys_openat2+0x0", "", "FTRACE"),
        ("k", "foo_open+0x0", "foo_mod", ""),
        ("k", "bar+0x3", "", ""),
    ]
    assert [(e.is_gone, e.is_disabled) for e in entries] == [
        (False, False), (False, False), (False, True), (True, False), (False, False),
    ]  # fmt: skip
    assert entries[1] == ProbeListing(
        0xFFFFFFFF812B9A34, "k", "vfs_read+0x14", "", False, False, "OPTIMIZED"
    )
    assert str(entries[1]).endswith("[OPTIMIZED]")


def test_blacklist_ranges() -> None:
    text = (
        "0xffffffff81000000-0xffffffff81000040\tdo_int3\n"
        "0xffffffff82000000-0xffffffff82001000\t__entry_text_start\n"
    )
    first, second = parse_blacklist(text)
    assert first == BlacklistEntry(0xFFFFFFFF81000000, 0xFFFFFFFF81000040, "do_int3")
    assert 0xFFFFFFFF81000010 in first and 0xFFFFFFFF81000040 not in first
    assert second.reason == "__entry_text_start"


KALLSYMS = b"""ffffffff81000000 T _stext
ffffffff81000100 t helper
ffffffff81000180 T vfs_read
ffffffff81000300 T vfs_readv
ffffffff81000400 t dup
ffffffff81000500 t dup
ffffffff81000600 d some_data
ffffffffc0001000 t mod_func\t[mymod]
ffffffffc0001080 t mod_other\t[mymod]
"""


def test_kallsyms_lookups() -> None:
    table = Kallsyms(KALLSYMS)
    vfs_read = table.lookup("vfs_read")
    assert (vfs_read.addr, vfs_read.size, vfs_read.module) == (0xFFFFFFFF81000180, 0x180, "")
    assert table.lookup("mymod:mod_func").module == "mymod"
    assert len(table.lookup_all("dup")) == 2
    assert table.lookup_all("vfs_rea") == [] and table.lookup_all("some_data") == []
    assert table.describe(0xFFFFFFFF81000190) == "vfs_read+0x10/0x180"
    assert table.describe(0xFFFFFFFFC0001004) == "mod_func+0x4/0x80 [mymod]"
    with pytest.raises(Exception, match="no kernel function"):
        table.lookup("nosuch")
    with pytest.raises(Exception, match="2 kernel functions"):
        table.lookup("dup")


def test_profile_rows_are_paired_with_definitions_by_position() -> None:
    defs = [
        "p:kprobes/p_vfs_read_0 vfs_read",
        "p:mine/p_vfs_read_0 vfs_read",
        "r4:mine/r_vfs_read_0 vfs_read ret=$retval",
    ]
    rows = [
        "  p_vfs_read_0                                   12               0",
        "  p_vfs_read_0                                    7               0",
        "  r_vfs_read_0                                    5               3",
    ]
    assert profile_counts(defs, rows, "mine") == {"p_vfs_read_0": (7, 0), "r_vfs_read_0": (5, 3)}
    uprobe_rows = ["  /bin/true p_x 4", "  /bin/true p_x 9", "  /bin/true r_x 2"]
    assert profile_counts(defs, uprobe_rows, "mine") is None  # names do not line up
    assert profile_counts(defs[:2], rows, "mine") is None
    udefs = ["p:g/p_x /bin/true:0x10", "p:mine/p_x /bin/true:0x10", "r:mine/r_x /bin/true:0x10"]
    assert profile_counts(udefs, uprobe_rows, "mine") == {"p_x": (9, 0), "r_x": (2, 0)}
