"""The analog of the kernel's samples/kprobes/kprobe_example.c, on a live process.

A kprobe on a libc function of a spawned program, with a pre handler that prints the probe
address, ip and flags before the probed instruction runs, and a post handler that prints them
after it ran out of line:

    python samples/kprobe_example.py                     # probes libc:write in the demo program
    python samples/kprobe_example.py -s libc:puts -- /bin/echo hello
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import kprobes

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "bin", "demo")


def handler_pre(p: kprobes.Kprobe, regs: kprobes.Regs) -> None:
    print(
        f"<{p.symbol}> pre_handler: p->addr = {p.addr:#x}, ip = {regs.ip:#x}, "
        f"flags = {regs.flags:#x}, tid = {regs.tid}",
        file=sys.stderr,
    )


def handler_post(p: kprobes.Kprobe, regs: kprobes.Regs, flags: int) -> None:
    print(
        f"<{p.symbol}> post_handler: p->addr = {p.addr:#x}, ip = {regs.ip:#x}, "
        f"flags = {regs.flags:#x}",
        file=sys.stderr,
    )


def handler_fault(p: kprobes.Kprobe, regs: kprobes.Regs, trapnr: int) -> bool:
    print(f"fault_handler: p->addr = {p.addr:#x}, trap #{trapnr}", file=sys.stderr)
    return False  # not handled: let the error be reported


def build_demo() -> str:
    source = os.path.join(HERE, "demo.c")
    if not os.path.exists(DEMO) or os.path.getmtime(DEMO) < os.path.getmtime(source):
        os.makedirs(os.path.dirname(DEMO), exist_ok=True)
        subprocess.run(["gcc", "-O1", "-o", DEMO, source], check=True)
    return DEMO


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-s", "--symbol", default="libc:write", help="where to probe")
    parser.add_argument("command", nargs="*", help="program and arguments (default: the demo)")
    args = parser.parse_args()
    argv = args.command or [build_demo(), "3"]

    kp = kprobes.Kprobe(
        symbol=args.symbol,
        pre_handler=handler_pre,
        post_handler=handler_post,
        fault_handler=handler_fault,
    )
    try:
        with kprobes.spawn(argv) as proc:
            proc.register_kprobe(kp)
            # Spawned, the program has not loaded its libraries yet: a probe on one of them
            # is pending, and placed the moment the loader maps it.
            where = f"{kp.addr:#x}" if kp.addr is not None else f"{kp.symbol} (pending)"
            print(f"Planted kprobe at {where}", file=sys.stderr)
            for line in proc.list():
                print(line, file=sys.stderr)
            proc.run()
    except kprobes.errors.ProbeError as exc:
        print(f"kprobe_example: {exc}", file=sys.stderr)
        return 1
    print(
        f"kprobe at {kp.addr:#x} done: {kp.nhit} hits, {kp.nmissed} missed; "
        f"program exited with {proc.exit_code}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
