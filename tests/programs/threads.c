/*
 * Threads hammering one probed function at the same time.
 *
 *   threads T N [wait|slow]  T threads (T <= 64) released together by a barrier; thread t
 *                        calls hammer(t, i) for i in 0..N-1. With "wait", first print "ready"
 *                        and block until a byte (or EOF) arrives on stdin, so that every thread
 *                        is created after a tracer attached. With "slow", print "started" once
 *                        the threads run, and sleep 1 ms after each call (time to attach).
 *
 * Output: one line per thread "thread t sum", then "total S".
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static pthread_barrier_t start;
static long per_thread_n;
static long sums[64];
static int slow;

__attribute__((noinline)) long hammer(long t, long i) { return (t + 1) * 1000003 + i * 7; }

static void *run(void *arg)
{
	long t = (long)arg, s = 0;

	pthread_barrier_wait(&start);
	for (long i = 0; i < per_thread_n; i++) {
		s += hammer(t, i);
		if (slow) {
			struct timespec ts = {0, 1000000};
			nanosleep(&ts, NULL);
		}
	}
	sums[t] = s;
	return NULL;
}

int main(int argc, char **argv)
{
	long nthreads = argc > 1 ? atol(argv[1]) : 8;
	pthread_t tids[64];
	long total = 0;
	char c;

	per_thread_n = argc > 2 ? atol(argv[2]) : 1000;
	setvbuf(stdout, NULL, _IONBF, 0);
	if (nthreads < 1 || nthreads > 64)
		return 2;
	if (argc > 3 && strcmp(argv[3], "wait") == 0) {
		printf("ready\n");
		if (read(0, &c, 1) < 0)
			return 3;
	}
	slow = argc > 3 && strcmp(argv[3], "slow") == 0;
	pthread_barrier_init(&start, NULL, nthreads);
	for (long t = 0; t < nthreads; t++)
		pthread_create(&tids[t], NULL, run, (void *)t);
	if (slow)
		printf("started\n");
	for (long t = 0; t < nthreads; t++) {
		pthread_join(tids[t], NULL);
		printf("thread %ld %ld\n", t, sums[t]);
		total += sums[t];
	}
	printf("total %ld\n", total);
	return 0;
}
