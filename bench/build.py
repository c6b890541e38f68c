"""Compiles the benchmark's C programs into ``bench/bin/`` (gcc -O2, PIE by default).

A program is rebuilt when its binary is missing or older than its source, so a ``make bench``
after an edit never measures a stale build.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = HERE / "bin"
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-pthread")


class BuildError(Exception):
    """gcc refused a source file; the message carries its diagnostics."""


@dataclass(frozen=True, slots=True)
class Programs:
    """The compiled programs every peer is handed."""

    target: Path
    floor: Path
    detour_floor: Path


def compile_c(name: str, includes: tuple[str, ...] = ()) -> Path:
    """Compile ``bench/NAME.c`` into ``bench/bin/NAME`` unless the binary is up to date (newer
    than it and than the ``bench/*.c`` files it ``includes``)."""
    source = HERE / f"{name}.c"
    output = BIN / name
    sources = [source, *(HERE / f"{c}.c" for c in includes)]
    if output.exists() and all(output.stat().st_mtime >= s.stat().st_mtime for s in sources):
        return output
    BIN.mkdir(exist_ok=True)
    result = subprocess.run(
        ["gcc", *CFLAGS, "-o", str(output), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BuildError(f"gcc {source.name} failed:\n{result.stderr}")
    return output


def build_all() -> Programs:
    return Programs(
        target=compile_c("target"),
        floor=compile_c("floor"),
        detour_floor=compile_c("detour_floor", includes=("target",)),
    )
