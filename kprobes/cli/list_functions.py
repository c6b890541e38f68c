"""``kprobes list -l``: the functions a command could probe, as bpftrace -l, funccount -l and
perf probe -F list them.

    kprobes list -l [PATTERN] -p PID     the functions of the files process PID maps
    kprobes list -l [PATTERN] -c CMD     the files CMD would map when it starts (not run)
    kprobes list -l [GLOB] PATH          the functions of one ELF file (or PATH:GLOB)

PATTERN is ``[MODULE:]GLOB`` as ``count`` takes it (MODULE a path, a basename or a short
name like ``libc``; without it, the executable), in our spelling or a peer's
(``uprobe:/bin/bash:read*``, ``c:str*``). Each probeable function is printed on a line of
its own in the spelling ``count`` takes back (``libc:strlen``, a bare name for the
executable's, ``/path/file:name`` for a PATH), sorted by name, so that
``kprobes list -l 'libc:str*' -p PID | xargs kprobes count -p PID`` counts them. A function
that can only take a breakpoint is listed: it can be probed, at a trap per hit. The
functions registration would refuse are said on stderr in one line, by reason; ``-v`` lists
every function with how it would be probed (``jump``, ``breakpoint: WHY``, ``ifunc: ...``,
``refused: WHY``), ``--json`` does so as one object a line.

Nothing is stopped or traced: the process's files are found in /proc/PID/maps and judged
from their bytes on disk (process/probeable.py).
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kprobes.cli.notes import summarise
from kprobes.cli.spellings import read_glob
from kprobes.cli.targets import command_argv
from kprobes.errors import SymbolNotFound, TargetError
from kprobes.process.probeable import FileJudge, Verdict
from kprobes.symbols.elf import ElfImage
from kprobes.symbols.resolve import SymbolResolver
from kprobes.tracefs.programfiles import ProgramFiles, find_command

_NAME_WIDTH = 40  # -v pads names to the longest, up to this


@dataclass(frozen=True, slots=True)
class _Source:
    """One file whose functions are listed, and how its names are written."""

    image: ElfImage
    path: str  # as the messages name it
    prefix: str  # "libc:", "/path/file:" or "" (the executable's)
    bias: int  # file address -> the address the reasons show


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-l",
        "--functions",
        action="store_true",
        help="list the functions that can be probed (bpftrace -l, funccount -l, perf probe -F)",
    )
    p.add_argument(
        "words",
        nargs="*",
        metavar="PATTERN|PATH",
        help="with -l: [MODULE:]GLOB (default: every function of the executable), and/or "
        "the ELF file to list instead of a process (PATH, or PATH:GLOB)",
    )
    p.add_argument("-c", "--command", metavar="CMD", help="with -l: the files CMD maps at start")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="with -l: every function with how it would be probed, or why it cannot be",
    )
    p.add_argument("--json", action="store_true", help="one JSON object a line")


def run(args: argparse.Namespace) -> int:
    if args.backend != "ptrace":
        raise TargetError(
            "list -l judges functions for kprobes' own mechanism; the kernel's uprobes and "
            "kprobes judge a probe when it is enabled (leave out --backend and --kernel)",
            errno=errno.EINVAL,
        )
    source, glob = _source(args)
    names = sorted(
        {s.name for s in source.image.iter_functions() if fnmatch.fnmatchcase(s.name, glob)}
    )
    if not names:
        raise SymbolNotFound(_no_match(source, glob))
    how = args.verbose or args.json
    no_jump = "--no-optimize" if args.no_optimize else ""
    with FileJudge(source.image, source.path, bias=source.bias, no_jump=no_jump) as judge:
        verdicts = list(judge.iter_verdicts(names, how=how))
    shown = verdicts if args.verbose else [v for v in verdicts if v.how.is_probeable]
    sys.stdout.write(_render(shown, source, as_json=args.json, verbose=args.verbose))
    refused = [(source.prefix + v.name, v.why) for v in verdicts if not v.how.is_probeable]
    if not args.verbose:
        lines = summarise(
            refused,
            one="cannot be probed",
            many="cannot be probed",
            verbose=False,
            noun="functions",
        )
        for line in lines:
            print(f"kprobes: {line}", file=sys.stderr)
    return 0 if len(refused) < len(verdicts) else 1


def _no_match(source: _Source, glob: str) -> str:
    """Why nothing is listed: the glob, or a file whose symbol tables have no function."""
    tables = ", ".join(source.image.tables) or "no symbol table"
    if glob != "*":
        return f"no function of {source.path} matches {glob!r} (searched {tables})"
    hint = (
        ""
        if ".symtab" in source.image.tables
        else (
            "; the file is stripped: its own functions have no names (a library's are "
            "listed as MODULE:GLOB, as 'libc:*')"
        )
    )
    return f"no function in {source.path} (searched {tables}){hint}"


def _source(args: argparse.Namespace) -> tuple[_Source, str]:
    """The file to list and the glob over its function names, from -p, -c or the words."""
    words: list[str] = args.words
    if args.pid is not None or args.command is not None:
        if len(words) > 1:
            raise TargetError(
                f"list -l: one PATTERN with -p or -c, not {len(words)} words", errno=errno.EINVAL
            )
        module, sep, glob = read_glob(words[0] if words else "*").rpartition(":")
        name = module if sep else None
        if args.pid is not None:
            return _of_process(args.pid, name), glob or "*"
        return _of_command(args, name), glob or "*"
    if not words:
        raise TargetError("list -l: give -p PID, -c CMD or an ELF file's PATH", errno=errno.EINVAL)
    if len(words) > 2:
        raise TargetError(f"list -l: [GLOB] PATH, not {len(words)} words", errno=errno.EINVAL)
    path, glob = _path_and_glob(words)
    image = ElfImage.open(path)
    absolute = os.path.abspath(path)
    return _Source(image, absolute, f"{absolute}:", 0), glob


def _path_and_glob(words: Sequence[str]) -> tuple[str, str]:
    """``PATH``, ``GLOB PATH`` or ``PATH:GLOB`` (also as ``uprobe:PATH:GLOB``)."""
    if len(words) == 2:
        glob, path = words
        if ":" in glob:
            raise TargetError(
                f"list -l {glob} PATH: with a PATH the pattern is a GLOB over its functions, "
                "with no MODULE:",
                errno=errno.EINVAL,
            )
        return path, glob
    word = words[0]
    if os.path.exists(word):
        return word, "*"
    path, sep, glob = read_glob(word).rpartition(":")
    if sep and "/" in path:
        return path, glob or "*"
    return word, "*"


def _of_process(pid: int, module: str | None) -> _Source:
    resolver = SymbolResolver(pid)
    found = resolver.main_module() if module is None else resolver.find_module(module)
    prefix = "" if module is None else f"{module}:"
    return _Source(found.image, found.path, prefix, found.bias)


def _of_command(args: argparse.Namespace, module: str | None) -> _Source:
    argv = command_argv(args)
    files = ProgramFiles.of_command(find_command(argv[0], os.environ), os.environ)
    file = files.main if module is None else files.find(module)
    prefix = "" if module is None else f"{module}:"
    return _Source(file.image, file.path, prefix, 0)


def _render(verdicts: list[Verdict], source: _Source, *, as_json: bool, verbose: bool) -> str:
    if as_json:
        return "".join(json.dumps(_json_row(v, source)) + "\n" for v in verdicts)
    if not verbose:
        return "".join(f"{source.prefix}{v.name}\n" for v in verdicts)
    width = min(_NAME_WIDTH, max(len(source.prefix + v.name) for v in verdicts))
    lines = []
    for v in verdicts:
        note = f"{v.how.value}: {v.why}" if v.why else v.how.value
        lines.append(f"{source.prefix + v.name:<{width}}  {note}\n")
    return "".join(lines)


def _json_row(v: Verdict, source: _Source) -> dict[str, object]:
    symbol = source.image.lookup(v.name)
    return {
        "probe": source.prefix + v.name,
        "how": v.how.value,
        "why": v.why,
        "addr": source.bias + symbol.value if symbol is not None else None,
        "size": symbol.size if symbol is not None else None,
        "file": source.path,
    }
