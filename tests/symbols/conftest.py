"""Real programs for the symbol layer: compiled here with gcc, run, and asked where things are.

Each target program prints the runtime addresses it sees (its own functions, and libc's
through dlsym(), which never returns a PLT stub), then waits. A line ``dlopen PATH`` on its
stdin makes it load a library and print the address of ``kpt_dl_func`` in it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

LIBKPT_C = r"""
int kpt_lib_func(int x)
{
    int y = x * 7;
    y ^= x >> 3;
    return y + 3;
}
"""

LIBKPT_DL_C = r"""
int kpt_dl_func(int x) { return x - 11; }
"""

TARGET_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

extern int kpt_lib_func(int);
int kpt_global_counter;

__attribute__((noinline, used)) static int kpt_static_helper(int x)
{
    return x * 3 + 1;
}

__attribute__((noinline)) int kpt_probe_me(int x)
{
    kpt_global_counter += x;
    return kpt_static_helper(x) + kpt_lib_func(x) + 2;
}

int main(void)
{
    char line[4096];

    printf("kpt_probe_me %p\n", (void *)kpt_probe_me);
    printf("kpt_static_helper %p\n", (void *)kpt_static_helper);
    printf("kpt_lib_func %p\n", dlsym(RTLD_DEFAULT, "kpt_lib_func"));
    printf("malloc %p\n", dlsym(RTLD_DEFAULT, "malloc"));
    printf("kpt_global_counter %p\n", (void *)&kpt_global_counter);
    printf("ready\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "dlopen ", 7) == 0) {
            void *handle;
            line[strcspn(line, "\n")] = 0;
            handle = dlopen(line + 7, RTLD_NOW);
            printf("kpt_dl_func %p\n", handle ? dlsym(handle, "kpt_dl_func") : NULL);
            fflush(stdout);
        }
    }
    for (;;)
        pause();
}
"""


@dataclass(frozen=True)
class Programs:
    """Paths of the compiled test objects."""

    dir: Path
    pie: Path
    nopie: Path
    stripped: Path  # PIE, -rdynamic, strip -s: only .dynsym remains
    libkpt: Path
    libkpt_dl: Path


@dataclass
class Running:
    """A live target and the addresses it printed about itself."""

    proc: subprocess.Popen[str]
    addrs: dict[str, int]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command(self, line: str) -> tuple[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        name, value = self.proc.stdout.readline().split()
        return name, int(value, 16)


def _gcc(*args: str | Path) -> None:
    subprocess.run(["gcc", "-O1", *map(str, args)], check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Programs:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the target programs")
    out = tmp_path_factory.mktemp("symbols-programs")
    for name, text in (
        ("libkpt.c", LIBKPT_C),
        ("libkpt_dl.c", LIBKPT_DL_C),
        ("target.c", TARGET_C),
    ):
        (out / name).write_text(text)
    _gcc("-shared", "-fPIC", "-o", out / "libkpt.so", out / "libkpt.c")
    _gcc("-shared", "-fPIC", "-o", out / "libkpt_dl.so", out / "libkpt_dl.c")
    link: list[str | Path] = ["-L", out, "-lkpt", f"-Wl,-rpath,{out}"]
    _gcc("-o", out / "target_pie", out / "target.c", *link)
    _gcc("-no-pie", "-fno-pie", "-o", out / "target_nopie", out / "target.c", *link)
    _gcc("-rdynamic", "-o", out / "target_stripped", out / "target.c", *link)
    subprocess.run(["strip", "-s", str(out / "target_stripped")], check=True)
    return Programs(
        dir=out,
        pie=out / "target_pie",
        nopie=out / "target_nopie",
        stripped=out / "target_stripped",
        libkpt=out / "libkpt.so",
        libkpt_dl=out / "libkpt_dl.so",
    )


def start(argv: list[str]) -> Running:
    """Start a target and read its address lines up to "ready"."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    addrs: dict[str, int] = {}
    for line in proc.stdout:
        if line.strip() == "ready":
            return Running(proc, addrs)
        name, value = line.split()
        addrs[name] = int(value, 16)
    proc.kill()
    raise AssertionError(f"{argv} exited before it was ready: {proc.wait()}")


def stop(running: Running) -> None:
    running.proc.kill()
    running.proc.wait()
    for stream in (running.proc.stdin, running.proc.stdout):
        if stream is not None:
            stream.close()


@pytest.fixture(scope="session")
def start_target() -> Iterator[Callable[[list[str]], Running]]:
    """Start extra targets inside a test; every one is killed at the end of the session."""
    started: list[Running] = []

    def _start(argv: list[str]) -> Running:
        running = start(argv)
        started.append(running)
        return running

    yield _start
    for running in started:
        stop(running)


@pytest.fixture(scope="module")
def pie(programs: Programs) -> Iterator[Running]:
    running = start([str(programs.pie)])
    yield running
    stop(running)


@pytest.fixture(scope="module")
def nopie(programs: Programs) -> Iterator[Running]:
    running = start([str(programs.nopie)])
    yield running
    stop(running)


@pytest.fixture(scope="module")
def stripped(programs: Programs) -> Iterator[Running]:
    running = start([str(programs.stripped)])
    yield running
    stop(running)
