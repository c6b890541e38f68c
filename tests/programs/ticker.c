/*
 * A slow, steady program to attach to and to kill tracers under.
 *
 *   ticker N DELAY_US    for i in 0..N-1: v = work(i); print "tick i v"; sleep DELAY_US
 *                        then print "done sum"
 *
 * work(i) returns i*i + 1, so every line is known in advance.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

__attribute__((noinline)) long work(long i) { return i * i + 1; }

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10;
	long delay_us = argc > 2 ? atol(argv[2]) : 1000;
	long sum = 0;

	setvbuf(stdout, NULL, _IONBF, 0);
	for (long i = 0; i < n; i++) {
		long v = work(i);
		sum += v;
		printf("tick %ld %ld\n", i, v);
		struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
		while (nanosleep(&ts, &ts) != 0)
			;
	}
	printf("done %ld\n", sum);
	return 0;
}
