/*
 * The benchmark's probed program: `target NAME N` calls the function NAME N times and prints
 * `ns_per_call=<float> calls=<N>`. The loop is timed from inside, with CLOCK_MONOTONIC, so the
 * figure excludes the tracer's start-up and leaves only the per-call cost (plus the probe's).
 *
 * `target NAME N threads=T` makes the same N calls (arguments 0 .. N-1 again, split in T runs)
 * from T threads, released together by a barrier, each timing its own loop with
 * CLOCK_THREAD_CPUTIME_ID: the figure is then the CPU time of the threads (user and system: a
 * kernel uprobe's handler counts) divided by N, the cost of one call to the thread that makes
 * it. Wall time is not used: with more threads than CPUs it would count the waits for a CPU.
 *
 * Two more options, after threads=T (bench/placement.py): `spin=S` follows each call with S
 * rounds of an unprobed busy loop (work the program does between two hits), and `wall` makes
 * the figure the wall time from the first thread's start to the last one's end, divided by N:
 * a throughput, in which a program squeezed onto fewer CPUs shows (and which counts the waits
 * for a CPU on purpose).
 *
 * Each work_* function is written in assembly so that its FIRST instruction is exactly the one
 * a probe tier needs; the loop calls through a volatile function pointer so that nothing is
 * inlined or hoisted. All take the loop index in rdi and return a value in rax.
 */
#include <pthread.h>
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

    /* Recursion for the nest rows: work_nest10(i) (i >= 0) calls itself until it is 10 frames
     * deep, each frame a call of the probed function, and returns 10 (work_nest100: 100).
     * A recursive frame's rdi counts up from -(D-1) to 0; the first instruction is push rbp,
     * as work_push's. */
    ".globl work_nest10\n.type work_nest10,@function\n.p2align 4\n"
    "work_nest10:\n"
    "  push %rbp\n"
    "  mov %rsp, %rbp\n"
    "  test %rdi, %rdi\n"
    "  js 1f\n"
    "  mov $-10, %rdi\n"
    "1:\n"
    "  inc %rdi\n"
    "  mov $1, %eax\n" /* mov keeps inc's flags */
    "  jz 2f\n"
    "  call work_nest10\n"
    "  inc %rax\n"
    "2:\n"
    "  pop %rbp\n"
    "  ret\n"
    ".size work_nest10, .-work_nest10\n"

    ".globl work_nest100\n.type work_nest100,@function\n.p2align 4\n"
    "work_nest100:\n"
    "  push %rbp\n"
    "  mov %rsp, %rbp\n"
    "  test %rdi, %rdi\n"
    "  js 1f\n"
    "  mov $-100, %rdi\n"
    "1:\n"
    "  inc %rdi\n"
    "  mov $1, %eax\n"
    "  jz 2f\n"
    "  call work_nest100\n"
    "  inc %rax\n"
    "2:\n"
    "  pop %rbp\n"
    "  ret\n"
    ".size work_nest100, .-work_nest100\n"

    /* work_push again, with unwind info (its CFI), for the stack rows: the loop that calls
     * it runs DEEP_LEVELS frames below main (run_deep), so that a walk from its entry
     * reads a 10-frame stack: itself, run_deep 5 times, main, libc's two, _start. */
    ".globl work_deep10\n.type work_deep10,@function\n.p2align 4\n"
    "work_deep10:\n"
    "  .cfi_startproc\n"
    "  push %rbp\n"
    "  .cfi_def_cfa_offset 16\n"
    "  .cfi_offset %rbp, -16\n"
    "  mov %rsp, %rbp\n"
    "  lea 1(%rdi), %rax\n"
    "  pop %rbp\n"
    "  .cfi_def_cfa_offset 8\n"
    "  ret\n"
    "  .cfi_endproc\n"
    ".size work_deep10, .-work_deep10\n"

    /* getppid(2); the probe goes on the syscall at offset 5, which only a hardware
     * single-step can execute out of line. The no-probe baseline includes the syscall. */
    ".globl work_sys\n.type work_sys,@function\n.p2align 4\n"
    "work_sys:\n"
    "  mov $110, %eax\n" /* 5 bytes: b8 6e 00 00 00 */
    "  syscall\n"
    "  ret\n"
    ".size work_sys, .-work_sys\n");

long work_push(long), work_lea(long), work_boost(long), work_rip(long), work_sys(long);
long work_nest10(long), work_nest100(long), work_deep10(long);

static const struct {
    const char *name;
    long (*fn)(long);
} functions[] = {
    {"work_push", work_push}, {"work_lea", work_lea}, {"work_boost", work_boost},
    {"work_rip", work_rip},   {"work_sys", work_sys},
    {"work_nest10", work_nest10}, {"work_nest100", work_nest100},
    {"work_deep10", work_deep10},
};
#define DEEP_LEVELS 4 /* run_deep(4) .. run_deep(0): five frames */

static long (*volatile fn)(long);
static long spin_rounds; /* spin=S */
static int wall;         /* wall: the figure is wall time, not CPU time */

/* One thread's share of the calls: arguments first .. first+calls-1, and its CPU time. */
struct share {
    pthread_t thread;
    long first, calls;
    double cpu_ns;
    struct timespec start, end; /* CLOCK_MONOTONIC, for `wall` */
};

static pthread_barrier_t release;

static double elapsed_ns(const struct timespec *t0, const struct timespec *t1)
{
    return (double)(t1->tv_sec - t0->tv_sec) * 1e9 + (double)(t1->tv_nsec - t0->tv_nsec);
}

static void *run_share(void *arg)
{
    struct share *share = arg;
    volatile long sink = 0;
    struct timespec t0, t1;

    pthread_barrier_wait(&release);
    clock_gettime(CLOCK_MONOTONIC, &share->start);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (long i = share->first; i < share->first + share->calls; i++) {
        sink += fn(i);
        for (long r = 0; r < spin_rounds; r++)
            sink += r;
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    clock_gettime(CLOCK_MONOTONIC, &share->end);
    share->cpu_ns = elapsed_ns(&t0, &t1);
    return NULL;
}

/* The CPU time, summed over `nthreads` threads, of N calls split between them (with `wall`,
 * the wall time from the first thread's start to the last one's end). */
static double run_threads(long n, long nthreads)
{
    struct share shares[64];
    double cpu_ns = 0;
    struct timespec *first_start = NULL, *last_end = NULL;

    pthread_barrier_init(&release, NULL, (unsigned)nthreads);
    for (long t = 0, first = 0; t < nthreads; first += shares[t].calls, t++) {
        shares[t].first = first;
        shares[t].calls = n / nthreads + (t < n % nthreads ? 1 : 0);
        if (pthread_create(&shares[t].thread, NULL, run_share, &shares[t]) != 0) {
            perror("pthread_create");
            exit(1);
        }
    }
    for (long t = 0; t < nthreads; t++) {
        pthread_join(shares[t].thread, NULL);
        cpu_ns += shares[t].cpu_ns;
        if (first_start == NULL || elapsed_ns(&shares[t].start, first_start) > 0)
            first_start = &shares[t].start;
        if (last_end == NULL || elapsed_ns(last_end, &shares[t].end) > 0)
            last_end = &shares[t].end;
    }
    pthread_barrier_destroy(&release);
    return wall ? elapsed_ns(first_start, last_end) : cpu_ns;
}

/* The single-threaded loop, timed, `level` frames further down (work_deep10's stack). */
static volatile long deep_sink;

__attribute__((noinline)) static double run_deep(int level, long n)
{
    if (level > 0) {
        double ns = run_deep(level - 1, n);

        deep_sink++; /* after the call: no tail call, no loop made of the recursion */
        return ns;
    }
    volatile long sink = 0;
    struct timespec t0, t1;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        sink += fn(i);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return elapsed_ns(&t0, &t1);
}

int main(int argc, char **argv)
{
    long nthreads = 0;
    int bad = argc < 3;
    for (int a = 3; a < argc && !bad; a++) {
        if (strncmp(argv[a], "threads=", 8) == 0)
            nthreads = strtol(argv[a] + 8, NULL, 10);
        else if (strncmp(argv[a], "spin=", 5) == 0)
            spin_rounds = strtol(argv[a] + 5, NULL, 10);
        else if (strcmp(argv[a], "wall") == 0)
            wall = 1;
        else
            bad = 1;
    }
    if (bad || (argc > 3 && (nthreads < 1 || nthreads > 64)) || spin_rounds < 0) {
        fprintf(stderr, "usage: %s NAME N [threads=1..64 [spin=S] [wall]]\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < sizeof functions / sizeof functions[0]; i++)
        if (strcmp(argv[1], functions[i].name) == 0)
            fn = functions[i].fn;
    if (fn == NULL) {
        fprintf(stderr, "unknown function %s\n", argv[1]);
        return 2;
    }
    long n = strtol(argv[2], NULL, 10);
    double ns;

    if (nthreads > 0)
        ns = run_threads(n, nthreads);
    else
        ns = run_deep(fn == work_deep10 ? DEEP_LEVELS : 0, n);
    printf("ns_per_call=%.3f calls=%ld\n", n > 0 ? ns / (double)n : 0.0, n);
    return 0;
}
