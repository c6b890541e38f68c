/*
 * The wall clock around each call, for `trace -T`.
 *
 *   stamps N DELAY_US    for i in 0..N-1: read CLOCK_REALTIME, work(i), read it again,
 *                        print "call i BEFORE AFTER" (ns since the epoch); sleep DELAY_US
 *
 * A hit of work(i) happens between BEFORE and AFTER of its line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

__attribute__((noinline)) long work(long i) { return i * i + 1; }

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10;
	long delay_us = argc > 2 ? atol(argv[2]) : 1000;
	long sum = 0;

	setvbuf(stdout, NULL, _IONBF, 0);
	for (long i = 0; i < n; i++) {
		long long before = now_ns();
		sum += work(i);
		long long after = now_ns();
		printf("call %ld %lld %lld\n", i, before, after);
		struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
		while (nanosleep(&ts, &ts) != 0)
			;
	}
	printf("done %ld\n", sum);
	return 0;
}
