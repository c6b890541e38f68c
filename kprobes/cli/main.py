"""The ``kprobes`` command: one module per subcommand; the only place that prints.

Every ``ProbeError`` is caught here, in one place, and becomes one line on stderr and an exit
code: 2 for bad usage or a bad spec, 1 for any other failure.

SIGINT ends every command as Ctrl-C does, even one started with SIGINT ignored (``sigint.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kprobes.cli import count_cmd, hist_cmd, latency_cmd, list_cmd, run_cmd, trace_cmd
from kprobes.cli.sigint import sigint_ends_command
from kprobes.errors import ProbeError, SpecError, TraceFsError

EXIT_FAILURE = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kprobes", description="Kprobes for live x86-64 Linux processes."
    )
    parser.add_argument("--version", action="version", version="kprobes 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True)
    list_cmd.add_parser(sub)
    run_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    count_cmd.add_parser(sub)
    latency_cmd.add_parser(sub)
    hist_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with sigint_ends_command():
            code: int = args.func(args)
    except SpecError as exc:
        print(f"kprobes: {exc}", file=sys.stderr)
        if exc.text:  # point at the column, as the kernel's error_log does
            print(f"  {exc.text}\n  {' ' * exc.column}^", file=sys.stderr)
        return EXIT_USAGE
    except ProbeError as exc:
        print(f"kprobes: {exc}", file=sys.stderr)
        if isinstance(exc, TraceFsError) and exc.log_line:
            # The kernel's own error_log entry: the command it refused, a caret at the column.
            print("\n".join(exc.log_line.splitlines()[1:]), file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
