/*
 * A detour built by kprobes/arch/x86_64/detour.py, run on a real function of this program
 * (tests/arch/test_detour_live.py):
 *
 *   detour_harness FUNC AREA_FILE THREADS N [bench | pace=K]
 *
 * FUNC is work, work_fp or work_flags (below); the test patches it at its entry, or at the
 * label work_flags_probe for work_flags.
 *
 * 1. Maps AREA_FILE (MAP_SHARED: the test reads the ring while we run) and one RWX page for
 *    the detour, both within +-2 GiB of our code, and prints "func ADDR page ADDR area ADDR".
 * 2. Reads two lines from stdin, the detour's bytes in hex, then "OFFSET PATCH": where to
 *    write the 5-byte patch (hex offset from FUNC) and its hex; copies the detour into the
 *    page and writes the patch there (the text made writable meanwhile).
 * 3. THREADS threads call FUNC(i, ~i, 3 * i, t) for i < N together, each checking every
 *    result; prints "thread T FSBASE" per thread (pthread_self(): the thread pointer) and
 *    "ok" when every result was right. pace=K spins K loop turns between calls, so that a
 *    reader keeps up with the writers and meets records being written.
 *
 * bench: instead times N calls on this thread, 5 rounds without and with the patch, the
 * ring emptied between rounds (its head and tail words as in shared_area.py), and prints
 * "plain NS patched NS" (the best round of each, ns per call).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

typedef long (*fn_t)(long, long, long, long);

volatile long bias = 7;

/* endbr64 (with -fcf-protection) then a rip-relative load: displaced together. */
__attribute__((noipa)) long work(long a, long b, long c, long t)
{
	(void)b, (void)c, (void)t;
	return bias + 3 * a;
}

/* A frame-pointer prologue, push rbp; mov rbp, rsp; sub rsp, 16: three displaced instructions
 * (in asm: gcc leaves the frame pointer out of a leaf function whatever it is told). */
long work_fp(long a, long b, long c, long t);
asm(".text\n"
    ".globl work_fp\n"
    ".type work_fp, @function\n"
    "work_fp:\n"
    "	push %rbp\n"
    "	mov %rsp, %rbp\n"
    "	sub $16, %rsp\n"
    "	mov %rdi, -8(%rbp)\n"
    "	mov bias(%rip), %rax\n"
    "	lea (%rdi,%rdi,2), %rdx\n"
    "	add %rdx, %rax\n"
    "	leave\n"
    "	ret\n"
    ".size work_fp, .-work_fp\n");

/* A probe in the middle, at work_flags_probe, where the flags of `add` are live: they must
 * come out of the detour as they went in (each result says so: -1 if not). For odd i the add
 * overflows (OF, SF, PF), for even i it gives zero (ZF, PF). */
long work_flags(long a, long b, long c, long t);
asm(".text\n"
    ".globl work_flags\n"
    ".globl work_flags_probe\n"
    ".type work_flags, @function\n"
    "work_flags:\n"
    "	mov %rdi, %rcx\n"
    "	shl $62, %rcx\n"
    "	add %rcx, %rcx\n"
    "work_flags_probe:\n"
    "	lea (%rdi,%rdi,2), %rax\n"
    "	mov %rax, %rdx\n"
    "	pushfq\n"
    "	pop %r8\n"
    "	mov %rdi, %rcx\n"
    "	shl $62, %rcx\n"
    "	add %rcx, %rcx\n"
    "	pushfq\n"
    "	pop %r9\n"
    "	cmp %r8, %r9\n"
    "	jne 1f\n"
    "	add bias(%rip), %rax\n"
    "	ret\n"
    "1:	mov $-1, %rax\n"
    "	ret\n"
    ".size work_flags, .-work_flags\n");

static fn_t fn;
static long n_calls;
static long pace;
static pthread_barrier_t start;

struct worker {
	pthread_t thread;
	long index;
	unsigned long self;
	long bad;
};

static void *run(void *arg)
{
	struct worker *w = arg;
	w->self = (unsigned long)pthread_self();
	pthread_barrier_wait(&start);
	for (long i = 0; i < n_calls; i++) {
		if (fn(i, ~i, 3 * i, w->index) != 3 * i + 7)
			w->bad++;
		for (volatile long k = 0; k < pace; k++)
			;
	}
	return NULL;
}

/* A mapping at a free address within reach of `near` (as kprobes' xol.py places its pages). */
static void *map_near(void *near, size_t size, int prot, int flags, int fd)
{
	for (long k = 1; k < 512; k++) {
		for (int sign = -1; sign <= 1; sign += 2) {
			char *want = (char *)((unsigned long)near & ~0xfffUL) + sign * k * 0x400000L;
			void *got = mmap(want, size, prot, flags | MAP_FIXED_NOREPLACE, fd, 0);
			if (got == want)
				return got;
			if (got != MAP_FAILED)
				munmap(got, size);
		}
	}
	fprintf(stderr, "no free address near %p\n", near);
	exit(2);
}

static size_t read_hex(unsigned char *out, size_t max)
{
	char *line = NULL;
	size_t cap = 0, n = 0;
	if (getline(&line, &cap, stdin) < 0)
		exit(2);
	for (char *p = line; p[0] && p[1] && p[0] != '\n' && n < max; p += 2)
		sscanf(p, "%2hhx", &out[n++]);
	free(line);
	return n;
}

static void write_text(void *at, const unsigned char *bytes, size_t n)
{
	unsigned long lo = (unsigned long)at & ~0xfffUL;
	unsigned long hi = ((unsigned long)at + n + 0xfff) & ~0xfffUL;
	if (mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) {
		perror("mprotect");
		exit(2);
	}
	memcpy(at, bytes, n);
	mprotect((void *)lo, hi - lo, PROT_READ | PROT_EXEC);
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static double time_calls(volatile unsigned long *area)
{
	area[128 / 8] = area[64 / 8]; /* tail = head: the ring is empty again */
	long sum = 0;
	double t0 = now();
	for (long i = 0; i < n_calls; i++)
		sum += fn(i, ~i, 3 * i, 0);
	double t1 = now();
	if (sum != 3 * (n_calls * (n_calls - 1) / 2) + 7 * n_calls)
		exit(3);
	return (t1 - t0) / n_calls;
}

int main(int argc, char **argv)
{
	if (argc < 5)
		return 2;
	if (strcmp(argv[1], "work_fp") == 0)
		fn = work_fp;
	else if (strcmp(argv[1], "work_flags") == 0)
		fn = work_flags;
	else
		fn = work;
	long nthreads = atol(argv[3]);
	n_calls = atol(argv[4]);
	int bench = argc > 5 && strcmp(argv[5], "bench") == 0;
	if (argc > 5 && strncmp(argv[5], "pace=", 5) == 0)
		pace = atol(argv[5] + 5);

	int fd = open(argv[2], O_RDWR);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) != 0)
		return 2;
	void *area = map_near((void *)fn, st.st_size, PROT_READ | PROT_WRITE,
			      MAP_SHARED | MAP_POPULATE, fd);
	unsigned char *page = map_near((void *)fn, 4096, PROT_READ | PROT_WRITE | PROT_EXEC,
				       MAP_PRIVATE | MAP_ANONYMOUS, -1);
	printf("func %#lx page %#lx area %#lx\n", (unsigned long)fn, (unsigned long)page,
	       (unsigned long)area);
	fflush(stdout);

	unsigned char patch[16], original[5];
	unsigned long offset;
	size_t n = read_hex(page, 4096);
	if (n == 0 || scanf("%lx ", &offset) != 1 || read_hex(patch, sizeof(patch)) != 5)
		return 2;
	char *probe = (char *)fn + offset;
	memcpy(original, probe, 5);

	if (bench) {
		double plain = 1e30, patched = 1e30;
		for (int round = 0; round < 5; round++) {
			double t = time_calls(area);
			plain = t < plain ? t : plain;
			write_text(probe, patch, 5);
			t = time_calls(area);
			patched = t < patched ? t : patched;
			write_text(probe, original, 5);
		}
		printf("plain %.2f patched %.2f\n", plain, patched);
		return 0;
	}

	write_text(probe, patch, 5);
	struct worker *w = calloc(nthreads, sizeof(*w));
	pthread_barrier_init(&start, NULL, nthreads);
	for (long t = 0; t < nthreads; t++) {
		w[t].index = t;
		pthread_create(&w[t].thread, NULL, run, &w[t]);
	}
	long bad = 0;
	for (long t = 0; t < nthreads; t++) {
		pthread_join(w[t].thread, NULL);
		printf("thread %ld %#lx\n", t, w[t].self);
		bad += w[t].bad;
	}
	if (bad) {
		printf("bad %ld\n", bad);
		return 1;
	}
	printf("ok\n");
	return 0;
}
