"""A probe line of ``kprobe_events`` / ``uprobe_events`` → ``ProbeSpec``, or a ``SpecError``.

The kernel has two parsers (trace_kprobe.c and trace_uprobe.c) behind one file each; we accept
both syntaxes in one function, told apart the way ``dynamic_events`` tells them apart: a
location with both ``/`` and ``:`` is a uprobe ``PATH:...``, anything else is kernel-style.
Beyond the kernel we accept ``LIB:SYM[+OFF]`` (``libc:malloc``) and ``PATH:SYM[+OFF]``, which
the Process target resolves itself; ``LIB:SYM`` is shaped like ``MOD:SYM`` and is treated as
kernel-style (group ``kprobes``).

Steps run in the kernel's order (command, location, names, argument count, arguments), and
each error carries the kernel's ``error_log`` message and the 0-based column in *our* text
(the kernel counts in its re-joined ``argv``, which differs when words are separated by more
than one space).

Deliberately not accepted: ``GROUP.EVENT`` names (a newer alternative to ``GROUP/EVENT``),
BTF arguments (``$arg*``, ``var->field``), ``$current``, ``fprobe``/``tprobe``/``eprobe``
lines, and arguments after a delete command.
"""

from __future__ import annotations

from kprobes.errors import SpecError
from kprobes.spec.fetchargs import ArgContext, is_symbol, parse_arg
from kprobes.spec.lexical import (
    MAX_EVENT_NAME_LEN,
    U32_MAX,
    Word,
    is_good_group_name,
    is_good_name,
    parse_signed,
    parse_unsigned,
    spec_error,
    split_words,
)
from kprobes.spec.types import (
    AddressLocation,
    Command,
    FileOffsetLocation,
    Location,
    ProbeArg,
    ProbeSpec,
    SymbolLocation,
)
from kprobes.values import replace

MAX_TRACE_ARGS = 128
KRETPROBE_MAXACTIVE_MAX = 4096

_MODULE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")


def parse(text: str) -> ProbeSpec:
    """Parse one probe definition line; raise ``SpecError`` with the column of the fault."""
    return _LineParser(text).parse()


class _LineParser:
    def __init__(self, text: str) -> None:
        self.text = text

    def error(self, message: str, column: int) -> SpecError:
        return spec_error(message, column, self.text)

    def parse(self) -> ProbeSpec:
        words = split_words(self.text)
        if not words:
            raise self.error("Probe definition is empty", 0)
        cmd = words[0]
        if cmd.text[0] == "-":
            return self._delete(words)
        if cmd.text[0] not in "pr":
            raise self.error("Unknown probe command", cmd.column)
        command = Command.RETPROBE if cmd.text[0] == "r" else Command.PROBE
        head, colon, names = cmd.text.partition(":")
        # Step 1: the command and its MAXACTIVE.
        maxactive = self._maxactive(head, command, cmd.column)
        # Step 2: the location.
        if len(words) < 2:
            raise self.error("Probe point is not specified", cmd.end)
        location, has_suffix = self._location(words[1], command is Command.RETPROBE)
        if maxactive and isinstance(location, FileOffsetLocation):
            raise self.error("Maxactive is not for uprobe", cmd.column + 1)
        # Step 3: the names.
        group, event = None, None
        if colon:
            group, event = self._names(names, cmd.column + len(head) + 1)
        spec = ProbeSpec(
            command=command,
            location=location,
            group=group,
            event=event,
            maxactive=maxactive,
            has_return_suffix=has_suffix,
        )
        # Step 4: the arguments, which depend on what kind of probe this is.
        return replace(spec, args=self._args(words[2:], spec))

    def _maxactive(self, head: str, command: Command, column: int) -> int:
        """``r[MAXACTIVE]``: 1..4096; a digit after ``p`` is the kernel's BAD_MAXACT_TYPE."""
        if len(head) == 1:
            return 0
        if not head[1].isdigit():
            raise self.error("Unknown probe command", column)
        if command is Command.PROBE:
            raise self.error("Maxactive is only for function exit", column + 1)
        value = parse_unsigned(head[1:], limit=U32_MAX)
        if len(head) > MAX_EVENT_NAME_LEN or not value:
            raise self.error("Invalid maxactive number", column + 1)
        if value > KRETPROBE_MAXACTIVE_MAX:
            raise self.error("Maxactive is too big", column + 1)
        return value

    def _names(self, s: str, column: int) -> tuple[str | None, str | None]:
        """``[GROUP/][EVENT]`` (``traceprobe_parse_event_name()``); both at most 63 chars."""
        group: str | None = None
        event, event_col = s, column
        slash = s.find("/")
        if slash >= 0:
            group = s[:slash]
            if not group:
                raise self.error("Group name is not specified", column)
            if len(group) >= MAX_EVENT_NAME_LEN:
                raise self.error("Group name is too long", column)
            if not is_good_group_name(group):
                raise self.error("Group name must follow the same rules as C identifiers", column)
            event, event_col = s[slash + 1 :], column + slash + 1
            if not event:
                return group, None
        if not event:
            raise self.error("Event name is not specified", event_col)
        if len(event) >= MAX_EVENT_NAME_LEN:
            raise self.error("Event name is too long", event_col)
        if not is_good_name(event):
            raise self.error("Event name must follow the same rules as C identifiers", event_col)
        return group, event

    def _delete(self, words: list[Word]) -> ProbeSpec:
        """``-:[GROUP/]EVENT``."""
        cmd = words[0]
        if cmd.text[1:2] != ":":
            raise self.error("Unknown probe command", cmd.column)
        group, event = self._names(cmd.text[2:], cmd.column + 2)
        if event is None:
            raise self.error("Event name is not specified", cmd.end)
        if len(words) > 1:
            raise self.error("Too many arguments are specified", words[1].column)
        return ProbeSpec(command=Command.DELETE, group=group, event=event)

    # --- locations ----------------------------------------------------------------------

    def _location(self, word: Word, is_r: bool) -> tuple[Location, bool]:
        """``MEMADDR``, ``PATH:...`` (uprobe) or ``[MOD:]SYM[+OFF][%return]``."""
        s, col = word.text, word.column
        address = parse_unsigned(s)
        if address is not None:
            return AddressLocation(address), False
        if "/" in s and ":" in s:
            return self._file_location(s, col, is_r)
        s, has_suffix = self._return_suffix(s, col)
        module: str | None = None
        if ":" in s:
            module, _, s = s.partition(":")
            if not module or any(c not in _MODULE_CHARS for c in module):
                raise self.error("Invalid probed address or symbol", col)
        symbol, offset = self._symbol_offset(s, col)
        if (is_r or has_suffix) and offset:
            raise self.error("Retprobe address must be an function entry", col)
        return SymbolLocation(symbol, offset, module), has_suffix

    def _return_suffix(self, s: str, col: int) -> tuple[str, bool]:
        pct = s.find("%")
        if pct < 0:
            return s, False
        if s[pct:] != "%return":
            raise self.error("Invalid probed address suffix", col + pct)
        return s[:pct], True

    def _symbol_offset(self, s: str, col: int) -> tuple[str, int]:
        """``traceprobe_split_symbol_offset()``: SYM, then ``+OFF`` within 0..UINT_MAX."""
        cut = min((i for i in (s.find("+"), s.find("-")) if i >= 0), default=len(s))
        symbol, offset_text = s[:cut], s[cut:]
        offset = parse_signed(offset_text) if offset_text[1:2].isdigit() else None
        if offset_text and (offset is None or not 0 <= offset <= U32_MAX):
            raise self.error("Invalid probed address or symbol", col)
        if not is_symbol(symbol):
            raise self.error("Invalid probed address or symbol", col)
        return symbol, offset or 0

    def _file_location(self, s: str, col: int, is_r: bool) -> tuple[Location, bool]:
        """``PATH:OFFSET[%return][(REF_CTR_OFFSET)]`` or ``PATH:SYM[+OFF]...``."""
        ci = s.rfind(":")
        path, rest, rcol = s[:ci], s[ci + 1 :], col + ci + 1
        if "/" not in path:
            raise self.error("Invalid probed address or symbol", col)
        ref: int | None = None
        lp = rest.find("(")
        if lp >= 0:
            rp = rest.find(")", lp)
            if rp < 0:
                raise self.error("Reference counter brace is not closed", rcol + len(rest))
            if rp != len(rest) - 1:
                raise self.error("Reference counter has wrong suffix", rcol + rp + 1)
            ref = parse_unsigned(rest[lp + 1 : rp])
            if ref is None:
                raise self.error("Invalid reference counter offset", rcol + lp + 1)
            rest = rest[:lp]
        rest, has_suffix = self._return_suffix(rest, rcol)
        if not rest or rest[0].isdigit():
            offset = parse_unsigned(rest)
            if offset is None:
                raise self.error("Invalid uprobe offset", rcol)
            return FileOffsetLocation(path, offset, ref), has_suffix
        symbol, sym_offset = self._symbol_offset(rest, rcol)
        if (is_r or has_suffix) and sym_offset:
            raise self.error("Retprobe address must be an function entry", col)
        return SymbolLocation(symbol, sym_offset, path, ref), has_suffix

    # --- arguments ----------------------------------------------------------------------

    def _args(self, words: list[Word], spec: ProbeSpec) -> tuple[ProbeArg, ...]:
        if len(words) > MAX_TRACE_ARGS:
            raise self.error("Too many arguments are specified", words[MAX_TRACE_ARGS].column)
        loc = spec.location
        ctx = ArgContext(
            is_return=spec.is_return,
            is_uprobe=spec.is_uprobe,
            allows_function_args=isinstance(loc, SymbolLocation) and loc.offset == 0,
        )
        used: set[str] = set()
        return tuple(parse_arg(self.text, w, i, used, ctx) for i, w in enumerate(words))
