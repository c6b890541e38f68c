"""User stacks as text: after an event as ftrace prints them, counted as bcc's stackcount
counts them, and folded for flame graphs.

**After an event** (``trace --stack``), the kernel's layout with ``options/userstacktrace``:
a line of the event's context saying ``<user stack trace>``, then a frame a line, innermost
first, each as its stack traces name a kernel address (``trace_stack_print`` and
``seq_print_ip_sym`` in kernel/trace/trace_output.c)::

               prog-4242    [001]   812.123456: <user stack trace>
     => leaf+0x0/0x12
     => a+0x9/0x20
     => main+0x33/0x80
     => __libc_start_call_main+0x7a/0xb0 [libc.so.6]

``[module]`` marks a library's frame, as a kernel module's; the program's own file has none.
A walk that stopped short ends with a marker frame saying why (`` => [no unwind info]``).

**Folded** (``stackcount --folded``): one line per distinct stack, outermost frame first,
frames joined by ``;``, then a space and the count: ``main;a;leaf 3``, what Brendan Gregg's
``stackcollapse`` scripts make and flamegraph.pl, inferno and speedscope read. A frame is its
function's name (call sites of one function are one frame), else ``[module]``, else its
address; a stack cut short starts with its marker, so that truncated stacks stay apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kprobes.model import Event, UserStack

USER_STACK = "<user stack trace>"


def format_stack_lines(stack: UserStack) -> list[str]:
    """The `` => frame`` lines of ``stack``, innermost first, and its marker if it stopped
    short."""
    lines = [f" => {frame.text}" for frame in stack.frames]
    if stack.marker:
        lines.append(f" => {stack.marker}")
    return lines


def stack_to_json(stack: UserStack) -> list[dict[str, object]]:
    """``"stack"`` of a JSON event: one object per frame, innermost first."""
    return [
        {
            "ip": f.addr,
            "func": f.func or None,
            "offset": f.offset,
            "size": f.size,
            "module": f.module or None,
            "text": f.text,
        }
        for f in stack.frames
    ]


def folded_frames(stack: UserStack) -> tuple[str, ...]:
    """The names of a folded line, outermost first (see the module docstring)."""
    names = [frame.name for frame in reversed(stack.frames)]
    if stack.marker:
        names.insert(0, stack.marker)
    return tuple(names)


class StackCounts:
    """Hits counted by probe and by stack (``stackcount``); a stack is its frames as they
    print (call sites apart, as bcc's stack ids keep them)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, UserStack]] = Counter()
        self.order: dict[str, None] = {}  # the probes, as their first hit came

    def add(self, probe: str, ev: Event, count: int = 1) -> None:
        """``count`` hits of ``ev``'s stack (more than one: counted in the program)."""
        stack = ev.stack if ev.stack is not None else UserStack((), "no stack")
        self.order.setdefault(probe, None)
        self.counts[(probe, stack)] += count

    def folded(self) -> Counter[tuple[str, ...]]:
        """Counts by folded stack, over every probe (the probe is the innermost frame)."""
        out: Counter[tuple[str, ...]] = Counter()
        for (_probe, stack), n in self.counts.items():
            out[folded_frames(stack)] += n
        return out

    def format(self, *, top: int | None = None) -> str:
        """Each probe's stacks, the most frequent first, each as its frames (innermost
        first, indented) and its count below, as bcc's stackcount prints them; a probe's
        name heads its part when there are several."""
        parts: list[str] = []
        many = len(self.order) > 1
        for probe in self.order:
            rows = sorted(
                ((n, stack) for (p, stack), n in self.counts.items() if p == probe),
                key=lambda row: -row[0],
            )
            if many:
                total = sum(n for n, _ in rows)
                parts.append(f"{probe}: {total} hits, {len(rows)} stacks\n")
            for n, stack in rows[:top]:
                lines = [f"  {f.text}" for f in stack.frames]
                if stack.marker:
                    lines.append(f"  {stack.marker}")
                parts.append("\n".join([*lines, f"    {n}", ""]) + "\n")
        return "".join(parts)


def format_folded(counts: Iterable[tuple[tuple[str, ...], int]]) -> str:
    """Folded lines, the most frequent first (ties in name order)."""
    rows = sorted(counts, key=lambda row: (-row[1], row[0]))
    return "".join(f"{';'.join(names)} {n}\n" for names, n in rows)
