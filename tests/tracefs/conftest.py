"""A small C program for the live Uprobes tests, compiled with gcc into a temporary directory,
and a way to run it so that probes are in place before it does its work.

The program prints ``ready`` on stderr, waits for a line on stdin, then calls ``work()`` N
times (and, by its mode, also from a new thread or from a forked child; ``thread-cpu0`` runs
the thread on CPU 0 and the main thread, which creates it, on CPU 1), prints the sum of the
results and exits. ``work`` reads every field of a struct so that the compiler keeps them all.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PROGRAM_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

struct rec { int a; long b; char name[16]; unsigned short arr[4]; };
const char *names[] = { "hello world", "second name" };
long ncalls;  /* .bss: read through @ncalls */

__attribute__((noinline)) long work(long x, const char *s, struct rec *r)
{
    ncalls++;
    return x * 2 + (long)strlen(s) + r->a + r->b + r->name[0] + r->arr[1];
}

static void calls(int n)
{
    struct rec r = { 7, 99, "pairname", { 1, 2, 3, 4 } };
    long total = 0;
    for (int i = 0; i < n; i++)
        total += work(i, names[i % 2], &r);
    printf("%ld\n", total);
    fflush(stdout);
}

static void *thread_main(void *arg)
{
    calls((int)(long)arg);
    return NULL;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 3;
    const char *mode = argc > 2 ? argv[2] : "plain";
    char line[64];
    fprintf(stderr, "ready\n");
    if (!fgets(line, sizeof line, stdin))
        return 1;
    if (strcmp(mode, "thread") == 0 || strcmp(mode, "thread-cpu0") == 0) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        if (strcmp(mode, "thread-cpu0") == 0) {
            cpu_set_t cpus;
            CPU_ZERO(&cpus);
            CPU_SET(1, &cpus);
            if (sched_setaffinity(0, sizeof cpus, &cpus) != 0)
                return 3;
            CPU_ZERO(&cpus);
            CPU_SET(0, &cpus);
            pthread_attr_setaffinity_np(&attr, sizeof cpus, &cpus);
        }
        if (pthread_create(&t, &attr, thread_main, (void *)(long)n) != 0)
            return 3;
        pthread_join(t, NULL);
        return 0;
    } else if (strcmp(mode, "fork") == 0) {
        pid_t child = fork();
        calls(n);
        if (child == 0)
            _exit(0);
        waitpid(child, NULL, 0);
        return 0;
    }
    calls(n);
    return 0;
}
"""

TRACEFS = Path("/sys/kernel/tracing")


def require_uprobe_events() -> None:
    """These tests run as root on a kernel with uprobe events (the development machines)."""
    if os.geteuid() != 0:
        pytest.fail("the live tracefs tests need root (tracefs is root-only)")
    if not (TRACEFS / "uprobe_events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    if not (TRACEFS / "uprobe_events").exists():
        pytest.fail("this kernel has no uprobe_events (CONFIG_UPROBE_EVENTS)")


@pytest.fixture(scope="session")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uprobes") / "prog"
    source = out.with_suffix(".c")
    source.write_text(PROGRAM_C)
    cmd = ["gcc", "-O0", "-g", "-pthread", "-o", str(out), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return out


class Waiting:
    """The program, started and waiting for ``go()``."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def go(self, timeout: float = 30) -> str:
        out, _ = self.proc.communicate(b"go\n", timeout=timeout)
        assert self.proc.returncode == 0, self.proc.returncode
        return out.decode()


@pytest.fixture
def start(program: Path) -> Iterator[Callable[..., Waiting]]:
    require_uprobe_events()
    started: list[subprocess.Popen[bytes]] = []

    def _start(n: int = 3, mode: str = "plain") -> Waiting:
        proc = subprocess.Popen(
            [str(program), str(n), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        started.append(proc)
        assert proc.stderr is not None
        assert proc.stderr.readline() == b"ready\n"
        return Waiting(proc)

    yield _start
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)


def tracefs_leftovers(group: str, instance: str) -> list[str]:
    """What of a session is still in tracefs (should be nothing after it closed)."""
    left = []
    if any(f":{group}/" in line for line in (TRACEFS / "uprobe_events").read_text().splitlines()):
        left.append(f"uprobe_events lines of {group}")
    if (TRACEFS / "events" / group).exists():
        left.append(f"events/{group}")
    if (TRACEFS / "instances" / instance).exists():
        left.append(f"instances/{instance}")
    return left
