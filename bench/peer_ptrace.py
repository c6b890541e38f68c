"""python-ptrace 0.9.9 with its classic breakpoint loop, the way its own examples probe code.

On each hit: ``Breakpoint.desinstall(set_ip=True)`` (restore the byte, rip -= 1),
``singleStep()``, wait, ``createBreakpoint()`` again, ``cont()``: two stops, and python-ptrace's
own bookkeeping around each. The harness runs this module as a separate process::

    python -m bench.peer_ptrace MAP_OFFSET PROGRAM [ARGS...]

which prints ``hits=<n>`` after the program exits (the program's own output goes to the same
stdout, before it).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata

from bench.elf import find_site
from bench.peer import Outcome, Peer, Row, hits_from_fields


@dataclass(frozen=True, slots=True)
class PtraceRunner:
    map_offset: int
    target: str
    func: str

    def argv(self, calls: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "bench.peer_ptrace",
            f"{self.map_offset:x}",
            self.target,
            self.func,
            str(calls),
        ]

    def outcome(self, stdout: str) -> Outcome:
        return hits_from_fields(stdout)


class PtracePeer(Peer):
    name = "ptrace"

    def rows(self) -> list[Row]:
        return [
            Row(
                peer=self.name,
                key="ptrace",
                label="python-ptrace, classic breakpoint loop",
                func="work_push",
                calls=20_000,
                quick_calls=300,
                max_runs=3,
            )
        ]

    def unavailable(self) -> str | None:
        try:
            metadata.version("python-ptrace")
        except metadata.PackageNotFoundError:
            return "python-ptrace is not installed (pip install -e '.[bench]')"
        return None

    def version(self) -> str:
        return f"python-ptrace {metadata.version('python-ptrace')}"

    @contextmanager
    def session(self, row: Row) -> Iterator[PtraceRunner]:
        site = find_site(self.programs.target, row.func, row.offset)
        yield PtraceRunner(site.map_offset, str(self.programs.target), row.func)


def _load_base(process: object, program: str) -> int:
    """The start of the program's lowest mapping (``readMappings`` lists them by address)."""
    exe = os.path.realpath(program)
    for mapping in process.readMappings():  # type: ignore[attr-defined]
        if mapping.pathname == exe:
            return int(mapping.start)
    raise SystemExit(f"peer_ptrace: {exe} is not mapped")


def main(argv: list[str]) -> int:
    from ptrace.debugger import PtraceDebugger  # type: ignore[import-untyped]
    from ptrace.debugger.child import createChild  # type: ignore[import-untyped]
    from ptrace.debugger.process_event import ProcessExit  # type: ignore[import-untyped]

    map_offset, program = int(argv[0], 16), argv[1]
    debugger = PtraceDebugger()
    pid = createChild([program, *argv[2:]], no_stdout=False)
    process = debugger.addProcess(pid, is_attached=True)  # waits for the exec stop
    addr = _load_base(process, program) + map_offset
    process.createBreakpoint(addr)
    hits, exitcode = 0, -1
    try:
        while True:
            process.cont()
            process.waitSignals(signal.SIGTRAP)
            bp = process.findBreakpoint(process.getInstrPointer() - 1)
            if bp is None:
                continue
            hits += 1
            bp.desinstall(set_ip=True)
            process.singleStep()
            process.waitSignals(signal.SIGTRAP)
            process.createBreakpoint(addr)
    except ProcessExit as event:
        exitcode = event.exitcode if event.exitcode is not None else 128 + (event.signum or 0)
    finally:
        debugger.quit()
    sys.stdout.flush()
    print(f"hits={hits}", flush=True)
    return exitcode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
