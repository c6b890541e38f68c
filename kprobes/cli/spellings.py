"""The peers' spellings of a probe, read as our probe lines (issue 22): a user of bpftrace or
bcc types what their hands know, and either it means what they meant or it says why not.

    bpftrace   uprobe:PATH:FUNC, u:PATH:FUNC          p PATH:FUNC
               uretprobe:PATH:FUNC, ur:PATH:FUNC      r PATH:FUNC
    bcc        c:malloc (c = libc)                    libc:malloc
               p:c:malloc, r:c:malloc, p:PATH:FUNC    p libc:malloc, r libc:malloc, p PATH:FUNC

A bpftrace probe type that is not a function's entry or return in a user program
(``kprobe:``, ``tracepoint:``, ``mem:``/``watchpoint:``, ``profile:``, ``usdt:``, ...) is an
error that says what it is and what we have instead, never the name of a library that is
then waited for in vain (``mem:counter/8:w`` once ran the program with a probe pending on a
library called ``mem``). The kernel's own grammar (``p:EVENT LOCATION``, with its space)
is left alone: a bcc spelling is one word with two colons, which the kernel's is not.
"""

from __future__ import annotations

import re

from kprobes.errors import SpecError

_UPROBE = re.compile(r"^\s*(uprobe|u|uretprobe|ur):(.*)$")
_BCC = re.compile(r"^\s*([pr]):([^\s:]*):(\S.*)$")
_LIBC = re.compile(r"^c:")

# bpftrace's probe types (and their short names) that are not ours: what each is, and what
# to use instead.
_CODE = "kprobes probes code: a function, an offset or an address in a program"
_KERNEL = ("kernel function", "the kernel's kprobes: kprobes --kernel 'p FUNC'")
_NOT_OURS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("kprobe", "k", "kretprobe", "kr"), _KERNEL),
    **dict.fromkeys(("kfunc", "fentry", "f", "kretfunc", "fexit", "fr"), _KERNEL),
    **dict.fromkeys(
        ("tracepoint", "t", "rawtracepoint", "rt"),
        ("kernel tracepoint", "a kernel function instead: kprobes --kernel 'p FUNC'"),
    ),
    **dict.fromkeys(("usdt", "U"), ("USDT marker", "kprobes does not place USDT markers yet")),
    **dict.fromkeys(("watchpoint", "w", "asyncwatchpoint", "aw", "mem"), ("watchpoint", _CODE)),
    **dict.fromkeys(("profile", "interval", "i", "software", "s"), ("timer or event", _CODE)),
    **dict.fromkeys(("hardware", "h", "iter", "it"), ("perf or BPF event", _CODE)),
}


def read_spelling(text: str) -> str:
    """``text`` as our probe line: a peer's spelling rewritten (module docstring), anything
    else unchanged; a SpecError (column 0) for a probe type we do not have."""
    m = _UPROBE.match(text)
    if m is not None:
        kind, rest = m.groups()
        return f"{'r' if kind in ('uretprobe', 'ur') else 'p'} {_libc(rest)}"
    m = _BCC.match(text)
    if m is not None:
        kind, module, rest = m.groups()
        if not module:
            raise SpecError(
                f"{kind}::FUNC is bcc's kernel function; here that is "
                f"kprobes --kernel '{kind} {rest}'",
                column=0,
                text=text,
            )
        return f"{kind} {_libc(f'{module}:{rest}')}"
    word = text.strip().split(" ", 1)[0]
    kind, colon, _ = word.partition(":")
    if colon and kind in _NOT_OURS and not _is_kernel_event(text):
        what, instead = _NOT_OURS[kind]
        raise SpecError(
            f"'{kind}:' is bpftrace's {what} probe, which kprobes does not have",
            column=0,
            text=text,
            hint=instead,
        )
    return _libc(text)


def read_glob(text: str) -> str:
    """A glob in a peer's spelling (``uprobe:/bin/prog:work*``, ``c:str*``) as ours
    (``/bin/prog:work*``, ``libc:str*``); anything else unchanged."""
    line = read_spelling(text)
    return line[2:] if line != text and line.startswith("p ") else line


def _libc(text: str) -> str:
    """bcc's ``c`` is libc."""
    return _LIBC.sub("libc:", text.lstrip(), count=1)


def _is_kernel_event(text: str) -> bool:
    """``p:EVENT LOCATION``, the kernel's grammar: ``p`` with an event name and a space."""
    return bool(re.match(r"^\s*[pr]\d*:\S+\s+\S", text))
