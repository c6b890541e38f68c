"""The user-stack options of ``trace`` (``-U``/``--stack``) and ``stackcount``, and what each
backend makes of them.

* our own backend (ptrace): each stack is unwound with the unwind tables (``.eh_frame``) of
  the files, in the handler, while the thread is stopped at its breakpoint: right on code
  built without frame pointers. A probe that would be a jump (the fast tier) stays on its
  breakpoint for now, and stderr says so once: the in-program record holds no stack yet
  (docs/decisions.md);
* the kernel's uprobes (``--backend uprobes``): the kernel's ``userstacktrace`` trace option
  in our instance, which follows frame pointers only (a stack through code built without
  them loses frames or gets wrong ones) and keeps at most 8 frames; the output's header and
  ``--help`` say so. Its frames are named in the process's memory map when its events are
  read: a process gone by then (a short ``-c`` command) has its frames as addresses (the
  kernel records no map of it, where perf keeps its mmap records);
* the kernel's kprobes (``--kernel``): refused (a kernel function's user stack is not what
  these commands show).
"""

from __future__ import annotations

import argparse
import errno
import sys

from kprobes.errors import TargetError

STACK_DEPTH = 127  # frames at most, as perf's kernel.perf_event_max_stack
KERNEL_USER_FRAMES = 8  # what the kernel's userstacktrace records (FTRACE_STACK_ENTRIES)

TIER_NOTE = (
    "kprobes: stacks keep every probe on a breakpoint: each stack is unwound while its "
    "thread is stopped, and a jump's record holds no stack yet\n"
)
UPROBES_HEADER = (
    f"# user stacks: the kernel's userstacktrace, which follows frame pointers only (code "
    f"built without them loses frames) and keeps at most {KERNEL_USER_FRAMES} frames\n"
)
BACKENDS_HELP = (
    "our own backend unwinds with the files' unwind tables (.eh_frame: right without frame "
    "pointers) and keeps its probes on breakpoints; --backend uprobes uses the kernel's "
    f"userstacktrace, which follows frame pointers only, at most {KERNEL_USER_FRAMES} frames, "
    "named while the process lives (a process gone before its events are read shows "
    "addresses)"
)


def _depth(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be 1 to 4096, not {value}")
    return value


def add_stack_arguments(parser: argparse.ArgumentParser, *, optional: bool) -> None:
    """``--stack-depth N``, and with ``optional`` ``-U``/``--stack`` (``stackcount`` always
    takes stacks)."""
    if optional:
        parser.add_argument(
            "-U",
            "--stack",
            action="store_true",
            help=f"after each event, its user stack (bcc's -U): {BACKENDS_HELP}",
        )
    parser.add_argument(
        "--stack-depth",
        type=_depth,
        default=STACK_DEPTH,
        metavar="N",
        help=f"frames of a user stack at most (default {STACK_DEPTH}, as perf's)",
    )


def prepare_stacks(args: argparse.Namespace) -> str:
    """Check that the backend can take stacks and set it up to (``args.stack_depth``,
    read by the backends when ``args.stack`` is set); say the tier note on stderr. Returns
    the header line the output opens with ("" for none)."""
    args.stack = True
    if args.backend == "kernel":
        raise TargetError(
            "user stacks are taken on the ptrace and uprobes backends, not with --kernel",
            errno=errno.EINVAL,
        )
    if args.backend == "uprobes":
        return UPROBES_HEADER
    if not getattr(args, "no_optimize", False):
        sys.stderr.write(TIER_NOTE)
    return ""
