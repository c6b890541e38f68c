"""Invalid probe lines → the kernel's error_log message, at the right column.

Written as the kernel's ftrace selftests write them (kprobe_syntax_errors.tc,
uprobe_syntax_errors.tc): a ``^`` marks the column of the error and is removed before parsing.
The first block is those selftests verbatim; the second covers the rest of the grammar.
"""

from __future__ import annotations

import pytest

from kprobes.errors import SpecError
from kprobes.spec import parse

KERNEL_SELFTESTS = [
    ("p^100 vfs_read", "Maxactive is only for function exit"),
    ("r^1a111 vfs_read", "Invalid maxactive number"),
    ("r^100000 vfs_read", "Maxactive is too big"),
    ("p ^hoge-fuga", "Invalid probed address or symbol"),
    ("p ^hoge+1000-1000", "Invalid probed address or symbol"),
    ("r ^vfs_read+10", "Retprobe address must be an function entry"),
    ("p:^/bar vfs_read", "Group name is not specified"),
    ("p:^" + "1234567890" * 6 + "12345/bar vfs_read", "Group name is too long"),
    ("p:^foo.1/bar vfs_read", "Group name must follow the same rules as C identifiers"),
    ("p:foo/^" + "1234567890" * 6 + "12345 vfs_read", "Event name is too long"),
    ("p:foo/^bar.1 vfs_read", "Event name must follow the same rules as C identifiers"),
    ("p vfs_read ^$retval", "$retval is not available on probe"),
    ("p vfs_read ^$stack10000", "Invalid stack number"),
    ("p vfs_read ^$arg10000", "Invalid argument number"),
    ("p vfs_read ^$none_var", "Invalid $-variable specified"),
    ("p vfs_read ^%none_reg", "Invalid register name"),
    ("p vfs_read ^@12345678abcde", "Invalid memory address"),
    ("p vfs_read ^@+10", "File offset is not available with kprobe"),
    ("p vfs_read ^+0@0)", "Dereference needs a brace"),
    ("p vfs_read ^+0ab1(@0)", "Invalid dereference offset"),
    ("p vfs_read +0(+0(@0^)", "Dereference brace is not closed"),
    ("p vfs_read +0(^$comm)", "$comm can not be dereferenced"),
    ("p vfs_read ^&1", "Invalid fetch argument"),
    ("p vfs_read +0(^" + "+0(" * 13 + "@0" + ")" * 14, "Dereference is too much nested"),
    ("p vfs_read +0(@11):u8[10^", "Array is not closed"),
    ("p vfs_read +0(@11):u8[10]^a", "Array has wrong suffix"),
    ("p vfs_read +0(@11):u8[^10a]", "Invalid array size"),
    ("p vfs_read +0(@11):u8[^256]", "Array number is too big"),
    ("p vfs_read @11:^unknown_type", "Unknown type is specified"),
    ("p vfs_read $stack0:^string", "String accepts only memory argument"),
    ("p vfs_read @11:^b10@a/16", "Invalid bitfield"),
    ("p vfs_read ^arg123456789012345678901234567890=@11", "Argument name is too long"),
    ("p vfs_read ^=@11", "Argument name is not specified"),
    ("p vfs_read ^var.1=@11", "Argument name must follow the same rules as C identifiers"),
    ("p vfs_read var1=@11 ^var1=@12", "This argument name is already used"),
    ("p vfs_read ^" + "+1234567(" * 6 + "@1234" + ")" * 6, "Argument expression is too long"),
    ("p vfs_read arg1=^", "No argument expression"),
    ("p /bin/sh:^10a", "Invalid uprobe offset"),
    ("p /bin/sh:10(^1a)", "Invalid reference counter offset"),
    ("p /bin/sh:10(10^", "Reference counter brace is not closed"),
    ("p /bin/sh:10(10)^a", "Reference counter has wrong suffix"),
    ("p /bin/sh:10 ^@+ab", "Invalid file offset value"),
    ("p /bin/sh:10 ^@symbol", "Symbol is not available with uprobe"),
]

MORE = [
    # the line and its command
    ("^", "Probe definition is empty"),
    ("^   \t ", "Probe definition is empty"),
    ("^x vfs_read", "Unknown probe command"),
    ("^px vfs_read", "Unknown probe command"),
    ("^-myprobe", "Unknown probe command"),
    ("p^ ", "Probe point is not specified"),
    ("p:myprobe^", "Probe point is not specified"),
    ("r^0 vfs_read", "Invalid maxactive number"),
    ("r^4097 vfs_read", "Maxactive is too big"),
    ("r^10 /bin/sh:0x10", "Maxactive is not for uprobe"),
    ("p:^ vfs_read", "Event name is not specified"),
    ("p:g/^a-b vfs_read", "Event name must follow the same rules as C identifiers"),
    ("p:g/^e/f vfs_read", "Event name must follow the same rules as C identifiers"),
    ("p:^1grp/e vfs_read", "Group name must follow the same rules as C identifiers"),
    ("-:g/^", "Event name is not specified"),
    ("-:^", "Event name is not specified"),
    ("-:e ^%ax", "Too many arguments are specified"),
    # locations
    ("p ^vfs_read+-1", "Invalid probed address or symbol"),
    ("p ^vfs_read+0x100000000", "Invalid probed address or symbol"),
    ("p ^9foo", "Invalid probed address or symbol"),
    ("p ^:vfs_read", "Invalid probed address or symbol"),
    ("p ^b:c:vfs_read", "Invalid probed address or symbol"),
    ("p vfs_read^%retur", "Invalid probed address suffix"),
    ("p vfs_read^%return+0", "Invalid probed address suffix"),
    ("p ^vfs_read+4%return", "Retprobe address must be an function entry"),
    ("p ^0x1000%return", "Invalid probed address or symbol"),
    ("p /bin/sh:^", "Invalid uprobe offset"),
    ("p /bin/sh:0x10^%ret", "Invalid probed address suffix"),
    ("p ^sym:mod/x", "Invalid probed address or symbol"),
    ("r ^/lib/libc.so:malloc+4", "Retprobe address must be an function entry"),
    ("p /lib/libc.so:^mal/loc", "Invalid probed address or symbol"),
    # fetch arguments
    ("p vfs_read ^%eax", "Invalid register name"),
    ("p vfs_read ^%AX", "Invalid register name"),
    ("p vfs_read ^%r16", "Invalid register name"),
    ("p vfs_read ^%", "Invalid register name"),
    ("p vfs_read ^$stackp", "Invalid $-variable specified"),
    ("p vfs_read ^$stack0+10", "Invalid $-variable specified"),
    ("p vfs_read ^$stack1-10", "Invalid $-variable specified"),
    ("p vfs_read ^$arg0", "Invalid argument number"),
    ("p vfs_read ^$argx", "Invalid $-variable specified"),
    ("p vfs_read+4 ^$arg1", "$arg* can be used only on function entry or exit"),
    ("p 0xffffffff81000000 ^$arg1", "$arg* can be used only on function entry or exit"),
    ("r /bin/sh:0x10 ^$arg1", "$arg* can be used only on function entry or exit"),
    ("p vfs_read ^$retval2", "Invalid $-variable specified"),
    ("p /bin/sh:1 ^$retval", "$retval is not available on probe"),
    ("p vfs_read ^@", "Invalid memory address"),
    ("p vfs_read ^@_sdata*10", "Invalid memory address"),
    ("p vfs_read ^@_sdata/10", "Invalid memory address"),
    ("p vfs_read ^@_sdata%10", "Invalid memory address"),
    ("p vfs_read ^@_sdata&10", "Invalid memory address"),
    ("p vfs_read ^@_sdata|10", "Invalid memory address"),
    ("p vfs_read ^@_sdata+", "Invalid memory address"),
    ("p vfs_read ^+(%ax)", "Invalid dereference offset"),
    ("p vfs_read ^-(%ax)", "Invalid dereference offset"),
    ("p vfs_read ^(%ax+10)", "Invalid fetch argument"),
    ("p vfs_read ^(%ax)", "Invalid fetch argument"),
    ('p vfs_read +0(^\\"x")', "$comm can not be dereferenced"),
    ("p vfs_read +0(%ax)^+10", "Invalid fetch argument"),
    ("p vfs_read +0(^)", "Invalid fetch argument"),
    ("p vfs_read varname=^varname2=%ax", "BTF is not available or not supported"),
    ("p vfs_read ^foo", "BTF is not available or not supported"),
    ("p vfs_read \\^abc", "Invalid immediate value"),
    ("p vfs_read \\^", "Invalid immediate value"),
    ("p vfs_read \\^-", "Invalid immediate value"),
    ("p vfs_read \\^18446744073709551616", "Invalid immediate value"),
    ('p vfs_read \\"abc^', "String is not closed with '\"'"),
    ('p vfs_read \\"^', "String is not closed with '\"'"),
    ('p vfs_read ^\\"a=b"', "Argument name must follow the same rules as C identifiers"),
    ("p vfs_read ^common_pid=%ax", "This argument name is already used"),
    ("p vfs_read ^__probe_ip=%ax", "This argument name is already used"),
    ("p vfs_read arg2=%ax ^%bx", "This argument name is already used"),
    # types
    ("p vfs_read %ax:^x16:", "Unknown type is specified"),
    ("p vfs_read %ax:^:x16", "Unknown type is specified"),
    ("p vfs_read %ax:^y16", "Unknown type is specified"),
    ("p vfs_read %ax:^", "Unknown type is specified"),
    ("p vfs_read x16:^%ax", "Unknown type is specified"),
    ("p vfs_read $comm:^x64", "$comm and immediate-string only accepts string type"),
    ("p vfs_read $comm:^string[2]", "$comm and immediate-string only accepts string type"),
    ('p vfs_read \\"a":^u8', "$comm and immediate-string only accepts string type"),
    ("p vfs_read $stack:^string", "String accepts only memory argument"),
    ("p vfs_read %ax:^string", "String accepts only memory argument"),
    ("p vfs_read $arg1:^ustring", "String accepts only memory argument"),
    ("p vfs_read $stack1:^x8[8]", "String accepts only memory argument"),
    ("p vfs_read %ax:^u32[2]", "String accepts only memory argument"),
    ("p vfs_read +u0(%ax):^u32[2]", "String accepts only memory argument"),
    ("p vfs_read +0(%ax):^symstr[2]", "String accepts only memory argument"),
    ("p vfs_read +u0(%ax):^symstr", "Symbol String doesn't accept data/userdata"),
    ("p vfs_read \\1:^symstr", "Symbol String doesn't accept data/userdata"),
    ("p vfs_read $stack:^symstr", "Symbol String doesn't accept data/userdata"),
    ("p vfs_read +0(%ax):x8[^0]", "Invalid array size"),
    ("p vfs_read +0(%ax):x8[^64]", "Array number is too big"),
    ("p vfs_read +0(%ax):x8[^]", "Invalid array size"),
    ("p vfs_read %ax:^b0@0/32", "Invalid bitfield"),
    ("p vfs_read %ax:^b4@30/32", "Invalid bitfield"),
    ("p vfs_read %ax:^b4@/32", "Invalid bitfield"),
    ("p vfs_read %ax:^b4/32", "Invalid bitfield"),
    ("p vfs_read %ax:^b4@0/12", "Unknown type is specified"),
    ("p vfs_read %ax:^b4@0", "Unknown type is specified"),
    ("p vfs_read %ax:^%pd[2]", "Unknown type is specified"),
    ("p vfs_read $comm:^%pd", "$comm and immediate-string only accepts string type"),
    ("p /bin/sh:1 %ax:^symbol", "Unknown type is specified"),
    ("p /bin/sh:1 %ax:^symstr", "Unknown type is specified"),
    ("p /bin/sh:1 %ax:^%pD", "Unknown type is specified"),
    # %pd and %pD count at the length they expand to (+0x0(+0x28(X)):string)
    ("p vfs_read ^" + "+0(" * 11 + "%ax" + ")" * 11 + ":%pd", "Argument expression is too long"),
    ("p vfs_read ^" + "+0(" * 9 + "%ax" + ")" * 9 + ":%pD", "Argument expression is too long"),
    # at most 16 fetch instructions: @SYM takes 3, each dereference 1, then the last step
    ("p vfs_read " + "+0(" * 12 + "@a" + ")" * 12 + ":^b1@0/8", "Invalid bitfield"),
    ("p vfs_read +0(^" + "+0(" * 11 + "@a" + ")" * 12 + ":x8[2]", "Dereference is too much nested"),
    (
        "p vfs_read +0(^" + "+0(" * 11 + "@a" + ")" * 12 + ":string[1]",
        "Dereference is too much nested",
    ),
]


def _split(marked: str) -> tuple[str, int]:
    column = marked.index("^")
    return marked[:column] + marked[column + 1 :], column


@pytest.mark.parametrize(
    ("marked", "message"), KERNEL_SELFTESTS + MORE, ids=[m for m, _ in KERNEL_SELFTESTS + MORE]
)
def test_invalid_lines_name_the_error_and_its_column(marked: str, message: str) -> None:
    text, column = _split(marked)
    with pytest.raises(SpecError) as caught:
        parse(text)
    assert (caught.value.message, caught.value.column) == (message, column)
    assert caught.value.text == text


def test_too_many_arguments_points_at_the_129th() -> None:
    args = [f"a{i}=%ax" for i in range(129)]
    text = "p vfs_read " + " ".join(args)
    with pytest.raises(SpecError) as caught:
        parse(text)
    assert caught.value.message == "Too many arguments are specified"
    assert caught.value.column == text.index("a128=")
    assert len(parse("p vfs_read " + " ".join(args[:128])).args) == 128


def test_sixteen_fetch_instructions_is_the_limit() -> None:
    # @a (3) + 12 dereferences (the last one becomes the store) + the end marker: 16.
    assert parse("p vfs_read " + "+0(" * 12 + "@a" + ")" * 12 + ":u64")
    with pytest.raises(SpecError, match="too much nested"):
        parse("p vfs_read " + "+0(" * 12 + "@a" + ")" * 12 + ":u64[2]")
    with pytest.raises(SpecError, match="too much nested"):
        parse("p vfs_read " + "+0(" * 13 + "@a" + ")" * 13)


@pytest.mark.parametrize("limit", [63])
def test_names_and_expressions_at_their_length_limits(limit: int) -> None:
    assert parse(f"p:{'g' * limit}/{'e' * limit} vfs_read")
    assert parse(f"p vfs_read {'n' * 32}=%ax")
    assert parse(f"p vfs_read @{'a' * (limit - 1)}")
    with pytest.raises(SpecError, match="Argument expression is too long"):
        parse(f"p vfs_read @{'a' * limit}")
