"""``python -m bench.frametable [--runs 5] FILE...``: how long compiling a file's ``.eh_frame``
into the compact frame table takes (kprobes/symbols/frametable.py), beside pyelftools'
decode of every FDE (symbols/cfi_decode.py, the trap tier's decoder) (issue 23, item 5).

Per file: the FDEs, the table's rows by kind and its bytes, the best and the median of
``--runs`` compilations (each from the file's bytes, not from the cache), and one full
decode through pyelftools (``--no-pyelftools`` skips it). Default files: libc,
libpython3.11 if present, and zstd.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

from kprobes.symbols import cfi_decode
from kprobes.symbols.ehframe import RawEhFrame
from kprobes.symbols.elf import read_sections
from kprobes.symbols.frametable import compile_eh_frame

DEFAULTS = (
    "/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0",
    "/usr/bin/zstd",
)


def measure(path: str, runs: int, pyelftools: bool) -> str:
    address, data = read_sections(path, (".eh_frame",))[".eh_frame"]
    fdes = sum(1 for _ in RawEhFrame(data, address).iter_fdes())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        table = compile_eh_frame(data, address)
        times.append(time.perf_counter() - start)
    kinds = Counter(table.row(i).kind.name for i in range(len(table)))
    line = (
        f"{Path(path).name}: {fdes} FDEs, {len(table)} rows {dict(kinds)}, "
        f"{len(table.to_bytes())} bytes; compiled in {min(times) * 1e3:.0f} ms best, "
        f"{statistics.median(times) * 1e3:.0f} ms median of {runs}"
    )
    if pyelftools:
        start = time.perf_counter()
        info = cfi_decode.call_frame_info(data, address, for_eh_frame=True)
        _starts, offsets = cfi_decode.full_index(info)
        for offset in offsets:
            cfi_decode.decode_at(info, offset)
        line += f"; pyelftools decodes them all in {(time.perf_counter() - start) * 1e3:.0f} ms"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-pyelftools", action="store_true")
    args = parser.parse_args()
    files = args.files or [f for f in DEFAULTS if Path(f).exists()]
    for path in files:
        print(measure(path, args.runs, not args.no_pyelftools), flush=True)


if __name__ == "__main__":
    main()
