/*
 * The C ptrace floor: the least any ptrace tracer can pay per hit, with no language runtime.
 *
 *   floor one|two RELADDR PROGRAM [ARGS...]
 *
 * Runs PROGRAM under PTRACE_TRACEME and puts an int3 at RELADDR, an offset (hex) from the start
 * of the program's lowest mapping (its load base for a PIE; the harness computes it from the
 * ELF). Per hit:
 *   one  emulate the probed `push %rbp` (GETREGS, store rbp at rsp-8, SETREGS, CONT): 1 stop;
 *   two  the classic loop: restore the byte, rip -= 1, SINGLESTEP, re-insert int3, CONT: 2 stops.
 * Prints `hits=<n>` once the program has exited, and exits with the program's status.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what)
{
    perror(what);
    exit(125);
}

/* The start of the lowest mapping of the traced program's executable, from /proc/PID/maps. */
static uintptr_t load_base(pid_t pid)
{
    char path[64], exe[PATH_MAX], line[PATH_MAX + 128];
    snprintf(path, sizeof path, "/proc/%d/exe", pid);
    ssize_t len = readlink(path, exe, sizeof exe - 1);
    if (len < 0)
        die("readlink exe");
    exe[len] = '\0';
    snprintf(path, sizeof path, "/proc/%d/maps", pid);
    FILE *maps = fopen(path, "r");
    if (maps == NULL)
        die("open maps");
    uintptr_t base = 0;
    while (base == 0 && fgets(line, sizeof line, maps) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char *name = strchr(line, '/');
        if (name != NULL && strcmp(name, exe) == 0)
            base = (uintptr_t)strtoull(line, NULL, 16); /* lines are sorted by address */
    }
    fclose(maps);
    if (base == 0) {
        fprintf(stderr, "floor: %s not found in %s\n", exe, path);
        exit(125);
    }
    return base;
}

static int wait_stop(pid_t pid, int *status)
{
    if (waitpid(pid, status, 0) < 0)
        die("waitpid");
    return WIFSTOPPED(*status);
}

int main(int argc, char **argv)
{
    if (argc < 4 || (strcmp(argv[1], "one") != 0 && strcmp(argv[1], "two") != 0)) {
        fprintf(stderr, "usage: %s one|two RELADDR PROGRAM [ARGS...]\n", argv[0]);
        return 2;
    }
    int one_stop = strcmp(argv[1], "one") == 0;
    uintptr_t reladdr = (uintptr_t)strtoull(argv[2], NULL, 16);

    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        ptrace(PTRACE_TRACEME, 0, NULL, NULL);
        execv(argv[3], &argv[3]);
        _exit(127);
    }

    int status;
    if (!wait_stop(pid, &status)) /* the SIGTRAP stop after execve */
        return 125;
    ptrace(PTRACE_SETOPTIONS, pid, NULL, (void *)PTRACE_O_EXITKILL);

    /* Step 1: arm. Keep the original word; write 0xCC over its low byte. */
    uintptr_t addr = load_base(pid) + reladdr;
    errno = 0;
    long orig = ptrace(PTRACE_PEEKDATA, pid, (void *)addr, NULL);
    if (errno != 0)
        die("peek");
    if (one_stop && (orig & 0xff) != 0x55) {
        fprintf(stderr, "floor: the instruction at %#lx is not push %%rbp\n", (unsigned long)addr);
        kill(pid, SIGKILL);
        return 125;
    }
    long armed = (orig & ~0xffL) | 0xcc;
    if (ptrace(PTRACE_POKEDATA, pid, (void *)addr, (void *)armed) < 0)
        die("poke");

    /* Step 2: run until the program exits, handling each hit. */
    unsigned long hits = 0;
    int sig = 0;
    for (;;) {
        ptrace(PTRACE_CONT, pid, NULL, (void *)(long)sig);
        sig = 0;
        if (!wait_stop(pid, &status))
            break;
        struct user_regs_struct regs;
        if (WSTOPSIG(status) != SIGTRAP ||
            ptrace(PTRACE_GETREGS, pid, NULL, &regs) < 0 || regs.rip != addr + 1) {
            sig = WSTOPSIG(status) == SIGTRAP ? 0 : WSTOPSIG(status); /* not ours: pass it on */
            continue;
        }
        hits++;
        if (one_stop) {
            /* push %rbp is one byte, so rip (addr + 1) is already past it. */
            regs.rsp -= 8;
            if (ptrace(PTRACE_POKEDATA, pid, (void *)regs.rsp, (void *)regs.rbp) < 0)
                die("poke stack");
            ptrace(PTRACE_SETREGS, pid, NULL, &regs);
        } else {
            ptrace(PTRACE_POKEDATA, pid, (void *)addr, (void *)orig);
            regs.rip = addr;
            ptrace(PTRACE_SETREGS, pid, NULL, &regs);
            ptrace(PTRACE_SINGLESTEP, pid, NULL, NULL);
            if (!wait_stop(pid, &status))
                break;
            ptrace(PTRACE_POKEDATA, pid, (void *)addr, (void *)armed);
        }
    }
    printf("hits=%lu\n", hits);
    fflush(stdout);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
