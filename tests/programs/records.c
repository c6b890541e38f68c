/*
 * Calls with good and bad pointers, for the fetch-args of optimized record probes.
 *
 *   records T N [wait]
 *                 T threads (T <= 8) each call note(s, p, t, i) for i in 0..N-1, where
 *                 *p == 3 * i and s is "t<t>", except: when i % 7 == 0, s is NULL and p is
 *                 8 (below mmap_min_addr: never mapped); else when i % 11 == 0, s is a run of
 *                 'x' that reaches a PROT_NONE page with no NUL before it.
 *
 * With "wait", the threads start once a byte can be read from stdin (a tool attaches first).
 * The program never reads through the bad pointers itself. Output: "thread t sum S" for each
 * thread (S: the sum of note's results), then "done".
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static long per_thread_n;
static long sums[8];
static char *edge;          /* 'x' up to a PROT_NONE page */

__attribute__((noinline)) long note(const char *s, const long *p, long t, long i)
{
	__asm__ volatile("" ::"r"(s), "r"(p) : "memory"); /* *p is stored before the call */
	return t * 1000 + i;
}

static void *run(void *arg)
{
	long t = (long)arg;
	char name[8];
	long cell;
	long sum = 0;
	snprintf(name, sizeof name, "t%ld", t);
	for (long i = 0; i < per_thread_n; i++) {
		cell = 3 * i;
		const char *s = name;
		const long *p = &cell;
		if (i % 7 == 0) {
			s = NULL;
			p = (const long *)8;
		} else if (i % 11 == 0) {
			s = edge;
		}
		sum += note(s, p, t, i);
	}
	sums[t] = sum;
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 3 && !(argc == 4 && strcmp(argv[3], "wait") == 0))
		return 2;
	long threads = strtol(argv[1], NULL, 10);
	per_thread_n = strtol(argv[2], NULL, 10);
	if (threads < 1 || threads > 8)
		return 2;
	long page = sysconf(_SC_PAGESIZE);
	char *two = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (two == MAP_FAILED)
		return 1;
	mprotect(two + page, page, PROT_NONE);
	memset(two + page - 100, 'x', 100);
	edge = two + page - 100;
	if (argc == 4) {
		char byte;
		if (read(0, &byte, 1) != 1)
			return 1;
	}
	pthread_t tids[8];
	for (long t = 0; t < threads; t++)
		pthread_create(&tids[t], NULL, run, (void *)t);
	for (long t = 0; t < threads; t++)
		pthread_join(tids[t], NULL);
	for (long t = 0; t < threads; t++)
		printf("thread %ld sum %ld\n", t, sums[t]);
	printf("done\n");
	return 0;
}
