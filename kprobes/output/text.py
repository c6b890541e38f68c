"""Events as lines of the kernel's ``trace`` file, so existing eyes and scripts can read them.

A probe event in ``/sys/kernel/tracing/trace`` is the context that ``trace_print_context()``
(kernel/trace/trace_output.c) prints for every event, then the probe's own part that
``print_kprobe_event()`` / ``print_kretprobe_event()`` (kernel/trace/trace_kprobe.c) print::

    "%16s-%-7d "  comm-pid       (pid is the thread's id: the kernel's entry->pid)
    "(%7d) "      tgid           (only with options/record-tgid)
    "[%03d] "     cpu
    "%c%c%c%c%c"  irq flags      (only with options/irq-info)
    " %5lu.%06lu" timestamp      (ns rounded to us as ns2usecs() does: (ns + 500) / 1000)
    ": "
    "%s: (%pS)"                  entry:  name: (sym+off/size)
    "%s: (%pS <- %ps)"           return: name: (caller+off/size <- func)
    " %s=..."                    one per argument, printed by kprobes.output.argtypes

**irq-info.** The five flag letters (irqs-off/BH, need-resched, hard/softirq, preempt depth,
migrate-disable) describe the kernel context of the hit. A user process stopped by ptrace has no
such context, so by default the line is printed as the kernel prints it with ``irq-info`` off
(``echo 0 > options/irq-info``), the layout ``trace_pipe`` users also get from ``trace-cmd
report`` without ``-l``. Rejected: printing ``.....``, which claims "irqs on, no preemption" for
facts we never observed. A target that has real flags (the kernel's raw records) passes them as
``irq_flags``.

**Wall-clock time** (``trace -T``): the timestamp column is the local time of day,
``HH:MM:SS.ffffff`` (bcc ``trace -T``'s ``HH:MM:SS`` with the microseconds kept, so that the
events of one second stay apart), in place of the seconds of the event clock; the rest of the
line is unchanged. The caller gives the offset between the event clock and CLOCK_REALTIME,
measured once: the time is the hit's, not the printing's.

An unknown cpu (negative) is printed ``[???]``; an empty comm as the kernel's ``<...>``.
Strings and chars are printed raw, unescaped, as the kernel's ``%s``/``%c`` do: a string with a
newline in it breaks the line here as it does in the kernel's file. Programs should read the
JSON lines output, which escapes.
"""

from __future__ import annotations

from datetime import datetime

from kprobes.model import Event
from kprobes.output.argtypes import format_value
from kprobes.values import dataclass

UNKNOWN_COMM = "<...>"  # what trace_find_cmdline() gives when the comm was not saved


@dataclass(frozen=True, slots=True)
class BufferCounts:
    """The numbers of the kernel header's ``# entries-in-buffer/entries-written`` line."""

    entries: int
    written: int
    cpus: int


def format_timestamp(timestamp: float) -> str:
    """Seconds as ``trace_print_time()`` prints them: ``%5lu.%06lu``, rounded to the us."""
    usecs = (round(timestamp * 1_000_000_000) + 500) // 1000
    secs, usec_rem = divmod(usecs, 1_000_000)
    return f"{secs:5d}.{usec_rem:06d}"


def wall_time(timestamp: float, offset_ns: int) -> datetime:
    """The local time of an event's ``timestamp`` (seconds of its clock), given the
    offset of CLOCK_REALTIME from that clock in ns; to the microsecond (rounded)."""
    usecs = (round(timestamp * 1_000_000_000) + offset_ns + 500) // 1000
    secs, usec_rem = divmod(usecs, 1_000_000)
    return datetime.fromtimestamp(secs).replace(microsecond=usec_rem).astimezone()


def format_wallclock(timestamp: float, offset_ns: int) -> str:
    """``-T``'s column: ``HH:MM:SS.ffffff``, local time (see the module docstring)."""
    return wall_time(timestamp, offset_ns).strftime("%H:%M:%S.%f")


def format_context(
    ev: Event,
    *,
    irq_flags: str | None = None,
    tgid: bool = False,
    wall_offset_ns: int | None = None,
) -> str:
    """``trace_print_context()``: everything before the event name, ``": "`` included;
    with ``wall_offset_ns`` the time is the wall clock's (``format_wallclock``)."""
    comm = ev.comm or UNKNOWN_COMM
    parts = [f"{comm:>16}-{ev.tid:<7} "]
    if tgid:
        parts.append(f"({ev.pid:>7}) " if ev.pid else "(-------) ")
    parts.append(f"[{ev.cpu:03d}] " if ev.cpu >= 0 else "[???] ")
    if irq_flags is not None:
        parts.append(irq_flags)
    if wall_offset_ns is None:
        parts.append(f" {format_timestamp(ev.timestamp)}: ")
    else:
        parts.append(f" {format_wallclock(ev.timestamp, wall_offset_ns)}: ")
    return "".join(parts)


def format_location(ev: Event) -> str:
    """The parenthesised part: ``(sym+off/size)`` or ``(caller+off/size <- func)``."""
    where = ev.location or f"0x{ev.ip:x}"
    if not ev.is_return:
        return f"({where})"
    func = ev.func or f"0x{ev.func_ip:x}"
    return f"({where} <- {func})"


def format_args(ev: Event) -> str:
    """``trace_probe_print_args()``: `` name=value`` for every argument, in spec order."""
    return "".join(f" {a.name}={format_value(a.type, a.value)}" for a in ev.args)


def format_event(
    ev: Event,
    *,
    irq_flags: str | None = None,
    tgid: bool = False,
    wall_offset_ns: int | None = None,
) -> str:
    """One event as one line of the kernel's ``trace`` file, without the newline.

    ``irq_flags`` is the five-letter irq-info column when known (see the module docstring);
    ``tgid`` adds the ``(tgid)`` column of ``options/record-tgid``; ``wall_offset_ns`` (the
    offset of CLOCK_REALTIME from the event clock) prints the time as the wall clock's.
    """
    return (
        format_context(ev, irq_flags=irq_flags, tgid=tgid, wall_offset_ns=wall_offset_ns)
        + f"{ev.event}: "
        + format_location(ev)
        + format_args(ev)
    )


# The column legends of print_func_help_header() and print_func_help_header_irq()
# (kernel/trace/trace.c); ``%.*s`` there is the TGID column, cut to 2 columns without tgid.
_IRQ_LEGEND = (
    "  _-----=> irqs-off/BH-disabled",
    " / _----=> need-resched",
    "| / _---=> hardirq/softirq",
    "|| / _--=> preempt-depth",
    "||| / _-=> migrate-disable",
    "|||| /     delay",
)


def format_header(
    *,
    irq_info: bool = False,
    tgid: bool = False,
    tracer: str = "nop",
    counts: BufferCounts | None = None,
) -> str:
    """The comment block at the top of the kernel's ``trace`` file, newline-terminated.

    ``irq_info`` and ``tgid`` must match what :func:`format_event` is given so the columns line
    up. ``counts`` adds the ``entries-in-buffer/entries-written`` line when the numbers are
    known (a streaming reader, like ``trace_pipe``, has none and prints no header at all).
    """
    lines = [f"# tracer: {tracer}", "#"]
    if counts is not None:
        lines.append(
            f"# entries-in-buffer/entries-written: {counts.entries}/{counts.written}"
            f"   #P:{counts.cpus}"
        )
        lines.append("#")
    if irq_info:
        space = " " * (12 if tgid else 2)
        lines.extend(f"#{' ' * 28}{space}{legend}" for legend in _IRQ_LEGEND)
        tgid_name, tgid_bar = ("     TGID   ", "       |    ") if tgid else ("  ", "  ")
        lines.append(f"#           TASK-PID  {tgid_name} CPU#  |||||  TIMESTAMP  FUNCTION")
        lines.append(f"#              | |    {tgid_bar}   |   |||||     |         |")
    else:
        tgid_name, tgid_bar = ("   TGID   ", "     |    ") if tgid else ("", "")
        lines.append(f"#           TASK-PID    {tgid_name} CPU#     TIMESTAMP  FUNCTION")
        lines.append(f"#              | |      {tgid_bar}   |         |         |")
    return "\n".join(lines) + "\n"
