"""The ``kprobes`` command: one module per subcommand; the only place that prints.

Every ``ProbeError`` is caught here, in one place, and becomes a message on stderr and an exit
code: 2 for bad usage or a bad spec, 1 for any other failure. An ``InternalError`` is a bug of
ours, about which the user can do nothing but tell us: it is said so, with what a report needs
(version, command line, the message and where it was raised), never as a bare line that reads
like the user's mistake.

SIGINT ends every command as Ctrl-C does, even one started with SIGINT ignored (``sigint.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any

from kprobes import __version__
from kprobes.cli import startup
from kprobes.cli.sigint import sigint_ends_command
from kprobes.errors import InternalError, ProbeError, SpecError, TraceFsError

EXIT_FAILURE = 1
EXIT_USAGE = 2


# Each command's module, and its line in ``kprobes --help``. Only the module of the command
# given is imported: ``kprobes --help`` and ``--version`` import none of them (the ptrace
# engine, the x86 decoder and the ELF reader are half a second of imports).
COMMANDS: dict[str, tuple[str, str]] = {
    "list": (
        "kprobes.cli.list_cmd",
        "list the probes placed in a traced process, or the kernel's; -l: the functions "
        "that can be probed",
    ),
    "run": (
        "kprobes.cli.run_cmd",
        "run an instrumentation module: a Python file with init(target) and exit(target)",
    ),
    "trace": ("kprobes.cli.trace_cmd", "print each probe hit (ftrace format or --json)"),
    "record": (
        "kprobes.cli.record_cmd",
        "write every probe hit to a file, as fast as the program makes them (perf record)",
    ),
    "script": (
        "kprobes.cli.script_cmd",
        "print a record file's events as trace would have (perf script); counts, histograms",
    ),
    "report": (
        "kprobes.cli.report_cmd",
        "sum a record file up: events per probe, a value's histogram, latencies (perf report)",
    ),
    "count": ("kprobes.cli.count_cmd", "count hits per probe (funccount)"),
    "stackcount": (
        "kprobes.cli.stackcount_cmd",
        "count hits per user stack (bcc's stackcount); folded stacks and flame graphs",
    ),
    "latency": (
        "kprobes.cli.latency_cmd",
        "histogram of a function's call durations (funclatency)",
    ),
    "hist": ("kprobes.cli.hist_cmd", "frequency table or log2 histogram of a fetched value"),
}


def terminal_columns() -> int:
    """``shutil.get_terminal_size().columns``: $COLUMNS, else the terminal's, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0 and sys.__stdout__ is not None:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, its width found without importing ``shutil``: argparse makes a formatter
    for every argument added, and ``shutil`` (with ``bz2``, ``lzma``, ``fnmatch``) is ~4 ms
    of a command's start that nothing else of ``count -c`` imports."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        width = terminal_columns() - 2 if width is None else width
        super().__init__(prog, indent_increment, max_help_position, width)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, with ``HelpFormatter`` unless told otherwise (the subcommands' parsers
    are of the root's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser, with the full arguments of the command ``argv`` names (if any)."""
    parser = ArgumentParser(prog="kprobes", description="Kprobes for live x86-64 Linux processes.")
    parser.add_argument("--version", action="version", version=f"kprobes {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module, help) in COMMANDS.items():
        if name == chosen:
            import_module(module).add_parser(sub, help)
        else:
            sub.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    try:
        with sigint_ends_command():
            code: int = args.func(args)
    except SpecError as exc:
        print(f"kprobes: {exc}", file=sys.stderr)
        if exc.text:  # point at the column, as the kernel's error_log does
            print(f"  {exc.text}\n  {' ' * exc.column}^", file=sys.stderr)
        return EXIT_USAGE
    except InternalError as exc:
        print(bug_report(exc, sys.argv[1:] if argv is None else argv), file=sys.stderr, end="")
        return EXIT_FAILURE
    except ProbeError as exc:
        print(f"kprobes: {exc}", file=sys.stderr)
        if isinstance(exc, TraceFsError) and exc.log_line:
            # The kernel's own error_log entry: the command it refused, a caret at the column.
            print("\n".join(exc.log_line.splitlines()[1:]), file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return code


def bug_report(exc: InternalError, argv: Sequence[str]) -> str:
    """What the user reads when kprobes reached a state it should never reach."""
    import platform  # a bug's report alone needs these
    import traceback

    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f"  raised at: {last.filename}:{last.lineno} in {last.name}\n"
    return (
        f"kprobes: internal error: {exc}\n"
        "This is a bug in kprobes, not a mistake of yours. Please report it, with these "
        "details:\n"
        f"  version:   kprobes {__version__}, Python {platform.python_version()}, "
        f"Linux {platform.release()}\n"
        f"  command:   {shlex.join(['kprobes', *argv])}\n"
        f"  message:   {exc}\n"
        f"{where}"
    )


def entry() -> None:
    """The console script: the tool in a process of its own."""
    startup.own_process()
    sys.exit(main())


if __name__ == "__main__":
    entry()
