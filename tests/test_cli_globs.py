"""``kprobes count`` globs over libraries the program has not loaded yet (issue 22, item 2).

``count -c CMD 'libc:str*'`` used to fail at once ("no module 'libc' is mapped"): at the
command's first instruction only the executable and the loader are. Now the glob waits, and
is matched in each process of the run as its library comes: at the ``mmap`` of the startup's
libraries (before their relocation and constructors), at a ``dlopen``, in a child that execs.

The kernel's uprobes are the reference count. They differ on one thing by design: a GNU ifunc
symbol (``strlen``, ``strchr``...) is, for the kernel, its resolver (run once, by the loader);
for us the implementation the resolver chose (the function the program calls:
docs/decisions.md). The comparisons leave the ifuncs out, and check them on their own.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import support
from support import cli, needs_uprobes
from test_cli_trace import count_rows

from kprobes.process.survival import cleanup
from kprobes.symbols.elf import ElfImage, SymbolKind

pytestmark = pytest.mark.ptrace


def ifuncs(path: Path) -> set[str]:
    image = ElfImage.open(path)
    return {s.name for s in image.iter_functions() if s.kind is SymbolKind.IFUNC}


def counted(*args: object) -> dict[str, int]:
    result = cli("count", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "never placed" not in result.stderr, result.stderr
    return count_rows(result.stdout)


def without(rows: dict[str, int], names: set[str]) -> dict[str, int]:
    return {name: hits for name, hits in rows.items() if name not in names}


@needs_uprobes
def test_a_libc_glob_with_c_counts_what_the_kernels_uprobes_count(build: Any) -> None:
    """The glob is matched in libc as the loader maps it, before relocation: the loader's
    own calls, the constructors' and the program's are all counted."""
    command = f"{build('target')} 5"
    ours = counted("-c", command, "libc:str*")
    theirs = counted("--backend", "uprobes", "-c", command, "libc:str*")
    resolvers = ifuncs(support.libc_path(build("target")))
    assert without(ours, resolvers) == without(theirs, resolvers)
    assert without(ours, resolvers), "no function of the glob but ifuncs was called"
    # An ifunc is counted where the program calls it: printf's strchrnul runs per "%" field
    # here, the kernel counts its resolver once.
    assert ours.get("strchrnul", 0) > theirs.get("strchrnul", 0) == 1


@needs_uprobes
def test_a_glob_is_matched_in_each_child_a_shell_runs(build: Any, tmp_path: Path) -> None:
    """``sh -c 'prog; prog'``: sh maps libc, and each child that execs the program maps its
    own; the glob is matched in every one of them, as the kernel's uprobes (on the file)
    count every process that runs it."""
    prog = build("target")
    command = f"sh -c '{prog} 5 > /dev/null; {prog} 3 > /dev/null'"
    ours = counted("-c", command, "libc:strto*", "libc:strrchr", "libc:strdup")
    theirs = counted("--backend", "uprobes", "-c", command, "libc:strto*", "libc:strrchr")
    resolvers = ifuncs(support.libc_path(build("target")))
    ours_plain = without(ours, resolvers | {"libc:strdup"})
    assert ours_plain == without(theirs, resolvers), (ours, theirs)
    # The shell's own calls, and the program's (atoi of its argument) in each child.
    shell = counted("-c", "sh -c true", "libc:strtol").get("libc:strtol", 0)
    alone = counted("-c", f"{prog} 5", "libc:strtol")["libc:strtol"]
    assert ours["strtol"] == shell + 2 * alone


def test_a_glob_on_a_library_loaded_by_dlopen_is_matched_when_it_comes(build: Any) -> None:
    host, plugin = build("plughost"), build("libplug.so")
    rows = counted("-c", f"{host} {plugin} 3 2", "libplug:plug_*")
    # In each of the 3 loads: the ifunc resolver the loader runs as it relocates, the
    # constructor, its call of plug_work; then the 2 calls of the round.
    assert rows == {"plug_resolve": 3, "plug_init": 3, "plug_work": 9}


@needs_uprobes
def test_a_dlopen_glob_counts_what_the_kernel_counts(build: Any) -> None:
    host, plugin = build("plughost"), build("libplug.so")
    command = f"{host} {plugin} 3 2"
    ours = counted("-c", command, "libplug:plug_*")
    theirs = counted("--backend", "uprobes", "-c", command, f"{plugin}:plug_*")
    # plug_fast, an ifunc: the kernel counts its resolver's 3 runs under its name too.
    assert theirs["plug_fast"] == theirs["plug_resolve"] == 3
    assert ours == without(theirs, ifuncs(plugin))


def test_a_glob_whose_library_never_comes_is_named_and_the_run_fails(build: Any) -> None:
    result = cli("count", "-c", f"{build('target')} 2", "libnope:x*")
    assert result.returncode == 1, result.stderr
    assert (
        "kprobes: libnope:x* was never placed: the program never loaded libnope\n" in result.stderr
    )


def test_a_glob_that_matches_nothing_in_its_library_is_named(build: Any) -> None:
    host, plugin = build("plughost"), build("libplug.so")
    result = cli("count", "-c", f"{host} {plugin} 1 1", "libplug:zz*", "libplug:plug_work")
    assert result.returncode == 0, result.stderr
    assert (
        "kprobes: libplug:zz* was never placed: no function of libplug matches\n" in result.stderr
    )
    assert count_rows(result.stdout) == {"libplug:plug_work": 2}


def test_with_p_a_glob_on_a_library_not_loaded_is_an_error_unless_pending(
    build: Any, popen: Any
) -> None:
    host, plugin = build("plughost"), build("libplug.so")
    prog = popen(
        [host, plugin, 2, 3, "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert support.read_line(prog.stdout.fileno(), timeout=20) == b"ready\n"
    refused = cli("count", "-p", prog.pid, "libplug:plug_*", "-d", 5)
    assert refused.returncode == 1
    assert refused.stderr.startswith(
        f"kprobes: no module 'libplug' is mapped in process {prog.pid}"
    )
    assert refused.stderr.rstrip().endswith("; --pending waits until it loads it")
    # With --pending it waits: the host is let go once the probes are in.
    with subprocess.Popen(
        [support.KPROBES, "count", "-p", str(prog.pid), "--pending", "libplug:plug_*"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as tool:
        # The tool publishes its state once it watches the loader (the probes are in).
        state = Path(cleanup.state_path(prog.pid))
        support.wait_until(state.exists, timeout=30, what="the tool's state file")
        prog.stdin.write(b"\n")
        prog.stdin.flush()
        out, err = tool.communicate(timeout=60)
    assert tool.returncode == 0, err
    assert count_rows(out) == {"plug_resolve": 2, "plug_init": 2, "plug_work": 8}
    assert prog.wait(timeout=30) == 0
    assert os.path.exists(plugin)
