/*
 * Threads that hammer one straight-line function, for optimized probes on every instruction
 * boundary of it: mix() is hand-written so that the jumps' regions sit where a detour can go
 * wrong, each result is checked against a C model of it, and its exact hit counts are known.
 *
 *   hammer THREADS CALLS
 *
 *   THREADS  workers (1..16): the main thread is worker 0, THREADS-1 pthreads the others.
 *   CALLS    calls of mix(t, i), i = 0..CALLS-1, per worker; -1 = until SIGTERM, SIGINT or
 *            SIGUSR1 (every worker finishes its call and the program ends normally, exit 0).
 *
 * Once every worker runs, "hammer PID ready" goes to stderr (time to attach).
 *
 * In mix(), per call: every instruction runs once, except the loop's three (rol, xor, dec,
 * jnz run 3 times). What a wrong detour would break:
 *   - flags live across a region: ZF (test ... sete), CF (bt ... adc), OF (add ... seto),
 *     each set before a region and read after it, and each changing from call to call;
 *   - the red zone: a value stored at -8(%rsp) before the loop and read after it, with
 *     regions in between (a detour that pushed without stepping over it would overwrite it);
 *   - rip-relative operands in displaced instructions (the load of salt, the store to sink);
 *   - the loop's jnz lands on the loop's first instruction: a jump there may go in, one that
 *     covers it may not.
 *
 * Output on stdout, deterministic: CALLS >= 0: "thread W: CALLS calls, sum S" per worker in
 * order, then "total: N calls of mix"; CALLS = -1: "thread W: every call checked" per worker,
 * then "total: THREADS threads stopped", and on stderr "hammer: thread W made N calls" (how
 * many depends on when the signal came). A wrong result prints "thread W: call I: mix = X,
 * expected Y" on stderr and exits 1.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "stop_signals.h"

#define MAX_THREADS 16

long salt = 0x5bd1e9955bd1e995;
long sink;

long mix(long t, long i);
__asm__(".text\n"
	".globl mix\n"
	".type mix, @function\n"
	"mix:\n"
	"	mov %rdi, %rax\n"
	"	imul $1000003, %rax, %rax\n"
	"	add %rsi, %rax\n"
	"	test $0x20, %sil\n" /* ZF = !(i & 32) */
	"	mov salt(%rip), %rdx\n"
	"	sete %r9b\n"
	"	bt $3, %esi\n" /* CF = (i >> 3) & 1 */
	"	mov %rdx, %r8\n"
	"	movzbl %r9b, %r9d\n"
	"	adc $0, %rdx\n"
	"	mov %rax, %r10\n"
	"	shl $40, %r10\n"
	"	add %r10, %r10\n" /* OF = bit 23 ^ bit 22 of rax */
	"	mov %rax, -8(%rsp)\n"
	"	seto %r10b\n"
	"	movzbl %r10b, %r10d\n"
	"	mov $3, %ecx\n"
	"1:	rol $5, %rax\n"
	"	xor %rdx, %rax\n"
	"	dec %ecx\n"
	"	jnz 1b\n"
	"	add -8(%rsp), %rax\n"
	"	lea (%rax,%r9,8), %rax\n"
	"	lea (%rax,%r10,4), %rax\n"
	"	sub %r8, %rax\n"
	"	mov %rax, sink(%rip)\n"
	"	ret\n"
	".size mix, .-mix\n");

/* What mix() computes, in C. */
static long mix_model(long t, long i)
{
	unsigned long a = (unsigned long)t * 1000003u + (unsigned long)i;
	unsigned long zf = !(i & 32), cf = (i >> 3) & 1, of = ((a >> 23) ^ (a >> 22)) & 1;
	unsigned long d = (unsigned long)salt + cf, saved = a;

	for (int k = 0; k < 3; k++)
		a = ((a << 5) | (a >> 59)) ^ d;
	return (long)(a + saved + zf * 8 + of * 4 - (unsigned long)salt);
}

struct worker {
	long id, calls;
	unsigned long sum; /* wraps: a sum of longs this size overflows (undefined) */
	pthread_t thread;
};

static struct worker workers[MAX_THREADS];
static pthread_barrier_t started;
static long calls;

static void *work(void *arg)
{
	struct worker *w = arg;

	pthread_barrier_wait(&started);
	if (w->id == 0)
		fprintf(stderr, "hammer %d ready\n", (int)getpid());
	for (long i = 0; calls < 0 ? !STOPPED() : i < calls; i++) {
		long got = mix(w->id, i), want = mix_model(w->id, i);
		if (got != want) {
			fprintf(stderr, "thread %ld: call %ld: mix = %ld, expected %ld\n", w->id, i,
				got, want);
			exit(1);
		}
		w->sum += (unsigned long)got;
		w->calls++;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: hammer THREADS CALLS\n");
		return 2;
	}
	long threads = atol(argv[1]);
	calls = atol(argv[2]);
	if (threads < 1 || threads > MAX_THREADS || calls < -1) {
		fprintf(stderr, "hammer: THREADS in 1..%d, CALLS >= -1\n", MAX_THREADS);
		return 2;
	}
	setvbuf(stderr, NULL, _IONBF, 0);
	stop_on_signals();
	pthread_barrier_init(&started, NULL, (unsigned)threads);
	for (long t = 0; t < threads; t++) {
		workers[t].id = t;
		if (t > 0 && pthread_create(&workers[t].thread, NULL, work, &workers[t]) != 0) {
			perror("pthread_create");
			return 1;
		}
	}
	work(&workers[0]);
	for (long t = 1; t < threads; t++)
		pthread_join(workers[t].thread, NULL);
	for (long t = 0; t < threads; t++) {
		if (calls >= 0)
			printf("thread %ld: %ld calls, sum %ld\n", t, calls, (long)workers[t].sum);
		else {
			printf("thread %ld: every call checked\n", t);
			fprintf(stderr, "hammer: thread %ld made %ld calls\n", t, workers[t].calls);
		}
	}
	if (calls >= 0)
		printf("total: %ld calls of mix\n", threads * calls);
	else
		printf("total: %ld threads stopped\n", threads);
	return 0;
}
