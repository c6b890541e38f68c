/*
 * The return-probe tests' program.
 *
 *   rets leaf N        calls leaf(0..N-1); prints the sum of the results
 *   rets rec D         rec(D) recursing D deep; prints the result
 *   rets tail N        tail_a(i) for i < N: tail_a jumps (a tail call) into tail_b
 *   rets longjmp N     N times: deep(6) longjmps out of its innermost frame; then leaf(1)
 *   rets threads T N D T threads, each calls rec(D) N times
 *   rets fork          forker() forks inside; both processes return from it
 *   rets block D       rec_block(D): at the bottom it reads a line from stdin, then returns
 *   rets waitblock D   reads a line from stdin first, then as block; then rec(D) once more
 *   rets coro N        N rounds of two coroutines (swapcontext) on stacks of their own: A
 *                      calls co_work(3), which at its bottom switches to B; B calls
 *                      co_work(3) to its end and switches back; A's frames return
 *   rets signals N     rec(5) N times while a 1 ms interval timer's handler calls rec(3);
 *                      prints the main loop's sum and whether every handler's result was right
 *   rets names N       name_of(i) for i < N: returns a pointer to "zero", "one", "two" or
 *                      "three" (i % 4); prints the total length of the names
 *   rets mix N         mix(i, -i, 2i, i^5, 7, 1000 - i) for i < N: six arguments, each in its
 *                      register; prints the sum of the results
 *   rets forks N       forker(1) N times, each child _exits(7) once back from it; prints
 *                      how many children exited so
 *   rets reqs T N      T threads, each calls handle(&req) N times, req = {id: t * 1000000 + i,
 *                      len: i % 977, name: "t<t>-<i>"}; handle changes len and name and
 *                      returns id + the len it was given; prints the sum of the results
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/time.h>
#include <ucontext.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sink.h"

volatile long sink;

__attribute__((noinline)) long leaf(long x) { SINK_ADD(x); return x * 2 + 1; }

__attribute__((noinline)) long rec(long n)
{
	SINK_ADD(n);
	if (n <= 0)
		return 0;
	return n + rec(n - 1);
}

static const char *const names[] = {"zero", "one", "two", "three"};

__attribute__((noinline)) const char *name_of(long i) { SINK_ADD(i); return names[i % 4]; }

__attribute__((noinline)) long tail_b(long x) { SINK_ADD(x); return x * 3; }

long tail_a(long x);
/* tail_a(x) = tail_b(x + 1), as a real tail call: a jmp, no frame of its own. */
__asm__(".text\n"
	".globl tail_a\n"
	".type tail_a, @function\n"
	"tail_a:\n"
	"  add $1, %rdi\n"
	"  jmp tail_b\n"
	".size tail_a, .-tail_a\n");

__attribute__((noinline)) long rec_block(long n)
{
	SINK_ADD(n);
	if (n <= 0) {
		char line[64];
		puts("bottom");
		fflush(stdout);
		return fgets(line, sizeof line, stdin) ? 1 : 0;
	}
	return n + rec_block(n - 1);
}

static ucontext_t main_ctx, ctx_a, ctx_b;
static char co_stacks[2][65536] __attribute__((aligned(16))); /* A's below B's */
static long co_a, co_b;

__attribute__((noinline)) long co_work(long n, long who)
{
	SINK_ADD(n);
	if (n == 0) {
		if (who == 0)
			swapcontext(&ctx_a, &ctx_b);
		return 1;
	}
	return co_work(n - 1, who) + 1;
}

/* Every argument register of the ABI, each weighted differently in the result. */
__attribute__((noinline)) long mix(long a, long b, long c, long d, long e, long f)
{
	SINK_ADD(a);
	return a + 2 * b + 3 * c + 5 * d + 7 * e + 11 * f;
}

/* A thread's work: its index t, N calls (of rec(depth), or of handle), the sum of results. */
struct job { long t, n, depth, sum; };

/* A request: handle() changes what it holds, so what it held at the entry is gone at the
 * return (an entry action must read it at the entry). */
struct req { long id; unsigned len; char name[20]; };

__attribute__((noinline)) long handle(struct req *r)
{
	long before = r->len;
	SINK_ADD(before);
	r->len = r->len * 2 + 1;
	memcpy(r->name, "done", 5);
	return r->id + before;
}

static void *requester(void *arg)
{
	struct job *job = arg;
	struct req r;
	for (long i = 0; i < job->n; i++) {
		r.id = job->t * 1000000 + i;
		r.len = (unsigned)(i % 977);
		snprintf(r.name, sizeof r.name, "t%ld-%ld", job->t, i);
		job->sum += handle(&r);
	}
	return NULL;
}

static void run_a(void) { co_a += co_work(3, 0); }

static void run_b(void)
{
	co_b += co_work(3, 1);
	swapcontext(&ctx_b, &ctx_a);
}

static void make(ucontext_t *ctx, char *stack, void (*fn)(void))
{
	getcontext(ctx);
	ctx->uc_stack.ss_sp = stack;
	ctx->uc_stack.ss_size = sizeof co_stacks[0];
	ctx->uc_link = &main_ctx;
	makecontext(ctx, fn, 0);
}

static volatile long handler_calls, handler_bad;

static void on_alarm(int sig)
{
	(void)sig;
	handler_calls++;
	if (rec(3) != 6)
		handler_bad++;
}

static jmp_buf env;

__attribute__((noinline)) long deep(long n)
{
	SINK_ADD(n);
	if (n == 0)
		longjmp(env, 1);
	return deep(n - 1) + 1;
}

static void *worker(void *arg)
{
	struct job *job = arg;
	for (long i = 0; i < job->n; i++)
		job->sum += rec(job->depth);
	return NULL;
}

/* T threads (at most 64) running fn on jobs of N calls each: the sum of their sums. */
static long run_threads(long t, long n, long depth, void *(*fn)(void *))
{
	pthread_t tids[64];
	struct job jobs[64];
	for (long i = 0; i < t && i < 64; i++) {
		jobs[i] = (struct job){i, n, depth, 0};
		pthread_create(&tids[i], NULL, fn, &jobs[i]);
	}
	long total = 0;
	for (long i = 0; i < t && i < 64; i++) {
		pthread_join(tids[i], NULL);
		total += jobs[i].sum;
	}
	return total;
}

__attribute__((noinline)) long forker(long x)
{
	SINK_ADD(x); /* code before the call: room for a jump at the entry */
	pid_t pid = fork();
	if (pid == 0)
		return 100;
	int status = 0;
	waitpid(pid, &status, 0);
	return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "leaf";
	long n = argc > 2 ? atol(argv[2]) : 10;
	if (!strcmp(mode, "leaf")) {
		long sum = 0;
		for (long i = 0; i < n; i++)
			sum += leaf(i);
		printf("leaf sum=%ld\n", sum);
	} else if (!strcmp(mode, "names")) {
		size_t len = 0;
		for (long i = 0; i < n; i++)
			len += strlen(name_of(i));
		printf("names length=%zu\n", len);
	} else if (!strcmp(mode, "rec")) {
		printf("rec=%ld\n", rec(n));
	} else if (!strcmp(mode, "tail")) {
		long sum = 0;
		for (long i = 0; i < n; i++)
			sum += tail_a(i);
		printf("tail sum=%ld\n", sum);
	} else if (!strcmp(mode, "longjmp")) {
		long jumps = 0;
		for (long i = 0; i < n; i++)
			if (setjmp(env))
				jumps++;
			else
				deep(6);
		printf("jumps=%ld leaf=%ld\n", jumps, leaf(1));
	} else if (!strcmp(mode, "threads")) {
		long calls = argc > 3 ? atol(argv[3]) : 10, depth = argc > 4 ? atol(argv[4]) : 5;
		printf("threads total=%ld\n", run_threads(n, calls, depth, worker));
	} else if (!strcmp(mode, "block")) {
		printf("block=%ld\n", rec_block(n));
	} else if (!strcmp(mode, "coro")) {
		for (long i = 0; i < n; i++) {
			make(&ctx_a, co_stacks[0], run_a);
			make(&ctx_b, co_stacks[1], run_b);
			swapcontext(&main_ctx, &ctx_a);
		}
		printf("coro a=%ld b=%ld\n", co_a, co_b);
	} else if (!strcmp(mode, "signals")) {
		struct sigaction sa = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
		sigaction(SIGALRM, &sa, NULL);
		struct itimerval it = {{0, 1000}, {0, 1000}};
		setitimer(ITIMER_REAL, &it, NULL);
		long sum = 0;
		for (long i = 0; i < n; i++)
			sum += rec(5);
		struct itimerval off = {{0, 0}, {0, 0}};
		setitimer(ITIMER_REAL, &off, NULL);
		printf("signals sum=%ld handlers %s\n", sum, handler_bad ? "wrong" : "right");
	} else if (!strcmp(mode, "waitblock")) {
		char line[64];
		if (!fgets(line, sizeof line, stdin))
			return 1;
		printf("block=%ld\n", rec_block(n));
		printf("rec=%ld\n", rec(n));
	} else if (!strcmp(mode, "mix")) {
		long sum = 0;
		for (long i = 0; i < n; i++)
			sum += mix(i, -i, 2 * i, i ^ 5, 7, 1000 - i);
		printf("mix sum=%ld\n", sum);
	} else if (!strcmp(mode, "reqs")) {
		long calls = argc > 3 ? atol(argv[3]) : 10;
		printf("reqs total=%ld\n", run_threads(n, calls, 0, requester));
	} else if (!strcmp(mode, "forks")) {
		long back = 0;
		for (long i = 0; i < n; i++) {
			long r = forker(1);
			if (r == 100)
				_exit(7); /* the child, back from forker */
			back += r;
		}
		printf("forks children=%ld\n", back / 7);
	} else if (!strcmp(mode, "fork")) {
		long r = forker(1);
		if (r == 100) {
			printf("child back\n");
			fflush(stdout);
			_exit(7);
		}
		printf("parent back child=%ld\n", r);
	}
	return 0;
}
