/*
 * Short-lived threads: the program whose threads come and go while a tracer stops the world.
 *
 *   churn ROUNDS THREADS CALLS
 *
 *   ROUNDS   how many rounds; each creates THREADS threads, every one of which calls the leaf
 *            hot(i) for i in 0..CALLS-1, checks each result and exits; the main thread joins
 *            them all before the next round. -1 = rounds until SIGTERM, SIGINT or SIGUSR1
 *            arrives (the handler only sets a flag: the round in progress ends, exit 0).
 *   THREADS  threads a round (1..64).
 *   CALLS    calls of hot per thread (>= 0).
 *
 * Once the first round started it writes "churn PID ready" to stderr (time to attach).
 *
 * Output on stdout, deterministic for given arguments (in the -1 mode it does not depend on
 * when the signal came):
 *   ROUNDS >= 0:  "churn: ROUNDS rounds of THREADS threads, N calls of hot, sum S"
 *   ROUNDS = -1:  "churn: rounds of THREADS threads, every call checked"
 * and exit status 0. A wrong result prints "churn: call I: hot = X, expected Y" on stderr and
 * exits 1. In the -1 mode the number of rounds goes to stderr ("churn: N rounds").
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

static long calls;
volatile long sink;

__attribute__((noinline)) long hot(long i)
{
	SINK_ADD(i);
	return i * 3 + 1;
}

static void *work(void *arg)
{
	long sum = 0;

	(void)arg;
	for (long i = 0; i < calls; i++) {
		long h = hot(i);
		if (h != i * 3 + 1) {
			fprintf(stderr, "churn: call %ld: hot = %ld, expected %ld\n", i, h, i * 3 + 1);
			exit(1);
		}
		sum += h;
	}
	return (void *)sum;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: churn ROUNDS THREADS CALLS\n");
		return 2;
	}
	long rounds = atol(argv[1]), threads = atol(argv[2]);
	calls = atol(argv[3]);
	if (rounds < -1 || threads < 1 || threads > MAX_THREADS || calls < 0) {
		fprintf(stderr, "churn: ROUNDS >= -1, THREADS in 1..%d, CALLS >= 0\n", MAX_THREADS);
		return 2;
	}
	stop_on_signals();

	pthread_t tids[MAX_THREADS];
	long done = 0, total = 0;
	for (; rounds < 0 ? !STOPPED() : done < rounds; done++) {
		for (long t = 0; t < threads; t++) {
			if (pthread_create(&tids[t], NULL, work, NULL) != 0) {
				perror("pthread_create");
				return 1;
			}
		}
		if (done == 0) {
			fprintf(stderr, "churn %d ready\n", (int)getpid());
			fflush(stderr);
		}
		for (long t = 0; t < threads; t++) {
			void *sum;
			pthread_join(tids[t], &sum);
			total += (long)sum;
		}
	}
	if (rounds >= 0) {
		printf("churn: %ld rounds of %ld threads, %ld calls of hot, sum %ld\n", rounds, threads,
		       rounds * threads * calls, total);
	} else {
		printf("churn: rounds of %ld threads, every call checked\n", threads);
		fprintf(stderr, "churn: %ld rounds\n", done);
	}
	return 0;
}
