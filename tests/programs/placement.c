/*
 * The CPU placement's program: a thread that is hit often, then the tasks it creates.
 *
 *   placement N    the main thread calls hot(i) for i in 0..N-1, then reports how many CPUs
 *                  it may run on ("main: C cpus"); then a thread it creates reports its own
 *                  ("thread: C cpus"), and a child it forks ("child: C cpus"); then "done".
 *   placement N -1 the same, but first the hot loop forever, until SIGTERM, SIGINT or
 *                  SIGUSR1 (for a test that attaches, detaches and looks at the thread).
 *
 * A tracer that pins the main thread to its own CPU must not pass the pin on: the thread and
 * the child were created by a pinned thread, and inherit its mask unless the tracer says no.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stop_signals.h"

__attribute__((noinline)) long hot(long i) { return i * 3 + 1; }

static int cpus(void)
{
	cpu_set_t set;

	if (sched_getaffinity(0, sizeof set, &set) != 0)
		return -1;
	return CPU_COUNT(&set);
}

static void *report(void *arg)
{
	(void)arg;
	printf("thread: %d cpus\n", cpus());
	return NULL;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10000;
	volatile unsigned long sum = 0; /* the forever loop would overflow a long */
	int forever = argc > 2 && atol(argv[2]) < 0;
	pthread_t thread;

	setvbuf(stdout, NULL, _IONBF, 0);
	if (forever) {
		stop_on_signals();
		fprintf(stderr, "placement %d ready\n", getpid());
		for (long i = 0; !STOPPED(); i++)
			sum += (unsigned long)hot(i);
	}
	for (long i = 0; i < n; i++)
		sum += (unsigned long)hot(i);
	printf("main: %d cpus\n", cpus());
	if (pthread_create(&thread, NULL, report, NULL) != 0 || pthread_join(thread, NULL) != 0)
		return 1;
	pid_t child = fork();
	if (child == 0) {
		printf("child: %d cpus\n", cpus());
		_exit(0);
	}
	if (child < 0 || waitpid(child, NULL, 0) != child)
		return 1;
	printf("done\n");
	return 0;
}
