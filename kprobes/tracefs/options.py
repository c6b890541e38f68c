"""What the kernel's tracefs probes cannot do, refused before anything is written.

The probe objects are the same on every target (``core/``), and some of their options need
code of ours in the probed thread or a mechanism of our own: a jump-optimized detour of ours
(``optimize``), a handler at each call's entry (a kretprobe's ``entry_handler``, a jprobe's
``entry``), an instance pool (``maxactive`` on the kernel's uretprobes, which keep none). The
kernel's kprobes and uprobes, driven through ``kprobe_events``/``uprobe_events``, run none of
that: they record an event that Python decodes later. A probe asking for one of these is
refused here with ``UnsupportedOption`` (EINVAL) naming the target and the option, before
Step 1 of registration, so that nothing is registered.

What these targets do honour as every target does: ``args`` on the probe (its fetch-args, or
given to the register call) and an ``async_handler(probe, event)``, which is what all their
handlers are: called after the fact with the ``Event``.

Rejected: ignoring them, as these targets did until issue 19. A probe registered with
``optimize=True`` and an ``async_handler`` then ran no handler at all, and its caller had no
way to know; a refusal says which target to use instead.
"""

from __future__ import annotations

from kprobes.core.probes import Kprobe, check_handlers
from kprobes.core.retprobes import Jprobe, Kretprobe
from kprobes.errors import UnsupportedOption

_NO_CODE_OF_OURS = "the kernel's tracefs probes run no code of ours in the probed thread"


def check_options(target: str, probe: Kprobe | Kretprobe | Jprobe, *, is_kernel: bool) -> None:
    """Raise ``UnsupportedOption`` for the first option of ``probe`` that the tracefs target
    named ``target`` (``"Kernel"`` or ``"Uprobes"``) cannot honour."""
    if isinstance(probe, Jprobe):
        raise UnsupportedOption(
            target,
            "entry",
            "Jprobe",
            "a jprobe's entry is called in the probed thread with the function's arguments, "
            f"and {_NO_CODE_OF_OURS} (register a Kprobe with fetch-args such as %di, %si "
            "instead, or use Process)",
        )
    if isinstance(probe, Kretprobe):
        _check_kretprobe(target, probe, is_kernel=is_kernel)
        return
    _check_kprobe(target, probe, is_kernel=is_kernel)


def _check_kprobe(target: str, kp: Kprobe, *, is_kernel: bool) -> None:
    if kp.optimize:
        why = (
            "the kernel jump-optimizes its kprobes by itself where it can (Kernel.optimization "
            "is its debug.kprobes-optimization switch)"
            if is_kernel
            else "the kernel's uprobes place their own breakpoint (use Process for "
            "jump-optimized probes)"
        )
        raise UnsupportedOption(target, "optimize=True", "Kprobe", why)
    if kp.with_regs:
        raise UnsupportedOption(
            target,
            "with_regs=True",
            "Kprobe",
            "the kernel's events hold the fetch-args alone: name the registers you need as "
            'fetch-args (args="di=%di ax=%ax"), or use Process',
        )
    check_handlers(kp)


def _check_kretprobe(target: str, rp: Kretprobe, *, is_kernel: bool) -> None:
    if rp.entry_handler is not None:
        raise UnsupportedOption(
            target,
            "entry_handler",
            "Kretprobe",
            f"an entry_handler runs at each call's entry, and {_NO_CODE_OF_OURS} (register "
            "a Kprobe at the function's entry as well, or use Process)",
        )
    if rp.entry_args:
        raise UnsupportedOption(
            target,
            f"entry_args={' '.join(rp.entry_args)!r}",
            "Kretprobe",
            "an entry action writes a record at each call's entry for its return's event, "
            f"and {_NO_CODE_OF_OURS} (name the entry's arguments as $argN fetch-args of "
            "the return, or use Process)",
        )
    if rp.maxactive > 0 and not is_kernel:
        raise UnsupportedOption(
            target,
            f"maxactive={rp.maxactive}",
            "Kretprobe",
            "the kernel's uretprobes keep no instance pool (each thread hooks its nested "
            "calls, up to 64 deep): leave maxactive at 0 (no rN in a probe line)",
        )
    _check_kprobe(target, rp.kp, is_kernel=is_kernel)
