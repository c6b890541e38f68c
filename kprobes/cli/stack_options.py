"""The user-stack options of ``trace`` (``-U``/``--stack``) and ``stackcount``, and what each
backend makes of them.

* our own backend (ptrace): each stack is unwound with the unwind tables (``.eh_frame``) of
  the files: ``trace``'s entry probes that take a jump (the fast tier) walk it in the
  program, over compact tables compiled from them (process/fast/frametables.py), and the
  others unwind it in the handler, while the thread is stopped at its breakpoint; right on
  code built without frame pointers either way. ``stackcount``'s entry probes on jumps
  count their hits by stack in the program, with no record per hit
  (process/fast/stackcounts.py). A walk goes through the frames of return probes that
  take a jump (their shadow stacks hold the real return addresses), and their records
  carry the caller's stack; where a return probe keeps its breakpoint, every probe of the
  process goes back to breakpoints. With a return spec in ``stackcount``, and for
  ``stackcount -n`` or ``--filter`` (each hit an event: a record could be dropped where
  a count must be exact), every probe stays on its breakpoint. stderr says so once
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
    "thread is stopped ({why})\n"
)
WHY_RETURNS = "a return's stack is not counted in the program (only a record could take it)"
WHY_TRAP_RETURNS = (
    "a return probe keeps its breakpoint, and a jump's walk does not see through its trampoline"
)
WHY_COUNTS = "-n and --filter take each hit as an event, and a jump's record may be dropped"
UPROBES_HEADER = (
    f"# user stacks: the kernel's userstacktrace, which follows frame pointers only (code "
    f"built without them loses frames) and keeps at most {KERNEL_USER_FRAMES} frames\n"
)
BACKENDS_HELP = (
    "our own backend unwinds with the files' unwind tables (.eh_frame: right without frame "
    "pointers), in the program where a probe takes a jump (not for stackcount's return "
    "specs, -n or --filter: then on breakpoints); --backend uprobes uses the kernel's "
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


def prepare_stacks(args: argparse.Namespace, *, on_traps: str = "") -> str:
    """Check that the backend can take stacks and set it up to (``args.stack_depth``,
    read by the backends when ``args.stack`` is set; ``args.fast_stacks``: walked in the
    program where a probe takes a jump, unless ``on_traps`` says why not, which the tier
    note on stderr then says). Returns the header line the output opens with ("" for
    none)."""
    args.stack = True
    args.fast_stacks = not on_traps
    if args.backend == "kernel":
        raise TargetError(
            "user stacks are taken on the ptrace and uprobes backends, not with --kernel",
            errno=errno.EINVAL,
        )
    if args.backend == "uprobes":
        return UPROBES_HEADER
    if on_traps and not getattr(args, "no_optimize", False):
        sys.stderr.write(TIER_NOTE.format(why=on_traps))
    return ""
