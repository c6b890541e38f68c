"""``kprobes list -l``: the functions a command could probe, as bpftrace -l, funccount -l and
perf probe -F list them.

    kprobes list -l [PATTERN] -p PID     the functions of the files process PID maps
    kprobes list -l [PATTERN] -c CMD     the files CMD would map when it starts (not run)
    kprobes list -l [GLOB] PATH          the functions of one ELF file (or PATH:GLOB, or
                                         -x PATH as perf probe -F -x PATH)

PATTERN is ``[MODULE:]GLOB`` as ``count`` takes it (MODULE a path, a basename or a short
name like ``libc``; without it, the executable), in our spelling or a peer's
(``uprobe:/bin/bash:read*``, ``c:str*``); a MODULE with a glob (``'*:malloc'``) lists every
file whose basename it matches, as bpftrace's ``uprobe:*:malloc`` with ``-p``. Each probeable
function is printed on a line of its own in the spelling ``count`` takes back
(``libc:strlen``; a bare name for the executable's; ``libc.so.6:strlen`` for a MODULE glob,
the path where two files share a basename; ``/path/file:name`` for a PATH), sorted, so that
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
from collections import Counter
from collections.abc import Sequence

from kprobes.cli.notes import summarise
from kprobes.cli.session import exec_file
from kprobes.cli.spellings import read_glob
from kprobes.cli.targets import command_argv
from kprobes.errors import NotMapped, SymbolNotFound, TargetError
from kprobes.process.probeable import FileJudge, Verdict
from kprobes.symbols.elf import ElfImage
from kprobes.symbols.resolve import SymbolResolver
from kprobes.tracefs.programfiles import ProgramFiles, find_command
from kprobes.values import dataclass

_NAME_WIDTH = 40  # -v pads names to the longest, up to this
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True, slots=True)
class _Source:
    """One file whose functions are listed, and how its names are written."""

    image: ElfImage
    path: str  # as the messages name it
    prefix: str  # "libc:", "/path/file:" or "" (the executable's)
    bias: int  # file address -> the address the reasons show
    read_from: str | None = None  # where its bytes are read now (None: the image's path)


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
        "-x",
        "--exec",
        metavar="PATH",
        help="with -l: the functions of the file PATH (perf probe -F -x PATH); with -p or -c, "
        "as that process or command maps it",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="with -l: every function with how it would be probed, or why it cannot be",
    )
    p.add_argument("--json", action="store_true", help="one JSON object a line")


def run(args: argparse.Namespace) -> int:
    """Print the functions; 1 when none of those the pattern matched can be probed."""
    if args.backend != "ptrace":
        raise TargetError(
            "list -l judges functions for kprobes' own mechanism; the kernel's uprobes and "
            "kprobes judge a probe when it is enabled (leave out --backend and --kernel)",
            errno=errno.EINVAL,
        )
    sources, glob = _sources(args)
    how = args.verbose or args.json
    no_jump = "--no-optimize" if args.no_optimize else ""
    judged: list[tuple[_Source, Verdict]] = []
    for source in sources:
        found = {s.name for s in source.image.iter_functions() if fnmatch.fnmatchcase(s.name, glob)}
        with FileJudge(
            source.image,
            source.path,
            bias=source.bias,
            no_jump=no_jump,
            read_from=source.read_from,
        ) as judge:
            judged += [(source, v) for v in judge.iter_verdicts(sorted(found), how=how)]
    if not judged:
        raise SymbolNotFound(_no_match(sources, glob))
    shown = [(s, v) for s, v in judged if args.verbose or v.how.is_probeable]
    sys.stdout.write(_render(shown, as_json=args.json, verbose=args.verbose))
    refused = [(s.prefix + v.name, v.why) for s, v in judged if not v.how.is_probeable]
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
    return 0 if len(refused) < len(judged) else 1


def _no_match(sources: Sequence[_Source], glob: str) -> str:
    """Why nothing is listed: the glob, or files whose symbol tables have no function."""
    if len(sources) > 1:
        return f"no function of {len(sources)} files matches {glob!r}"
    source = sources[0]
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


def _sources(args: argparse.Namespace) -> tuple[list[_Source], str]:
    """The files to list and the glob over their function names, from -p, -c or the words."""
    words: list[str] = args.words
    exe = exec_file(args)
    if args.pid is not None and args.command is not None:
        raise TargetError("list -l: -p PID or -c CMD, not both", errno=errno.EINVAL)
    if args.pid is not None or args.command is not None:
        if len(words) > 1:
            raise TargetError(
                f"list -l: one PATTERN with -p or -c, not {len(words)} words", errno=errno.EINVAL
            )
        pattern = read_glob(words[0] if words else "*")
        if exe is not None and ":" not in pattern:  # -x PATH: a bare glob is one of PATH
            pattern = f"{exe}:{pattern}"
        module, sep, glob = pattern.rpartition(":")
        name = module if sep else None
        if args.pid is not None:
            return _of_process(args.pid, name), glob or "*"
        return _of_command(args, name), glob or "*"
    if exe is not None:
        words = [*words, exe]
    if not words:
        raise TargetError("list -l: give -p PID, -c CMD or an ELF file's PATH", errno=errno.EINVAL)
    if len(words) > 2:
        raise TargetError(f"list -l: [GLOB] PATH, not {len(words)} words", errno=errno.EINVAL)
    path, glob = _path_and_glob(words)
    image = ElfImage.open(path)
    absolute = os.path.abspath(path)
    return [_Source(image, absolute, f"{absolute}:", 0, path)], glob


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


def _of_process(pid: int, module: str | None) -> list[_Source]:
    resolver = SymbolResolver(pid)
    if module is None:
        found = resolver.main_module()
        return [_Source(found.image, found.path, "", found.bias, _inside(pid, found.path))]
    if not _GLOB_CHARS & set(module):
        found = resolver.find_module(module)
        return [
            _Source(found.image, found.path, f"{module}:", found.bias, _inside(pid, found.path))
        ]
    matched = {m.path: m for m in resolver.modules() if fnmatch.fnmatchcase(m.name, module)}
    if not matched:
        mapped = ", ".join(sorted({m.name for m in resolver.modules()}))
        raise NotMapped(
            f"no module matching {module!r} is mapped in process {pid} (mapped: {mapped})"
        )
    prefixes = _prefixes(list(matched))
    return [
        _Source(m.image, m.path, prefixes[m.path], m.bias, _inside(pid, m.path))
        for m in matched.values()
    ]


def _inside(pid: int, path: str) -> str:
    """The file as process ``pid`` sees it (its mount namespace), else as we do."""
    inside = f"/proc/{pid}/root{path}"
    return inside if os.path.exists(inside) else path


def _of_command(args: argparse.Namespace, module: str | None) -> list[_Source]:
    argv = command_argv(args)
    files = ProgramFiles.of_command(find_command(argv[0], os.environ), os.environ)
    if module is None:
        return [_Source(files.main.image, files.main.path, "", 0, files.main.path)]
    if not _GLOB_CHARS & set(module):
        file = files.find(module)
        return [_Source(file.image, file.path, f"{module}:", 0, file.path)]
    matched = [f for f in files.files if fnmatch.fnmatchcase(f.name, module)]
    if not matched:
        names = ", ".join(f.name for f in files.files)
        raise SymbolNotFound(
            f"no file matching {module!r} among those {files.main.name} maps when it starts "
            f"({names})"
        )
    prefixes = _prefixes([f.path for f in matched])
    return [_Source(f.image, f.path, prefixes[f.path], 0, f.path) for f in matched]


def _prefixes(paths: Sequence[str]) -> dict[str, str]:
    """How each file is named in front of its functions when a MODULE glob matched them: its
    basename, which ``count`` takes back, unless another of them has the same one."""
    basenames = Counter(os.path.basename(path) for path in paths)
    return {
        path: f"{os.path.basename(path) if basenames[os.path.basename(path)] == 1 else path}:"
        for path in paths
    }


def _render(judged: list[tuple[_Source, Verdict]], *, as_json: bool, verbose: bool) -> str:
    if as_json:
        return "".join(json.dumps(_json_row(s, v)) + "\n" for s, v in judged)
    if not verbose:
        return "".join(f"{s.prefix}{v.name}\n" for s, v in judged)
    width = min(_NAME_WIDTH, max((len(s.prefix + v.name) for s, v in judged), default=0))
    lines = []
    for s, v in judged:
        note = f"{v.how.value}: {v.why}" if v.why else v.how.value
        lines.append(f"{s.prefix + v.name:<{width}}  {note}\n")
    return "".join(lines)


def _json_row(source: _Source, v: Verdict) -> dict[str, object]:
    symbol = source.image.lookup(v.name)
    return {
        "probe": source.prefix + v.name,
        "how": v.how.value,
        "why": v.why,
        "addr": source.bias + symbol.value if symbol is not None else None,
        "size": symbol.size if symbol is not None else None,
        "file": source.path,
    }
