"""Valid probe lines → the values they mean; lines taken from kprobetrace.rst, uprobetracer.rst
and the kernel's ftrace selftests wherever possible."""

from __future__ import annotations

import pytest

from kprobes.spec import (
    AddressLocation,
    Bitfield,
    Comm,
    Command,
    Dereference,
    FieldKind,
    FileOffset,
    FileOffsetLocation,
    FunctionArg,
    Immediate,
    ImmediateString,
    MemoryAddress,
    MemorySymbol,
    ProbeArg,
    ProbeSpec,
    Register,
    ReturnValue,
    StackAddress,
    StackEntry,
    SymbolLocation,
    TypeSpec,
    parse,
    render,
)

DO_SYS_OPEN = SymbolLocation("do_sys_open")
VFS_READ = SymbolLocation("vfs_read")

VALID = [
    # kprobetrace.rst
    (
        "p:myprobe do_sys_open dfd=%ax filename=%dx flags=%cx mode=+4($stack)",
        ProbeSpec(
            Command.PROBE,
            DO_SYS_OPEN,
            args=(
                ProbeArg(Register("ax"), "dfd"),
                ProbeArg(Register("dx"), "filename"),
                ProbeArg(Register("cx"), "flags"),
                ProbeArg(Dereference(4, StackAddress()), "mode"),
            ),
            event="myprobe",
        ),
    ),
    (
        "r:myretprobe do_sys_open $retval",
        ProbeSpec(
            Command.RETPROBE, DO_SYS_OPEN, args=(ProbeArg(ReturnValue()),), event="myretprobe"
        ),
    ),
    ("-:myprobe", ProbeSpec(Command.DELETE, event="myprobe")),
    ("-:kprobes/myprobe", ProbeSpec(Command.DELETE, group="kprobes", event="myprobe")),
    (
        "p vfs_read +0(%di):x32[1] +0(%di):string[1]",
        ProbeSpec(
            Command.PROBE,
            VFS_READ,
            args=(
                ProbeArg(Dereference(0, Register("di")), type=TypeSpec("x32", 1)),
                ProbeArg(Dereference(0, Register("di")), type=TypeSpec("string", 1)),
            ),
        ),
    ),
    (
        "p vfs_read +u4(%si) +u0(%si):string +0(%si):ustring",
        ProbeSpec(
            Command.PROBE,
            VFS_READ,
            args=(
                ProbeArg(Dereference(4, Register("si"), is_user=True)),
                ProbeArg(Dereference(0, Register("si"), is_user=True), type=TypeSpec("string")),
                ProbeArg(Dereference(0, Register("si")), type=TypeSpec("ustring")),
            ),
        ),
    ),
    (
        "p vfs_read +8($stack):x8[8] $comm $COMM:string",
        ProbeSpec(
            Command.PROBE,
            VFS_READ,
            args=(
                ProbeArg(Dereference(8, StackAddress()), type=TypeSpec("x8", 8)),
                ProbeArg(Comm()),
                ProbeArg(Comm(), type=TypeSpec("string")),
            ),
        ),
    ),
    # uprobetracer.rst
    ("p /bin/bash:0x4245c0", ProbeSpec(Command.PROBE, FileOffsetLocation("/bin/bash", 0x4245C0))),
    (
        "r /bin/bash:0x4245c0",
        ProbeSpec(Command.RETPROBE, FileOffsetLocation("/bin/bash", 0x4245C0)),
    ),
    (
        "p:zfree_entry /bin/zsh:0x46420 %ip %ax",
        ProbeSpec(
            Command.PROBE,
            FileOffsetLocation("/bin/zsh", 0x46420),
            args=(ProbeArg(Register("ip")), ProbeArg(Register("ax"))),
            event="zfree_entry",
        ),
    ),
    (  # the uprobe_events listing of the same probe
        "p:uprobes/zfree_entry /bin/zsh:0x00046420 arg1=%ip arg2=%ax",
        ProbeSpec(
            Command.PROBE,
            FileOffsetLocation("/bin/zsh", 0x46420),
            args=(ProbeArg(Register("ip"), "arg1"), ProbeArg(Register("ax"), "arg2")),
            group="uprobes",
            event="zfree_entry",
        ),
    ),
    (
        "p /bin/sh:10(0x20) @+0x1000:u32 @4096",
        ProbeSpec(
            Command.PROBE,
            FileOffsetLocation("/bin/sh", 10, ref_ctr_offset=0x20),
            args=(
                ProbeArg(FileOffset(0x1000), type=TypeSpec("u32")),
                ProbeArg(MemoryAddress(4096)),
            ),
        ),
    ),
    (
        "p /usr/lib/libc.so.6:0x1234%return(0x10)",
        ProbeSpec(
            Command.PROBE,
            FileOffsetLocation("/usr/lib/libc.so.6", 0x1234, 0x10),
            has_return_suffix=True,
        ),
    ),
    # kprobe_args_syntax.tc good args
    (
        "p vfs_read @_sdata @0xffffffff82000000 @_sdata+10 @_sdata-10 $stack $stack0 $stack1",
        ProbeSpec(
            Command.PROBE,
            VFS_READ,
            args=(
                ProbeArg(MemorySymbol("_sdata")),
                ProbeArg(MemoryAddress(0xFFFFFFFF82000000)),
                ProbeArg(MemorySymbol("_sdata", 10)),
                ProbeArg(MemorySymbol("_sdata", -10)),
                ProbeArg(StackAddress()),
                ProbeArg(StackEntry(0)),
                ProbeArg(StackEntry(1)),
            ),
        ),
    ),
    (
        "p vfs_read +0(%ax) -0(%ax) +10($stack) +0($stack1) +10(@_sdata-10) +0(+10(+20($stack)))",
        ProbeSpec(
            Command.PROBE,
            VFS_READ,
            args=(
                ProbeArg(Dereference(0, Register("ax"))),
                ProbeArg(Dereference(0, Register("ax"))),
                ProbeArg(Dereference(10, StackAddress())),
                ProbeArg(Dereference(0, StackEntry(1))),
                ProbeArg(Dereference(10, MemorySymbol("_sdata", -10))),
                ProbeArg(Dereference(0, Dereference(10, Dereference(20, StackAddress())))),
            ),
        ),
    ),
    (
        "p:testprobe _do_fork $stack0:s64 $stack0:u64 $stack0:x64 $stack0:b4@4/64",
        ProbeSpec(
            Command.PROBE,
            SymbolLocation("_do_fork"),
            args=(
                ProbeArg(StackEntry(0), type=TypeSpec("s64")),
                ProbeArg(StackEntry(0), type=TypeSpec("u64")),
                ProbeArg(StackEntry(0), type=TypeSpec("x64")),
                ProbeArg(StackEntry(0), type=TypeSpec("u64", bitfield=Bitfield(4, 4))),
            ),
            event="testprobe",
        ),
    ),
    # return forms, MAXACTIVE, modules, addresses
    ("r10 vfs_read", ProbeSpec(Command.RETPROBE, VFS_READ, maxactive=10)),
    (
        "r4096:kprobes/x vfs_read+0",
        ProbeSpec(Command.RETPROBE, VFS_READ, group="kprobes", event="x", maxactive=4096),
    ),
    ("p vfs_read%return", ProbeSpec(Command.PROBE, VFS_READ, has_return_suffix=True)),
    (
        "p vfs_read+0%return $retval",
        ProbeSpec(Command.PROBE, VFS_READ, args=(ProbeArg(ReturnValue()),), has_return_suffix=True),
    ),
    (
        "p ext4:ext4_file_open+0x10",
        ProbeSpec(Command.PROBE, SymbolLocation("ext4_file_open", 16, "ext4")),
    ),
    ("p 0xffffffff81000000", ProbeSpec(Command.PROBE, AddressLocation(0xFFFFFFFF81000000))),
    ("p:grp/ vfs_read", ProbeSpec(Command.PROBE, VFS_READ, group="grp")),
    ("p:my-group/ev vfs_read", ProbeSpec(Command.PROBE, VFS_READ, group="my-group", event="ev")),
    # our user-space extensions: LIB:SYM and PATH:SYM
    (
        "p libc:malloc size=%di:u64",
        ProbeSpec(
            Command.PROBE,
            SymbolLocation("malloc", 0, "libc"),
            args=(ProbeArg(Register("di"), "size", TypeSpec("u64")),),
        ),
    ),
    (
        "r /usr/lib/libc.so.6:malloc $retval",
        ProbeSpec(
            Command.RETPROBE,
            SymbolLocation("malloc", 0, "/usr/lib/libc.so.6"),
            args=(ProbeArg(ReturnValue()),),
        ),
    ),
    # immediates, $argN, more types
    (
        'p do_sys_open \\1234 \\-1 \\0x10 \\"hello" $arg1 $arg2:s32 $arg3:symbol',
        ProbeSpec(
            Command.PROBE,
            DO_SYS_OPEN,
            args=(
                ProbeArg(Immediate(1234)),
                ProbeArg(Immediate(-1)),
                ProbeArg(Immediate(16)),
                ProbeArg(ImmediateString("hello")),
                ProbeArg(FunctionArg(1)),
                ProbeArg(FunctionArg(2), type=TypeSpec("s32")),
                ProbeArg(FunctionArg(3), type=TypeSpec("symbol")),
            ),
        ),
    ),
    (
        "r vfs_read $arg1 +0($retval):string $retval:symstr %r15:char x=%orig_ax:%pd",
        ProbeSpec(
            Command.RETPROBE,
            VFS_READ,
            args=(
                ProbeArg(FunctionArg(1)),
                ProbeArg(Dereference(0, ReturnValue()), type=TypeSpec("string")),
                ProbeArg(ReturnValue(), type=TypeSpec("symstr")),
                ProbeArg(Register("r15"), type=TypeSpec("char")),
                ProbeArg(Register("orig_ax"), "x", TypeSpec("%pd")),
            ),
        ),
    ),
    (  # white space is any of the kernel's isspace(), columns do not matter
        "  p:ev\tvfs_read \t %flags  ",
        ProbeSpec(Command.PROBE, VFS_READ, args=(ProbeArg(Register("flags")),), event="ev"),
    ),
]


@pytest.mark.parametrize(("text", "expected"), VALID, ids=[t for t, _ in VALID])
def test_valid_lines_parse_to_their_values(text: str, expected: ProbeSpec) -> None:
    spec = parse(text)
    assert spec == expected
    assert parse(render(spec)) == spec
    assert hash(spec) == hash(expected)


DEFAULT_NAMES = [
    ("p do_sys_open", "kprobes", "p_do_sys_open_0"),
    ("r vfs_read", "kprobes", "r_vfs_read_0"),
    ("p vfs_read%return", "kprobes", "r_vfs_read_0"),
    ("p vfs_read+0x10", "kprobes", "p_vfs_read_16"),
    ("p ext4:ext4_file_open", "kprobes", "p_ext4_ext4_file_open_0"),
    ("p foo.isra.0+4", "kprobes", "p_foo_isra_0_4"),
    ("p 0xffffffff81000000", "kprobes", "p_0xffffffff81000000"),
    ("r 0x1000", "kprobes", "r_0x0000000000001000"),
    ("p /bin/bash:0x4245c0", "uprobes", "p_bash_0x4245c0"),
    ("r /bin/bash:0x4245c0", "uprobes", "p_bash_0x4245c0"),  # trace_uprobe.c: always 'p'
    ("p /usr/lib/libc.so.6:0x10", "uprobes", "p_libc_0x10"),
    ("p /usr/lib/ld-linux-x86-64.so.2:0x10", "uprobes", "p_ld_0x10"),
    ("p libc:malloc", "kprobes", "p_libc_malloc_0"),
    ("r /usr/lib/libc.so.6:malloc", "uprobes", "r_libc_malloc_0"),
    ("p /lib/libstdc++.so:_ZN3foo3barEv@@V1+4", "uprobes", "p_libstdc____ZN3foo3barEv__V1_4"),
    ("p:grp/ vfs_read", "grp", "p_vfs_read_0"),
    ("p:ev vfs_read", "kprobes", "ev"),
    ("p:ev /bin/sh:1", "uprobes", "ev"),
    ("-:ev", "", "ev"),
]


@pytest.mark.parametrize(("text", "group", "event"), DEFAULT_NAMES)
def test_default_group_and_event_names_follow_the_kernel(text: str, group: str, event: str) -> None:
    spec = parse(text)
    assert (spec.effective_group, spec.effective_event) == (group, event)


def test_generated_event_names_are_cut_to_63_characters() -> None:
    spec = parse("p " + "a" * 100)
    assert spec.effective_event == ("p_" + "a" * 100)[:63]


def test_default_arg_names_are_by_position_and_types_by_fetch() -> None:
    spec = parse('p vfs_read %di n=%si:u32 $comm \\"x" +0(%dx):string[2] %ax:b3@1/8')
    assert spec.arg_names == ("arg1", "n", "arg3", "arg4", "arg5", "arg6")
    assert spec.fields == (
        ("arg1", TypeSpec("x64")),
        ("n", TypeSpec("u32")),
        ("arg3", TypeSpec("string")),
        ("arg4", TypeSpec("string")),
        ("arg5", TypeSpec("string", 2)),
        ("arg6", TypeSpec("u8", bitfield=Bitfield(3, 1))),
    )
    assert spec.filter_fields == {
        "arg1": FieldKind.NUMBER,
        "n": FieldKind.NUMBER,
        "arg3": FieldKind.STRING,
        "arg4": FieldKind.STRING,
        "arg6": FieldKind.NUMBER,
    }


@pytest.mark.parametrize(
    ("text", "is_return"),
    [
        ("p vfs_read", False),
        ("r vfs_read", True),
        ("p vfs_read%return", True),
        ("p /bin/sh:0x10%return", True),
        ("r /bin/sh:0x10", True),
        ("-:x", False),
    ],
)
def test_is_return(text: str, is_return: bool) -> None:
    assert parse(text).is_return is is_return


@pytest.mark.parametrize(
    ("type_text", "size", "is_string", "kind"),
    [
        ("u8", 1, False, FieldKind.NUMBER),
        ("s16", 2, False, FieldKind.NUMBER),
        ("x32", 4, False, FieldKind.NUMBER),
        ("u64", 8, False, FieldKind.NUMBER),
        ("char", 1, False, FieldKind.NUMBER),
        ("symbol", 8, False, FieldKind.NUMBER),
        ("string", 4, True, FieldKind.STRING),
        ("ustring", 4, True, FieldKind.STRING),
        ("symstr", 4, True, FieldKind.STRING),
        ("%pd", 4, True, FieldKind.STRING),
        ("x16[4]", 8, False, FieldKind.NUMBER),
        ("string[3]", 12, True, FieldKind.STRING),
        ("b4@3/32", 4, False, FieldKind.NUMBER),
        ("b1@0/8[10]", 10, False, FieldKind.NUMBER),
    ],
)
def test_type_sizes_and_kinds(type_text: str, size: int, is_string: bool, kind: FieldKind) -> None:
    (arg,) = parse(f"p vfs_read +0(%di):{type_text}").args
    assert arg.type is not None
    assert (arg.type.size, arg.type.is_string, arg.type.field_kind) == (size, is_string, kind)


def test_signedness() -> None:
    assert TypeSpec("s32").is_signed
    assert not TypeSpec("u32").is_signed
    assert not TypeSpec("string").is_signed


@pytest.mark.parametrize(
    ("text", "rendered"),
    [
        ("p:myprobe  do_sys_open   dfd=%ax", "p:myprobe do_sys_open dfd=%ax"),
        ("r vfs_read+0", "r vfs_read"),
        ("p vfs_read+0x10", "p vfs_read+16"),
        ("p 18446744071578845184", "p 0xffffffff81000000"),
        ("p /bin/zsh:0x00046420", "p /bin/zsh:0x46420"),
        ("p /bin/sh:10%return(32)", "p /bin/sh:0xa%return(0x20)"),
        ("p vfs_read +0x10(%di) -0x8(%bp) +u0x0(%si)", "p vfs_read +16(%di) -8(%bp) +u0(%si)"),
        ("p vfs_read @18446744073709551615 \\+7", "p vfs_read @0xffffffffffffffff \\7"),
        ("p vfs_read @jiffies+0 $COMM", "p vfs_read @jiffies $comm"),
        ("p vfs_read %ax:b0x4@0x3/0x20", "p vfs_read %ax:b4@3/32"),
        ("p:g/ vfs_read", "p:g/ vfs_read"),
        ("-:g/e", "-:g/e"),
    ],
)
def test_render_is_canonical(text: str, rendered: str) -> None:
    assert render(parse(text)) == rendered
    assert parse(rendered) == parse(text)
