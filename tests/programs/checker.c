/*
 * A checker: threads in tight loops that call a probed function, recurse, allocate and free,
 * and check every result, for the stress test of the command line (tests/stress_commands.py).
 *
 *   checker THREADS
 *
 *   THREADS  workers (1..32): the main thread is worker 0, THREADS-1 pthreads the others.
 *
 * Each iteration i of a worker: work(w, i) (a leaf whose result is known), rec(DEPTH) (a
 * recursion of DEPTH+1 frames whose result is known), nest(DEPTH) (the same through a function
 * whose entry takes a jump: a frame pointer first, so that its return probes nest on the
 * optimized tier), a malloc of 16..1040 bytes filled with
 * a pattern, checked and freed, and the loop counter compared with a second copy kept in
 * memory. A wrong result, a corrupted buffer or a counter that disagrees prints "checker:
 * thread W: ..." on stderr and exits 1 at once: a register, a return address or a stack slot
 * that a probe corrupted shows here.
 *
 * Loops until SIGTERM, SIGINT or SIGUSR1 (every worker finishes its iteration), then prints
 * "checker: THREADS threads, every call checked" on stdout and exits 0. Once every worker
 * runs it writes "checker PID ready" on stderr.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stop_signals.h"

#define MAX_THREADS 32
#define DEPTH 5

static volatile int running_workers;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) unsigned long work(unsigned long w, unsigned long i)
{
	return (w << 32) ^ (i * 2654435761UL) ^ 0x9e3779b97f4a7c15UL;
}

__attribute__((noinline)) unsigned long rec(int depth, unsigned long x)
{
	if (depth == 0)
		return x + 1;
	return rec(depth - 1, x * 3 + (unsigned long)depth) + 1;
}

__attribute__((noinline, optimize("no-omit-frame-pointer", "no-shrink-wrap")))
unsigned long nest(int depth, unsigned long x)
{
	if (depth == 0)
		return x ^ 0x5a;
	return nest(depth - 1, x + (unsigned long)depth) * 2;
}

static unsigned long nest_model(int depth, unsigned long x)
{
	for (int d = depth; d > 0; d--)
		x += (unsigned long)d;
	return (x ^ 0x5a) << depth;
}

static unsigned long rec_model(int depth, unsigned long x)
{
	unsigned long extra = 0;
	for (int d = depth; d > 0; d--) {
		x = x * 3 + (unsigned long)d;
		extra++;
	}
	return x + 1 + extra;
}

static void bad(unsigned long w, const char *what, unsigned long i, unsigned long got,
		unsigned long want)
{
	fprintf(stderr, "checker: thread %lu: BAD %s at iteration %lu: %lu, expected %lu\n", w, what,
		i, got, want);
	fflush(stderr);
	_exit(1);
}

static void *worker(void *arg)
{
	unsigned long w = (unsigned long)arg;
	volatile unsigned long shadow = 0;
	unsigned long i;

	pthread_mutex_lock(&lock);
	running_workers++;
	pthread_mutex_unlock(&lock);
	for (i = 0; !stop; i++) {
		if (shadow != i)
			bad(w, "iterations", i, shadow, i);
		unsigned long got = work(w, i);
		unsigned long want = (w << 32) ^ (i * 2654435761UL) ^ 0x9e3779b97f4a7c15UL;
		if (got != want)
			bad(w, "work", i, got, want);
		unsigned long seed = i & 0xffff;
		got = rec(DEPTH, seed);
		want = rec_model(DEPTH, seed);
		if (got != want)
			bad(w, "rec", i, got, want);
		got = nest(DEPTH, seed);
		want = nest_model(DEPTH, seed);
		if (got != want)
			bad(w, "nest", i, got, want);
		size_t size = 16 + (i * 7 + w) % 1025;
		unsigned char *buf = malloc(size);
		if (buf == NULL)
			bad(w, "malloc", i, 0, size);
		unsigned char fill = (unsigned char)(i ^ w);
		memset(buf, fill, size);
		for (size_t k = 0; k < size; k++)
			if (buf[k] != fill)
				bad(w, "buffer", i, buf[k], fill);
		free(buf);
		shadow = shadow + 1;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = argc > 1 ? atoi(argv[1]) : 4;
	pthread_t tids[MAX_THREADS];

	if (threads < 1 || threads > MAX_THREADS) {
		fprintf(stderr, "usage: checker THREADS (1..%d)\n", MAX_THREADS);
		return 2;
	}
	stop_on_signals();
	for (int t = 1; t < threads; t++)
		if (pthread_create(&tids[t], NULL, worker, (void *)(unsigned long)t) != 0) {
			perror("pthread_create");
			return 2;
		}
	for (;;) {
		pthread_mutex_lock(&lock);
		int n = running_workers;
		pthread_mutex_unlock(&lock);
		if (n == threads - 1)
			break;
		usleep(1000);
	}
	fprintf(stderr, "checker %d ready\n", (int)getpid());
	worker((void *)0);
	for (int t = 1; t < threads; t++)
		pthread_join(tids[t], NULL);
	printf("checker: %d threads, every call checked\n", threads);
	return 0;
}
