/*
 * The benchmark's probed program: `target NAME N` calls the function NAME N times and prints
 * `ns_per_call=<float> calls=<N>`. The loop is timed from inside, with CLOCK_MONOTONIC, so the
 * figure excludes the tracer's start-up and leaves only the per-call cost (plus the probe's).
 *
 * Each work_* function is written in assembly so that its FIRST instruction is exactly the one
 * a probe tier needs; the loop calls through a volatile function pointer so that nothing is
 * inlined or hoisted. All take the loop index in rdi and return a value in rax.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Read by work_rip through a rip-relative load; hidden so the reference is a plain PC32. */
__attribute__((visibility("hidden"))) long bench_counter;

__asm__(
    ".text\n"

    /* push rbp first: emulated by our tool (1 stop) and by the kernel's uprobes. */
    ".globl work_push\n.type work_push,@function\n.p2align 4\n"
    "work_push:\n"
    "  push %rbp\n"
    "  mov %rsp, %rbp\n"
    "  lea 1(%rdi), %rax\n"
    "  pop %rbp\n"
    "  ret\n"
    ".size work_push, .-work_push\n"

    /* lea first: the kernel single-steps it; our tool emulates it. */
    ".globl work_lea\n.type work_lea,@function\n.p2align 4\n"
    "work_lea:\n"
    "  lea 1(%rdi), %rax\n"
    "  ret\n"
    ".size work_lea, .-work_lea\n"

    /* imul first: neither emulated nor a branch, so our tool boosts it (copy + jmp back). */
    ".globl work_boost\n.type work_boost,@function\n.p2align 4\n"
    "work_boost:\n"
    "  imul $3, %rdi, %rax\n"
    "  ret\n"
    ".size work_boost, .-work_boost\n"

    /* A rip-relative load first: boosted with its displacement relocated. */
    ".globl work_rip\n.type work_rip,@function\n.p2align 4\n"
    "work_rip:\n"
    "  mov bench_counter(%rip), %rax\n"
    "  add %rdi, %rax\n"
    "  ret\n"
    ".size work_rip, .-work_rip\n"

    /* getppid(2); the probe goes on the syscall at offset 5, which only a hardware
     * single-step can execute out of line. The no-probe baseline includes the syscall. */
    ".globl work_sys\n.type work_sys,@function\n.p2align 4\n"
    "work_sys:\n"
    "  mov $110, %eax\n" /* 5 bytes: b8 6e 00 00 00 */
    "  syscall\n"
    "  ret\n"
    ".size work_sys, .-work_sys\n");

long work_push(long), work_lea(long), work_boost(long), work_rip(long), work_sys(long);

static const struct {
    const char *name;
    long (*fn)(long);
} functions[] = {
    {"work_push", work_push}, {"work_lea", work_lea}, {"work_boost", work_boost},
    {"work_rip", work_rip},   {"work_sys", work_sys},
};

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s NAME N\n", argv[0]);
        return 2;
    }
    long (*volatile fn)(long) = NULL;
    for (size_t i = 0; i < sizeof functions / sizeof functions[0]; i++)
        if (strcmp(argv[1], functions[i].name) == 0)
            fn = functions[i].fn;
    if (fn == NULL) {
        fprintf(stderr, "unknown function %s\n", argv[1]);
        return 2;
    }
    long n = strtol(argv[2], NULL, 10);
    volatile long sink = 0;
    struct timespec t0, t1;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        sink += fn(i);
    clock_gettime(CLOCK_MONOTONIC, &t1);

    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    printf("ns_per_call=%.3f calls=%ld\n", n > 0 ? ns / (double)n : 0.0, n);
    return 0;
}
