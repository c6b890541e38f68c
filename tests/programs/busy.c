/*
 * A busy program: threads that never sleep, calling a recursive function and a leaf in a
 * tight loop. The program to attach to while it runs (count/trace/latency -p, attach and
 * detach cycles, killing the tool): every call is checked, so a probe that corrupts a
 * register, a return address or the stack shows as a wrong result or a crash.
 *
 *   busy THREADS CALLS DEPTH
 *
 *   THREADS  how many threads do the work (1..64): the main thread is worker 0, and
 *            THREADS-1 pthreads are workers 1..THREADS-1 (so 1 = single-threaded).
 *   CALLS    loop iterations per worker; each makes one rec(DEPTH) (DEPTH+1 calls of rec)
 *            and one hot(i). -1 = loop until SIGTERM, SIGINT or SIGUSR1 arrives (the handler
 *            only sets a flag: every worker finishes its iteration and the program ends
 *            normally, exit 0).
 *   DEPTH    recursion depth of rec (>= 0).
 *
 * Once every worker runs it writes "busy PID ready" to stderr (time to attach).
 *
 * SIGUSR2 only counts: its handler, on_usr2(), adds one to usr2_seen and returns (SA_RESTART),
 * whenever it comes and as often as it comes; it changes no output. It is the signal a test
 * sends while a tracer runs probed instructions out of line (a probe on on_usr2 counts them).
 *
 * Output on stdout, deterministic for given arguments (in the -1 mode it does not depend on
 * when the signal came):
 *   CALLS >= 0:  "thread W: CALLS calls, rec(DEPTH) = R, hot sum = H" per worker, in order,
 *                then "total: N calls of rec, M calls of hot"
 *   CALLS = -1:  "thread W: rec(DEPTH) = R, every call checked" per worker, then
 *                "total: THREADS threads stopped"
 * and exit status 0. A wrong result prints "thread W: call I: rec(DEPTH) = X, expected R"
 * (or hot) on stderr and exits 1. In the -1 mode each worker's number of iterations goes to
 * stderr ("busy: thread W made N iterations"), which is not deterministic.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sink.h"
#include "stop_signals.h"

#define MAX_THREADS 64

volatile sig_atomic_t usr2_seen;
static long calls, depth;
static pthread_barrier_t started;
volatile long sink;

__attribute__((noinline)) long hot(long i)
{
	SINK_ADD(i);
	return i * 3 + 1;
}

__attribute__((noinline)) long rec(long n)
{
	SINK_ADD(n);
	if (n <= 0)
		return 0;
	return n + rec(n - 1);
}

struct worker {
	long id, iterations;
	unsigned long hot_sum; /* wraps, where a long would overflow (undefined) */
	pthread_t thread;
};

static struct worker workers[MAX_THREADS];

static void fail(long id, long i, const char *what, long got, long want)
{
	fprintf(stderr, "thread %ld: call %ld: %s = %ld, expected %ld\n", id, i, what, got, want);
	exit(1);
}

static void *work(void *arg)
{
	struct worker *w = arg;
	long want = depth * (depth + 1) / 2;

	pthread_barrier_wait(&started);
	if (w->id == 0) {
		fprintf(stderr, "busy %d ready\n", (int)getpid());
		fflush(stderr);
	}
	for (long i = 0; calls < 0 ? !STOPPED() : i < calls; i++) {
		long r = rec(depth);
		if (r != want)
			fail(w->id, i, "rec", r, want);
		long h = hot(i);
		if (h != i * 3 + 1)
			fail(w->id, i, "hot", h, i * 3 + 1);
		w->hot_sum += (unsigned long)h;
		w->iterations++;
	}
	return NULL;
}

__attribute__((noinline)) void on_usr2(int sig)
{
	(void)sig;
	usr2_seen++;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: busy THREADS CALLS DEPTH\n");
		return 2;
	}
	long threads = atol(argv[1]);
	calls = atol(argv[2]);
	depth = atol(argv[3]);
	if (threads < 1 || threads > MAX_THREADS || calls < -1 || depth < 0) {
		fprintf(stderr, "busy: THREADS in 1..%d, CALLS >= -1, DEPTH >= 0\n", MAX_THREADS);
		return 2;
	}
	stop_on_signals();
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr2;
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR2, &sa, NULL);

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

	long want = depth * (depth + 1) / 2, total = 0;
	for (long t = 0; t < threads; t++) {
		if (calls >= 0) {
			printf("thread %ld: %ld calls, rec(%ld) = %ld, hot sum = %lu\n", t, calls, depth,
			       want, workers[t].hot_sum);
		} else {
			printf("thread %ld: rec(%ld) = %ld, every call checked\n", t, depth, want);
			fprintf(stderr, "busy: thread %ld made %ld iterations\n", t, workers[t].iterations);
		}
		total += workers[t].iterations;
	}
	if (calls >= 0)
		printf("total: %ld calls of rec, %ld calls of hot\n", total * (depth + 1), total);
	else
		printf("total: %ld threads stopped\n", threads);
	return 0;
}
