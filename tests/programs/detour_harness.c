/*
 * A detour built by kprobes/arch/x86_64/detour.py, run on a real function of this program
 * (tests/arch/test_detour_live.py, tests/arch/test_capture.py):
 *
 *   detour_harness FUNC AREA_FILE THREADS N [OPTION...]
 *
 * FUNC is work, work_fp, work_flags or inspect (below); the test patches it at its entry, or
 * at the label work_flags_probe for work_flags.
 *
 * 1. Maps AREA_FILE (MAP_SHARED: the test reads the ring while we run) as the tool has the
 *    program map it (kprobes/process/fast/memory.py): the file, then its ring's first MIRROR
 *    bytes again right after its end (MAP_FIXED), so that a record may run past the ring's
 *    end in one piece; and one RWX page for the detour, both within +-2 GiB of our code.
 *    Prints "func ADDR page ADDR area ADDR gap ADDR bus ADDR bias ADDR" (gap and bus: the bad
 *    pages of inspect's cases; bias: a global long of value 7).
 * 2. Reads two lines from stdin, the detour's bytes in hex, then "OFFSET PATCH": where to
 *    write the 5-byte patch (hex offset from FUNC) and its hex; copies the detour into the
 *    page and writes the patch there (the text made writable meanwhile).
 * 3. THREADS threads call FUNC for i < N together, each checking every result: the work
 *    functions as FUNC(i, ~i, 3 * i, t), inspect as inspect(s, o, i, t) with the pointers of
 *    case i % NCASES (below). Then prints, per thread, "thread T FSBASE cpu=C edge=ADDR
 *    outer=ADDR inner=ADDR str=ADDR name=ADDR" (FSBASE is pthread_self(), the thread pointer;
 *    C the CPU it was pinned to, or -1), then "fixups K" and "ok" when every result was right.
 *
 * Options: pace=K spins K loop turns between calls, so that a reader keeps up with the
 * writers and meets records being written; pin pins thread t to the t-th CPU it may use;
 * mirror=BYTES the mirror's size (shared_area.MIRROR); magic=HEX the fetch fixup magic
 * (abi.FETCH_FAULT_MAGIC): a SIGSEGV or SIGBUS in the detour page with r11 = HEX resumes at
 * r10, the convention of the detour's captures that the tool otherwise implements (K counts
 * them); limit=L the longest string inspect's cases are built around.
 *
 * bench: instead times N calls on this thread, 5 rounds without and with the patch, the
 * ring emptied between rounds (its head and tail words as in shared_area.py), and prints
 * "plain NS patched NS" (the best round of each, ns per call).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <ucontext.h>
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

/*
 * inspect(s, o, i, t): what a probe's fetch-args read, and pointers that cannot be read. The
 * function itself reads through none of them: it mixes its four registers, so its result says
 * whether the detour gave them back unchanged. Field offsets: test_capture.py relies on them.
 */
struct inner {
	unsigned long pad;      /* 0 */
	unsigned int value;     /* 8:  7 * i */
	unsigned short h[3];    /* 12: i, t, 0xbeef */
	unsigned char b[4];     /* 18: 1, 2, 3, i */
	unsigned char pad2[2];  /* 22 */
	unsigned long words[2]; /* 24: i, t */
};

struct outer {
	unsigned long id;       /* 0:  t */
	unsigned long i;        /* 8 */
	struct inner *inner;    /* 16 */
	const char *name;       /* 24: "thread-T" */
	unsigned long words[2]; /* 32: i, ~i */
};

_Static_assert(sizeof(struct inner) == 40, "struct inner");
_Static_assert(sizeof(struct outer) == 48, "struct outer");

__attribute__((noipa)) long inspect(const char *s, const struct outer *o, long i, long t)
{
	return (((long)s ^ (long)o) + 3 * i + t) ^ bias;
}

/* inspect's cases, by i % NCASES: the string s (rdi) and the struct o (rsi). */
enum {
	GOOD,        /* "call I of T"; o good */
	NUL_PTRS,    /* s = o = NULL */
	GAP,         /* s in an unmapped page, o 16 bytes before it (o->inner in it) */
	INTO_GAP,    /* s = "0123456789" up to the unmapped page; o->inner = NULL */
	EDGE,        /* LIMIT - 1 chars and the NUL: LIMIT bytes; o->inner's words[1] in a
			PROT_NONE page */
	AT_LIMIT,    /* LIMIT chars, then the NUL */
	LONGER,      /* LIMIT + 50 chars */
	EMPTY,       /* ""; o non-canonical (a #GP, not a page fault) */
	BUS,         /* "abcde" up to a page of a file past its end (SIGBUS), o there too */
	NCASES
};

#define PAGE 4096UL
#define NONCANONICAL 0x8000000000000000UL

static fn_t fn;
static int is_inspect;
static long n_calls;
static long pace;
static long limit = 64;
static unsigned long fault_magic;
static unsigned char *detour_page;
static char *gap, *bus;
static long fixups;
static int pin, ncpus, cpus[CPU_SETSIZE];
static pthread_barrier_t start;

struct worker {
	pthread_t thread;
	long index;
	unsigned long self;
	long bad;
	int cpu;
	char *edge; /* a page, then a PROT_NONE one */
	struct outer outer;
	struct inner inner;
	char name[32];
	char *str;
};

static void fill_inner(struct inner *in, long i, long t)
{
	in->value = 7 * i;
	in->h[0] = i, in->h[1] = t, in->h[2] = 0xbeef;
	in->b[0] = 1, in->b[1] = 2, in->b[2] = 3, in->b[3] = i;
	in->words[0] = i;
}

/* The arguments of inspect's call i on thread w (the same in test_capture.py's expect()). */
static void setup(struct worker *w, long i, const char **s, const struct outer **o)
{
	long t = w->index;
	struct outer *out = &w->outer;
	struct inner *edge_inner = (struct inner *)(w->edge + PAGE - 32);
	out->id = t, out->i = i, out->inner = &w->inner, out->name = w->name;
	out->words[0] = i, out->words[1] = ~i;
	fill_inner(&w->inner, i, t);
	w->inner.words[1] = t;
	*s = w->str, *o = out;
	switch (i % NCASES) {
	case GOOD:
		snprintf(w->str, limit + 64, "call %ld of %ld", i, t);
		break;
	case NUL_PTRS:
		*s = NULL, *o = NULL;
		break;
	case GAP:
		*s = gap, *o = (struct outer *)(gap - 16);
		break;
	case INTO_GAP:
		*s = gap - 10;
		out->inner = NULL;
		break;
	case EDGE:
		memset(w->str, 'a' + i % 26, limit - 1);
		w->str[limit - 1] = 0;
		fill_inner(edge_inner, i, t);
		out->inner = edge_inner;
		break;
	case AT_LIMIT:
	case LONGER: {
		long n = i % NCASES == AT_LIMIT ? limit : limit + 50;
		memset(w->str, 'a' + i % 26, n);
		w->str[n] = 0;
		break;
	}
	case EMPTY:
		w->str[0] = 0;
		*o = (struct outer *)NONCANONICAL;
		break;
	case BUS:
		*s = bus - 5, *o = (struct outer *)(bus - 16);
		break;
	}
}

static void *run(void *arg)
{
	struct worker *w = arg;
	w->self = (unsigned long)pthread_self();
	w->cpu = -1;
	if (pin) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(cpus[w->index % ncpus], &set);
		if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0)
			exit(2);
		w->cpu = cpus[w->index % ncpus];
	}
	pthread_barrier_wait(&start);
	for (long i = 0; i < n_calls; i++) {
		if (is_inspect) {
			const char *s;
			const struct outer *o;
			setup(w, i, &s, &o);
			long want = (((long)s ^ (long)o) + 3 * i + w->index) ^ 7;
			if (inspect(s, o, i, w->index) != want)
				w->bad++;
		} else if (fn(i, ~i, 3 * i, w->index) != 3 * i + 7) {
			w->bad++;
		}
		for (volatile long k = 0; k < pace; k++)
			;
	}
	return NULL;
}

/* The fetch fixup convention (abi.py): a fault of a capture's load resumes at r10. */
static void on_fault(int sig, siginfo_t *si, void *ctx)
{
	(void)si;
	greg_t *g = ((ucontext_t *)ctx)->uc_mcontext.gregs;
	unsigned long rip = g[REG_RIP];
	if (fault_magic && (unsigned long)g[REG_R11] == fault_magic &&
	    rip - (unsigned long)detour_page < PAGE) {
		g[REG_RIP] = g[REG_R10];
		__atomic_add_fetch(&fixups, 1, __ATOMIC_RELAXED);
		return;
	}
	signal(sig, SIG_DFL); /* not ours: the fault again, and its default action */
}

/* A mapping at a free address within reach of `near` (as kprobes' xol.py places its pages). */
static void *map_near(void *near, size_t size, int prot, int flags, int fd)
{
	for (long k = 1; k < 512; k++) {
		for (int sign = -1; sign <= 1; sign += 2) {
			/* an address, not a pointer into an object: computed as a number */
			char *want = (char *)(((unsigned long)near & ~0xfffUL) +
					      (unsigned long)(sign * k * 0x400000L));
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

static void *map_or_die(void *at, size_t size, int prot, int flags, int fd, off_t off)
{
	void *got = mmap(at, size, prot, flags, fd, off);
	if (got == MAP_FAILED || (at && got != at)) {
		perror("mmap");
		exit(2);
	}
	return got;
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

/* The bad pages of inspect's cases: one unmapped between two mapped ones ("0123456789" ends
 * the first), and a file's page past its end ("abcde" ends the page before). */
static void map_bad_pages(void)
{
	char *three = map_or_die(NULL, 3 * PAGE, PROT_READ | PROT_WRITE,
				 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	gap = three + PAGE;
	munmap(gap, PAGE);
	memcpy(gap - 10, "0123456789", 10);
	int fd = memfd_create("detour-harness-bus", 0);
	if (fd < 0 || ftruncate(fd, PAGE) != 0)
		exit(2);
	char *file = map_or_die(NULL, 2 * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	bus = file + PAGE;
	memcpy(bus - 5, "abcde", 5);
}

int main(int argc, char **argv)
{
	if (argc < 5)
		return 2;
	if (strcmp(argv[1], "work_fp") == 0)
		fn = work_fp;
	else if (strcmp(argv[1], "work_flags") == 0)
		fn = work_flags;
	else if (strcmp(argv[1], "inspect") == 0)
		fn = (fn_t)(void *)inspect, is_inspect = 1;
	else
		fn = work;
	long nthreads = atol(argv[3]);
	n_calls = atol(argv[4]);
	int bench = 0;
	size_t mirror = 0;
	for (int k = 5; k < argc; k++) {
		if (strcmp(argv[k], "bench") == 0)
			bench = 1;
		else if (strcmp(argv[k], "pin") == 0)
			pin = 1;
		else if (strncmp(argv[k], "pace=", 5) == 0)
			pace = atol(argv[k] + 5);
		else if (strncmp(argv[k], "mirror=", 7) == 0)
			mirror = strtoul(argv[k] + 7, NULL, 0);
		else if (strncmp(argv[k], "magic=", 6) == 0)
			fault_magic = strtoul(argv[k] + 6, NULL, 16);
		else if (strncmp(argv[k], "limit=", 6) == 0)
			limit = atol(argv[k] + 6);
		else
			return 2;
	}

	/* Step 1: the area, its ring's mirror, the detour's page, the bad pages. */
	int fd = open(argv[2], O_RDWR);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) != 0)
		return 2;
	char *area = map_near((void *)fn, st.st_size + mirror, PROT_READ | PROT_WRITE,
			      MAP_SHARED | MAP_POPULATE, fd);
	unsigned long capacity = ((unsigned long *)area)[16 / 8];
	unsigned long ring = ((unsigned long *)area)[40 / 8];
	if (mirror && capacity)
		map_or_die(area + st.st_size, mirror, PROT_READ | PROT_WRITE,
			   MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, ring);
	close(fd);
	detour_page = map_near((void *)fn, PAGE, PROT_READ | PROT_WRITE | PROT_EXEC,
			       MAP_PRIVATE | MAP_ANONYMOUS, -1);
	map_bad_pages();
	struct sigaction sa = { .sa_sigaction = on_fault, .sa_flags = SA_SIGINFO };
	sigaction(SIGSEGV, &sa, NULL);
	sigaction(SIGBUS, &sa, NULL);
	printf("func %#lx page %#lx area %#lx gap %#lx bus %#lx bias %#lx\n", (unsigned long)fn,
	       (unsigned long)detour_page, (unsigned long)area, (unsigned long)gap,
	       (unsigned long)bus, (unsigned long)&bias);
	fflush(stdout);

	/* Step 2: the detour and the patch. */
	unsigned char patch[16], original[5];
	unsigned long offset;
	size_t n = read_hex(detour_page, PAGE);
	if (n == 0 || scanf("%lx ", &offset) != 1 || read_hex(patch, sizeof(patch)) != 5)
		return 2;
	char *probe = (char *)fn + offset;
	memcpy(original, probe, 5);

	if (bench) {
		double plain = 1e30, patched = 1e30;
		for (int round = 0; round < 5; round++) {
			double t = time_calls((unsigned long *)area);
			plain = t < plain ? t : plain;
			write_text(probe, patch, 5);
			t = time_calls((unsigned long *)area);
			patched = t < patched ? t : patched;
			write_text(probe, original, 5);
		}
		printf("plain %.2f patched %.2f\n", plain, patched);
		return 0;
	}

	/* Step 3: the calls. */
	if (pin) {
		cpu_set_t set;
		if (sched_getaffinity(0, sizeof(set), &set) != 0)
			return 2;
		for (int c = 0; c < CPU_SETSIZE; c++)
			if (CPU_ISSET(c, &set))
				cpus[ncpus++] = c;
	}
	write_text(probe, patch, 5);
	struct worker *w = calloc(nthreads, sizeof(*w));
	pthread_barrier_init(&start, NULL, nthreads);
	for (long t = 0; t < nthreads; t++) {
		w[t].index = t;
		w[t].edge = map_or_die(NULL, 2 * PAGE, PROT_READ | PROT_WRITE,
				       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		mprotect(w[t].edge + PAGE, PAGE, PROT_NONE);
		w[t].str = calloc(1, limit + 64);
		snprintf(w[t].name, sizeof(w[t].name), "thread-%ld", t);
		pthread_create(&w[t].thread, NULL, run, &w[t]);
	}
	long bad = 0;
	for (long t = 0; t < nthreads; t++) {
		pthread_join(w[t].thread, NULL);
		printf("thread %ld %#lx cpu=%d edge=%#lx outer=%#lx inner=%#lx str=%#lx name=%#lx\n",
		       t, w[t].self, w[t].cpu, (unsigned long)w[t].edge,
		       (unsigned long)&w[t].outer, (unsigned long)&w[t].inner,
		       (unsigned long)w[t].str, (unsigned long)w[t].name);
		bad += w[t].bad;
	}
	printf("fixups %ld\n", fixups);
	if (bad) {
		printf("bad %ld\n", bad);
		return 1;
	}
	printf("ok\n");
	return 0;
}
