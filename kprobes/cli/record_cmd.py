"""``kprobes record SPEC...``: every event into a file now, formatted later by ``kprobes script``.

    kprobes record -o work.data -c './loop 2000000' 'p work i=%di'
    kprobes script work.data > work.txt

perf's split (``perf record``, then ``perf script``): a hot function makes events faster
than any formatter prints them, so the records of our own backend's jump-optimized probes
go to the file as they lay in the ring, a read at a time, with what formats them later
(process/fast/tee.py; the file: output/recfile.py, docs/record-format.md), and ``script``
prints what ``trace`` would have printed. The ring is larger than ``trace``'s (``--ring-size``,
128 MiB by default: a 2,000,000-call loop's records fit in it however the reader is
scheduled), since the reader here only copies. With ``--block`` (``trace``'s) a full ring
makes the program wait for the reader instead of dropping: a loop of any length then comes
whole, at the pace of the file's writes.

With ``-U`` the records carry the stacks walked in the program (their return addresses,
named by ``script`` from the files the recording mapped, as ``trace -U`` names them).
Every other event (a probe that keeps its breakpoint, the kernel's backends, ``-n``) is
written as the event ``trace`` would have printed, in the
order ``trace`` would have printed it. ``--filter`` is kept in the file and applied by
``script`` (the records are not decoded here).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import IO, Any

from kprobes import __version__
from kprobes.cli.backends import Backend
from kprobes.cli.session import Session
from kprobes.cli.stack_options import prepare_stacks
from kprobes.cli.trace_cmd import add_trace_arguments, check_block, parse_specs
from kprobes.errors import TargetError
from kprobes.model import Event

DEFAULT_FILE = "kprobes.data"
RING_SIZE = 128 << 20  # bytes: 2,097,152 one-slot records


def _ring_size(text: str) -> int:
    """A ring size in bytes, ``K``/``M``/``G`` suffixes allowed: a power of two, 8 KiB up."""
    units = {"k": 10, "m": 20, "g": 30}
    shift = units.get(text[-1:].lower(), 0)
    try:
        value = int(text[:-1] if shift else text) << shift
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size") from None
    if value < 8192 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a power of two of 8K or more")
    return value


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser("record", help=help, description=__doc__.split("\n\n")[0])
    add_trace_arguments(p)
    p.add_argument(
        "-o",
        "--output",
        default=DEFAULT_FILE,
        metavar="FILE",
        help=f"the file to write (default {DEFAULT_FILE}); read it with kprobes script",
    )
    p.add_argument(
        "--ring-size",
        type=_ring_size,
        default=RING_SIZE,
        metavar="BYTES",
        help="the shared ring of the jump-optimized probes' records, a power of two (K, M, "
        "G); what the program writes while the ring is full is dropped and counted "
        f"(default {RING_SIZE >> 20}M: 64 bytes a record of up to 4 fetch-args)",
    )
    p.set_defaults(func=run)


class _Recorder:
    """The session's events and records into one file, and what it counts of them."""

    def __init__(self, session: Session, out: IO[bytes], args: argparse.Namespace) -> None:
        # The file's writer needs the engine's ring decoders: imported when a recording
        # starts, not for ``record --help``.
        from kprobes.output import recfile

        self.recfile = recfile
        self.session = session
        self.args = args
        self.writer = recfile.RecordWriter(out)
        self.events = 0  # the trap tier's and the kernel's events, written as events
        self.header = ""

    @property
    def records(self) -> int:
        return self.writer.records

    def handle(self, ev: Event) -> None:
        self.events += 1
        self.writer.event(ev)

    def refresh(self) -> None:
        self.session.events = self.events + self.writer.records

    def start(self, backend: Backend) -> None:
        """The run starts (the wall clock's offset is known): the session's description,
        then each process's ring tapped (our own backend's, unless ``-n`` counts each
        event: those go through the handlers)."""
        args = self.args
        self.writer.json(
            self.recfile.META,
            {
                "kprobes": __version__,
                "argv": sys.argv,
                "specs": list(args.specs),
                "filter": args.filter,
                "stack": bool(args.stack),
                "header": self.header,
                "wall_offset_ns": self.session.wall_offset_ns,
                "host": platform.node(),
                "kernel": platform.release(),
            },
        )
        if args.backend != "ptrace" or args.max_events is not None:
            return
        from kprobes.cli.ptrace_backend import PtraceBackend
        from kprobes.process.fast.tee import RecordTee

        assert isinstance(backend, PtraceBackend)

        def tap(proc: Any) -> None:
            proc.ring_size = args.ring_size
            reader = proc.records.ring_reader()
            modules = lambda: proc.symbols().modules()  # noqa: E731
            main = lambda: proc.symbols().main_module().path  # noqa: E731
            reader.tee = RecordTee(reader, proc.pid, self.writer, modules, main)

        for tracer in backend.attached:
            tap(tracer.proc)
        family = backend.proc.family
        follow = family.on_new_process

        def follow_tapped(member: Any) -> None:  # a followed child that exec'd
            tap(member)
            follow(member)

        family.on_new_process = follow_tapped

    def end(self) -> None:
        s = self.session
        s.refresh()
        self.writer.json(
            self.recfile.END,
            {
                "events": s.events,
                "records": self.writer.records,
                "hits": s.hits,
                "missed": s.missed,
                "dropped": s.dropped,
                "unread": s.unread,
                "filtered": s.filtered,
                "ended_by": s.ended_by,
                "exit_status": s.exit_status(),
            },
        )


def run(args: argparse.Namespace) -> int:
    specs, _ = parse_specs(args.specs, as_json=False)  # a probe's own line is script's
    check_block(args)
    header = prepare_stacks(args) if args.stack else ""
    session = Session(args, specs)
    session.wall_clock = True  # kept for script -T
    session.verb = "recorded"
    if os.path.isdir(args.output):
        raise TargetError(f"-o {args.output}: a directory")
    with open(args.output, "wb", buffering=1 << 20) as out:
        recorder = _Recorder(session, out, args)
        recorder.header = header
        session.handle = recorder.handle
        session.refresh = recorder.refresh
        session.prepare = recorder.start
        try:
            session.run()
        finally:
            recorder.end()
    sys.stderr.write(session.summary())
    sys.stderr.write(
        f"kprobes: recorded in {args.output} ({os.path.getsize(args.output):,} bytes)\n"
    )
    return session.exit_status()
