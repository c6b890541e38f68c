"""Probe definition lines of ``kprobe_events`` and ``uprobe_events``: made, read and checked.

``probe_line`` is the one place where a probe becomes a line of the kernel's grammar
(``reference/tracefs-grammar.md``)::

    p[:GRP/EVENT] PLACE [ARG...]          r[MAXACTIVE][:GRP/EVENT] PLACE [ARG...]

Lines users write (``Kernel.add("r:vfs_read $retval")``) are parsed by ``kprobes.spec``, which
knows the whole grammar and says at which column a line is wrong; the head and place of the
line we write are ``spec.render``'s. Lines the kernel lists back (``kprobe_events``, the
profiles) are only read for their names (``line_names``): they may hold syntax of a newer
kernel, or another tool's.

``Features`` reads the running kernel's tracefs ``README`` (the grammar it prints for itself)
so that a fetch-arg type or variable the kernel lacks is refused with a sentence naming it,
before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from kprobes.errors import ProbeRejected
from kprobes.spec import (
    AddressLocation,
    Command,
    FileOffsetLocation,
    Location,
    ProbeSpec,
    SymbolLocation,
    render,
)
from kprobes.values import dataclass

EVENT_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
MAX_EVENT_NAME: Final = 64  # the kernel's MAX_EVENT_NAME_LEN
MAXACTIVE_MAX: Final = 4096  # KRETPROBE_MAXACTIVE_MAX


_NAMES: Final = re.compile(r"\s*[pr]\d*:(?:([^/\s]*)/)?(\S+)")


def line_names(text: str) -> tuple[str, str] | None:
    """(group, event) of a definition line as the kernel lists it (``p:GRP/EVENT ...``).

    Lines the kernel prints are read for their names only, never parsed whole: a newer kernel
    may list fetch-args that ``kprobes.spec`` does not know, and another tool's line must not
    stop us from finding our own.
    """
    m = _NAMES.match(text)
    if m is None:
        return None
    return m.group(1) or "", m.group(2)


def probe_line(
    command: Command,
    group: str,
    event: str,
    location: Location,
    args: Sequence[str] = (),
    *,
    maxactive: int = 0,
) -> str:
    """The definition line for one probe: the only place where such lines are composed.

    The head and the place are ``kprobes.spec.render``'s; the fetch-args are passed as the
    user wrote them (the kernel parses them, and its error_log points into them).
    """
    if command is Command.DELETE:
        raise ValueError("a removal is removal_line(), not a probe")
    head = ProbeSpec(
        command,
        location,
        group=group,
        event=event,
        maxactive=maxactive if command is Command.RETPROBE else 0,
    )
    return " ".join((render(head), *args))


def profile_counts(
    definitions: Sequence[str], rows: Sequence[str], group: str
) -> dict[str, tuple[int, int]] | None:
    """event → (hits, misses) of ``group`` from ``kprobe_profile``/``uprobe_profile`` rows.

    A row names its event without the group (``  EVENT  HITS  MISSES``, or ``  PATH EVENT
    HITS`` for uprobes), so rows are paired with the definitions file's lines by position:
    both list the same events in the same order. None if the two do not line up (an event
    came or went between the reads).
    """
    if len(definitions) != len(rows):
        return None
    counts: dict[str, tuple[int, int]] = {}
    for definition, row in zip(definitions, rows, strict=True):
        names = line_names(definition)
        if names is None:
            continue
        line_group, event = names
        words = row.split()
        if event not in words:
            return None
        if line_group != group:
            continue
        numbers = [int(w) for w in words[words.index(event) + 1 :] if w.isdigit()]
        counts[event] = (numbers[0] if numbers else 0, sum(numbers[1:2]))
    return counts


def removal_line(group: str, event: str) -> str:
    return f"-:{group}/{event}"


def event_name_for(kind: str, where: str, taken: set[str] | frozenset[str]) -> str:
    """A free event name in the kernel's own style: ``p_vfs_read_0``, ``r_malloc_0``, ..."""
    stem = re.sub(r"[^A-Za-z0-9_]", "_", f"{kind}_{where}").strip("_")[: MAX_EVENT_NAME - 8]
    if not stem or stem[0].isdigit():
        stem = f"{kind}_{stem}"
    name, n = stem, 1
    while name in taken:
        n += 1
        name = f"{stem}_{n}"
    return name


def kernel_location(symbol: str | None, offset: int, addr: int | None) -> Location:
    """``[MOD:]SYM[+OFFS]`` or ``0xADDR`` of ``kprobe_events``, as a spec location."""
    if symbol:
        module, sep, name = symbol.rpartition(":")
        return SymbolLocation(name, offset, module if sep else None)
    if addr is None:
        raise ValueError("a kernel probe needs a symbol or an address")
    return AddressLocation(addr + offset)


def uprobe_location(path: str, file_offset: int) -> FileOffsetLocation:
    """``PATH:0xOFFSET`` of ``uprobe_events``; ``r:`` marks returns, never ``%return``."""
    if any(c.isspace() for c in path):
        raise ProbeRejected(f"uprobe_events cannot name a path with spaces: {path!r}")
    return FileOffsetLocation(path, file_offset)


# -- what the running kernel accepts --------------------------------------------------------

_TYPES_DEFAULT: Final = frozenset(
    {"s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64", "x8", "x16", "x32", "x64"}
    | {"string", "char", "symbol", "ustring", "symstr", "%pd", "%pD", "bitfield"}
)


@dataclass(frozen=True, slots=True)
class Features:
    """What the kernel's tracefs README says it accepts in fetch-args."""

    types: frozenset[str]
    variables: frozenset[str]  # "$retval", "$comm", "$arg", "$stack", "$current", ...
    return_variables: frozenset[str]  # allowed in kretprobes besides $retval
    has_arrays: bool

    @classmethod
    def from_readme(cls, text: str) -> Features:
        types: set[str] = set()
        for word in _readme_item(text, "type").split(","):
            word = word.strip()
            sized = re.fullmatch(r"([sux])8/16/32/64", word)
            if sized:
                types.update(f"{sized.group(1)}{n}" for n in (8, 16, 32, 64))
            elif word.startswith("b<"):
                types.add("bitfield")
            elif word.startswith("%p"):
                types.update(w for w in word.split("/") if w)
            elif re.fullmatch(r"[a-z]+", word):
                types.add(word)
        returns = _readme_item(text, "kernel return probes support")
        return cls(
            types=frozenset(types) or _TYPES_DEFAULT,
            variables=frozenset(re.findall(r"\$[a-z]+", _readme_item(text, "fetcharg"))),
            return_variables=frozenset(re.findall(r"\$[a-z]+", returns)),
            has_arrays="array-size" in text,
        )

    def check_arg(self, arg: str, *, is_return: bool, is_kernel: bool) -> str | None:
        """Why the running kernel would refuse fetch-arg ``arg``; None if it looks accepted."""
        _, _, fetch = arg.rpartition("=") if "=" in arg.split(":")[0] else ("", "", arg)
        body, _, typ = fetch.partition(":") if not fetch.startswith('\\"') else (fetch, "", "")
        if typ:
            base = typ.split("[")[0]
            if "[" in typ and not self.has_arrays:
                return f"this kernel has no array types ({typ!r})"
            if re.fullmatch(r"b\d+@\d+/\d+", base):
                base = "bitfield"
            if base not in self.types:
                known = ", ".join(sorted(self.types))
                return f"this kernel does not know the fetch-arg type {typ!r} (it has: {known})"
        for var in re.findall(r"\$[a-z]+", body):
            if var == "$retval":
                if not is_return:
                    return "$retval is only for return probes"
                continue
            if self.variables and var not in self.variables:
                known = ", ".join(sorted(self.variables))
                return f"this kernel does not know {var} (its fetch-args: {known})"
            if (
                is_return
                and is_kernel
                and self.return_variables
                and var not in (*self.return_variables, "$stack")
            ):
                return f"this kernel's return probes do not support {var}"
        return None


def _readme_item(text: str, key: str) -> str:
    """The value of ``key:`` in the README, with its continuation lines (which hold no colon)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(key + ":"):
            parts = [stripped[len(key) + 1 :]]
            for more in lines[i + 1 :]:
                if ":" in more or not more.strip():
                    break
                parts.append(more.strip())
            return " ".join(parts)
    return ""
