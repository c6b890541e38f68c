/*
 * Threads that allocate: the program whose libc a tool probes again and again (issue 17's
 * `trace -p PID 'libc:malloc size=%di' -n 100`, run many times), to see what each session
 * leaves in its memory.
 *
 *   allocs THREADS
 *
 *   THREADS  how many threads (1..16): the main thread is worker 0. Each loops until SIGTERM,
 *            SIGINT or SIGUSR1: malloc() a block of 16..271 bytes, fill it with a pattern
 *            of its size, checksum() it (a leaf of this program), free() it.
 *
 * Once every worker runs it writes "allocs PID ready WORD" to stderr: WORD is the address, in
 * hex, of a word in worker 0's stack frame that the program never reads (a test writes there
 * what a signal frame would hold: an address it may return to).
 *
 * Output on stdout: "allocs: THREADS threads, every block checked", exit 0. A block whose
 * checksum is wrong, or a failed malloc, prints a line on stderr and exits 1.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stop_signals.h"

#define MAX_THREADS 16

static pthread_barrier_t started;

__attribute__((noinline)) unsigned long checksum(const unsigned char *p, size_t n)
{
	unsigned long sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += p[i];
	return sum;
}

static void *work(void *arg)
{
	long id = (long)arg;
	volatile unsigned long word = 0;
	pthread_barrier_wait(&started);
	if (id == 0) {
		fprintf(stderr, "allocs %d ready %lx\n", (int)getpid(), (unsigned long)&word);
		fflush(stderr);
	}
	for (unsigned long i = 0; !stop; i++) {
		size_t n = 16 + (i & 255);
		unsigned char *p = malloc(n);
		if (p == NULL) {
			fprintf(stderr, "allocs: thread %ld: malloc(%zu) failed\n", id, n);
			exit(1);
		}
		memset(p, (int)(n & 0x7f), n);
		unsigned long want = (unsigned long)(n & 0x7f) * n;
		unsigned long got = checksum(p, n);
		if (got != want) {
			fprintf(stderr, "allocs: thread %ld: checksum %lu, expected %lu\n", id, got,
				want);
			exit(1);
		}
		free(p);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long threads = argc == 2 ? atol(argv[1]) : 0;
	if (threads < 1 || threads > MAX_THREADS) {
		fprintf(stderr, "usage: allocs THREADS (1..%d)\n", MAX_THREADS);
		return 2;
	}
	stop_on_signals();
	pthread_t workers[MAX_THREADS];
	pthread_barrier_init(&started, NULL, (unsigned)threads);
	for (long t = 1; t < threads; t++) {
		if (pthread_create(&workers[t], NULL, work, (void *)t) != 0) {
			perror("pthread_create");
			return 1;
		}
	}
	work((void *)0);
	for (long t = 1; t < threads; t++)
		pthread_join(workers[t], NULL);
	printf("allocs: %ld threads, every block checked\n", threads);
	return 0;
}
