"""Bytes and texts captured from a real kernel (6.18, uprobes on the host) for the unit tests.

``PAGE_HEX`` is one page read from ``per_cpu/cpu1/trace_pipe_raw`` of an instance (page
header + the committed bytes; the rest of the 4096-byte page was zero), holding two calls of
``work(x, "hello world", p)`` of a small program: an entry record of ``WORK_FORMAT`` and a
return record of ``WORK_RET_FORMAT`` each.
"""

PAGE_HEX = (
    "0af094db86020000c8000000000000000f0000001609ffffab0800007971a234625500000000000000000000"
    "28000c0007000000000000003400050068656c6c6f20776f726c640070726f6700000000286109001709ffff"
    "ab0800007971a234625500002172a2346255000012000000000000000fa500001609ffffab0800007971a234"
    "62550000010000000000000028000c0007000000000000003400050068656c6c6f20776f726c640070726f67"
    "00000000885800001709ffffab0800007971a234625500002172a234625500001400000000000000"
)

WORK_FORMAT = """name: work
ID: 2326
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long __probe_ip;\toffset:8;\tsize:8;\tsigned:0;
\tfield:s64 x;\toffset:16;\tsize:8;\tsigned:1;
\tfield:__data_loc char[] s;\toffset:24;\tsize:4;\tsigned:1;
\tfield:u32 arr[];\toffset:28;\tsize:8;\tsigned:0;
\tfield:__data_loc char[] arg4;\toffset:36;\tsize:4;\tsigned:1;

print fmt: "(%lx) x=%Ld s=\\"%s\\" arr={%u,%u} arg4=\\"%s\\"", REC->__probe_ip, REC->x, \
__get_str(s), REC->arr[0], REC->arr[1], __get_str(arg4)
"""

WORK_RET_FORMAT = """name: work_ret
ID: 2327
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long __probe_func;\toffset:8;\tsize:8;\tsigned:0;
\tfield:unsigned long __probe_ret_ip;\toffset:16;\tsize:8;\tsigned:0;
\tfield:s64 ret;\toffset:24;\tsize:8;\tsigned:1;

print fmt: "(%lx <- %lx) ret=%Ld", REC->__probe_func, REC->__probe_ret_ip, REC->ret
"""

# Every kind of fetch-arg type uprobe_events has, as the kernel laid them out (packed).
TYPES_FORMAT = """name: e1
ID: 2326
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long __probe_ip;\toffset:8;\tsize:8;\tsigned:0;
\tfield:u8 a;\toffset:16;\tsize:1;\tsigned:0;
\tfield:s16 b;\toffset:17;\tsize:2;\tsigned:1;
\tfield:u32 c;\toffset:19;\tsize:4;\tsigned:0;
\tfield:u64 d;\toffset:23;\tsize:8;\tsigned:0;
\tfield:__data_loc char[] e;\toffset:31;\tsize:4;\tsigned:1;
\tfield:u32 f[];\toffset:35;\tsize:12;\tsigned:0;
\tfield:__data_loc char[][2] g;\toffset:47;\tsize:8;\tsigned:1;
\tfield:u32 h;\toffset:55;\tsize:4;\tsigned:0;
\tfield:__data_loc char[] i;\toffset:59;\tsize:4;\tsigned:1;
\tfield:u8 j;\toffset:63;\tsize:1;\tsigned:0;
\tfield:__data_loc char[] l;\toffset:64;\tsize:4;\tsigned:1;
\tfield:u64 m[];\toffset:68;\tsize:16;\tsigned:0;
\tfield:u64 arg13;\toffset:84;\tsize:8;\tsigned:0;
\tfield:u64 arg14;\toffset:92;\tsize:8;\tsigned:0;
\tfield:s64 n;\toffset:100;\tsize:8;\tsigned:1;

print fmt: "(%lx) a=%u b=%d c=0x%x d=0x%Lx e=\\"%s\\" f={%u,%u,%u} g={\\"%s\\",\\"%s\\"} h=%u \
i=\\"%s\\" j='%c' l=\\"%s\\" m={0x%Lx,0x%Lx} arg13=0x%Lx arg14=0x%Lx n=%Ld", REC->__probe_ip, \
REC->a, REC->b, REC->c, REC->d, __get_str(e), REC->f[0], REC->f[1], REC->f[2], __get_str(g[0]), \
__get_str(g[1]), REC->h, __get_str(i), REC->j, __get_str(l), REC->m[0], REC->m[1], REC->arg13, \
REC->arg14, REC->n
"""

HEADER_PAGE = """\tfield: u64 timestamp;\toffset:0;\tsize:8;\tsigned:0;
\tfield: local_t commit;\toffset:8;\tsize:8;\tsigned:1;
\tfield: int overwrite;\toffset:8;\tsize:1;\tsigned:1;
\tfield: char data;\toffset:16;\tsize:4080;\tsigned:0;
"""

ERROR_LOG = """[ 2794.141320] trace_uprobe: error: Unknown type is specified
  Command: p:tst/e1 /bin/true:0x2000 a=%di:u8 k=%ax:symbol
                                                    ^
[ 2794.141378] trace_uprobe: error: String accepts only memory argument
  Command: p:tst/e1 /bin/true:0x2000 m=%ax:string
                                           ^
"""

README_TAIL = """  uprobe_events\t\t- Create/append/remove/show the userspace dynamic events
\t\t\t  Write into this file to define/undefine new trace events.
\t  accepts: event-definitions (one definition per line)
\t   Format: p[:[<group>/][<event>]] <place> [<args>]
\t           r[maxactive][:[<group>/][<event>]] <place> [<args>]
\t           -:[<group>/][<event>]
   place (uprobe): <path>:<offset>[%return][(ref_ctr_offset)]
\t     args: <name>=fetcharg[:type]
\t fetcharg: (%<register>|$<efield>), @<address>, @<symbol>[+|-<offset>],
\t           $stack<index>, $stack, $retval, $comm, $arg<N>,
\t           +|-[u]<offset>(<fetcharg>), \\imm-value, \\"imm-string"
\t     kernel return probes support: $retval, $arg<N>, $comm
\t     type: s8/16/32/64, u8/16/32/64, x8/16/32/64, char, string, symbol,
\t           b<bit-width>@<bit-offset>/<container-size>, ustring,
\t           symstr, %pd/%pD, <type>\\[<array-size>\\]
\t    efield: For event probes ('e' types), the field is on of the fields
"""

# An old kernel's README (4.19 era): no arrays, no ustring/symstr, no $comm on returns.
README_OLD = """\t fetcharg: %<register>, @<address>, @<symbol>[+|-<offset>],
\t           $stack<index>, $stack, $retval, $comm
\t     type: s8/16/32/64, u8/16/32/64, x8/16/32/64, string, symbol,
\t           b<bit-width>@<bit-offset>/<container-size>
  events/\t\t- Directory containing all trace event subsystems:
"""
