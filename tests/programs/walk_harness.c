/* The fast tier's stack walker (kprobes/arch/x86_64/stackwalk.py) run for real, without
 * ptrace (tests/arch/test_stackwalk.py). Built at -O2 without frame pointers, so that only
 * the unwind tables can walk its frames.
 *
 *   walk_harness MAGIC_HEX [bench=N]
 *
 * It maps a page for the code and a region for the frame tables, prints
 * "code ADDR dir ADDR", then reads two lines of hex: the code (the walk as a C function,
 * `walk(regs, out)`, with a short walk of at most SHORT return addresses right after it at
 * the offset given on the line's end: "HEX OFFSET"), and the tables' directory. Then it takes
 * stacks at `leaf`, reached by known paths, and prints for each one line
 *
 *   NAME walk STATUS RA... bt PC...
 *
 * where the walk's status word and return addresses are the generated code's, and the PCs
 * glibc's backtrace() (libgcc's DWARF unwinder, the reference) found from the same place:
 * its first is leaf's own; then a line "mem NAME PC SP RBP HEX" with the registers the walk
 * started from and the stack from SP up (the Python walk's memory). The paths:
 *
 *   a       main -> a -> leaf
 *   b       main -> b -> leaf           (b calls alloca: its CFA is on rbp)
 *   lib     main -> stk_through -> leaf (stk_through is in libstk.so)
 *   qsort   main -> qsort -> cmp -> leaf (through libc)
 *   thread  a thread's start -> a -> leaf (up to libc's clone3)
 *   deep    main -> deep x 20 -> leaf, with the short walk (the depth limit)
 *
 * and stacks that cannot be walked, whose walks must end cleanly: "unreadable" (the stack
 * pointer on a PROT_NONE page: the fault convention, r11 = MAGIC, resumes at r10), "nowhere"
 * (a pc in no mapping and no frame pointer), "pastend" (a pc in the program's text past its
 * last unwind row, no frame pointer), "fpchain" (a pc in no mapping, a frame-pointer chain in
 * a buffer). The last line is "faults N" (the faults the convention absorbed).
 *
 * With bench=N (tests/arch/bench_stackwalk.py) it only times N walks at leaf under deep(D)
 * for a few depths D, printing "bench RETURNS NS_PER_WALK" for each.
 */
#define _GNU_SOURCE
#include <alloca.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>

#define KEEP __attribute__((noinline, noclone))
#define CODE_SIZE 4096
#define DIR_SIZE (64 << 20)
#define MAX_OUT 256

typedef void (*walk_fn)(const uint64_t regs[3], uint64_t *out);

int stk_through(int (*f)(int), int x);
void _fini(void);

static walk_fn walk_full, walk_short;
static unsigned char *code_page;
static unsigned long magic;
static volatile long faults;
static const char *current = "";
static int use_short;
static long bench_walks;
static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;
volatile long sink;

/* The registers at this point of the calling function: rip (the instruction after the
 * lea, where the row that holds describes the same rsp), rsp, rbp. */
#define HERE(r)                                                                    \
	asm volatile("mov %%rbp, 16(%0)\n\tmov %%rsp, 8(%0)\n\t"                       \
		     "lea 0(%%rip), %%rax\n\tmov %%rax, (%0)"                          \
		     :                                                                 \
		     : "r"(r)                                                          \
		     : "rax", "memory")

/* "mem NAME PC SP RBP HEX": the registers a walk started from and the thread's stack from
 * SP to its top, for the Python walk over the same rows (symbols/tablewalk.py). */
static void dump(const char *name, const uint64_t *regs)
{
	pthread_attr_t attr;
	void *base;
	size_t size;

	if (pthread_getattr_np(pthread_self(), &attr) || pthread_attr_getstack(&attr, &base, &size))
		exit(4);
	pthread_attr_destroy(&attr);
	printf("mem %s %lx %lx %lx ", name, (unsigned long)regs[0], (unsigned long)regs[1],
	       (unsigned long)regs[2]);
	for (unsigned char *p = (unsigned char *)(uintptr_t)regs[1]; p < (unsigned char *)base + size;
	     p++)
		printf("%02x", *p);
	printf("\n");
}

static void report(const char *name, const uint64_t *out, void **bt, int n)
{
	pthread_mutex_lock(&print_lock);
	printf("%s walk %lx", name, (unsigned long)out[0]);
	for (uint64_t k = 0; k < (out[0] & 0xffffffff); k++)
		printf(" %lx", (unsigned long)out[1 + k]);
	printf(" bt");
	for (int k = 0; k < n; k++)
		printf(" %lx", (unsigned long)bt[k]);
	printf("\n");
	pthread_mutex_unlock(&print_lock);
}

KEEP int leaf(int x)
{
	uint64_t regs[3], out[1 + MAX_OUT];
	void *bt[MAX_OUT];

	HERE(regs);
	if (bench_walks) {
		struct timespec t0, t1;
		double best = 1e30;

		for (int round = 0; round < 5; round++) {
			clock_gettime(CLOCK_MONOTONIC, &t0);
			for (long k = 0; k < bench_walks; k++)
				walk_full(regs, out);
			clock_gettime(CLOCK_MONOTONIC, &t1);
			double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
			best = ns < best ? ns : best;
		}
		printf("bench %lu %.1f\n", (unsigned long)(out[0] & 0xffffffff), best / bench_walks);
		return x;
	}
	(use_short ? walk_short : walk_full)(regs, out);
	int n = backtrace(bt, MAX_OUT);
	report(current, out, bt, n);
	pthread_mutex_lock(&print_lock);
	dump(current, regs);
	pthread_mutex_unlock(&print_lock);
	sink += x;
	return x * 3 + (int)(sink & 0);
}

KEEP int a(int x)
{
	int r = leaf(x + 1);

	sink += r; /* work after the call: no tail jump */
	return r + 2;
}

KEEP int b(int x)
{
	char *p = alloca(x + 32);

	memset(p, x, x + 32);
	int r = leaf(p[x]);
	sink -= r;
	return r + 5;
}

KEEP int deep(int n)
{
	int r = n ? deep(n - 1) : leaf(n);

	sink += r;
	return r + 1;
}

static int cmp(const void *l, const void *r)
{
	static int once;

	if (!once++)
		leaf(7);
	return *(const int *)l - *(const int *)r;
}

static void *thread_main(void *arg)
{
	(void)arg;
	a(3);
	return NULL;
}

/* The fetch fixup convention (abi.py): a fault of the walk's loads resumes at r10. */
static void on_fault(int sig, siginfo_t *si, void *ctx)
{
	(void)si;
	greg_t *g = ((ucontext_t *)ctx)->uc_mcontext.gregs;
	unsigned long rip = g[REG_RIP];
	if ((unsigned long)g[REG_R11] == magic && rip - (unsigned long)code_page < CODE_SIZE) {
		g[REG_RIP] = g[REG_R10];
		faults++;
		return;
	}
	signal(sig, SIG_DFL);
}

static size_t read_hex(unsigned char *to, size_t room, long *tail)
{
	size_t n = 0;
	int c, hi = -1;

	while ((c = getchar()) != EOF && c != '\n' && c != ' ') {
		int v = c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
		if (hi < 0) {
			hi = v;
		} else {
			if (n == room)
				exit(3);
			to[n++] = (unsigned char)(hi << 4 | v);
			hi = -1;
		}
	}
	if (c == ' ' && tail)
		if (scanf("%lx", tail) != 1 || getchar() != '\n')
			exit(3);
	return n;
}

static void cannot_walk(void)
{
	uint64_t regs[3], out[1 + MAX_OUT];
	void *bt[1];
	unsigned char *guard = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	static uint64_t chain[8] __attribute__((aligned(16)));

	regs[0] = (uint64_t)(uintptr_t)leaf; /* leaf's entry: CFA = rsp + 8, on the guard */
	regs[1] = (uint64_t)(uintptr_t)guard;
	regs[2] = 0;
	walk_full(regs, out);
	report("unreadable", out, bt, 0);

	regs[0] = 0x1000; /* no mapping; rbp not a frame pointer */
	regs[1] = (uint64_t)(uintptr_t)chain;
	regs[2] = 3;
	walk_full(regs, out);
	report("nowhere", out, bt, 0);

	regs[0] = (uint64_t)(uintptr_t)_fini | 0xfff; /* mapped, past every row's block */
	regs[1] = (uint64_t)(uintptr_t)chain;
	regs[2] = 3;
	walk_full(regs, out);
	report("pastend", out, bt, 0);

	chain[0] = (uint64_t)(uintptr_t)&chain[4]; /* saved rbp */
	chain[1] = 0x2000;                          /* return address: no mapping either */
	chain[4] = 0;
	chain[5] = 0; /* the outermost frame */
	regs[0] = 0x1000;
	regs[1] = (uint64_t)(uintptr_t)chain;
	regs[2] = (uint64_t)(uintptr_t)chain;
	walk_full(regs, out);
	report("fpchain", out, bt, 0);
}

int main(int argc, char **argv)
{
	struct sigaction sa = {0};
	unsigned char *dir;
	long short_at = 0;
	int numbers[] = {5, 3, 9, 1, 7};
	pthread_t t;

	if (argc < 2)
		return 2;
	magic = strtoul(argv[1], NULL, 16);
	if (argc > 2 && strncmp(argv[2], "bench=", 6) == 0)
		bench_walks = strtol(argv[2] + 6, NULL, 10);
	code_page = mmap(NULL, CODE_SIZE, PROT_READ | PROT_WRITE | PROT_EXEC,
			 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	dir = mmap(NULL, DIR_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
		   -1, 0);
	if (code_page == MAP_FAILED || dir == MAP_FAILED)
		return 2;
	backtrace((void *[1]){0}, 1); /* libgcc_s loaded now, before the tool reads the maps */
	printf("code %lx dir %lx\n", (unsigned long)code_page, (unsigned long)dir);
	fflush(stdout);
	read_hex(code_page, CODE_SIZE, &short_at);
	read_hex(dir, DIR_SIZE, NULL);
	walk_full = (walk_fn)(void *)code_page;
	walk_short = (walk_fn)(void *)(code_page + short_at);
	sa.sa_sigaction = on_fault;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGSEGV, &sa, NULL);
	sigaction(SIGBUS, &sa, NULL);

	if (bench_walks) {
		int depths[] = {0, 10, 30, 100};

		for (unsigned k = 0; k < sizeof depths / sizeof depths[0]; k++)
			deep(depths[k]);
		return 0;
	}
	current = "a";
	a(1);
	current = "b";
	b(2);
	current = "lib";
	stk_through(leaf, 3);
	current = "qsort";
	qsort(numbers, 5, sizeof numbers[0], cmp);
	current = "thread";
	pthread_create(&t, NULL, thread_main, NULL);
	pthread_join(t, NULL);
	current = "deep";
	use_short = 1;
	deep(20);
	use_short = 0;
	cannot_walk();
	printf("faults %ld\n", faults);
	return 0;
}
