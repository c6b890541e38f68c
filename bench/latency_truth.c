/* A function of known duration, for `python -m bench.latency_truth` (issue 20, item 6).
 *
 *   latency_truth NS N     calls spin(NS) N times; spin busy-waits NS ns on the TSC, whose
 *                          rate it measures first against CLOCK_MONOTONIC over 100 ms;
 *                          prints the mean duration of a call as the program saw it (rdtsc
 *                          around each call: the truth a latency tool should report)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <x86intrin.h>

static double ticks_per_ns;

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

__attribute__((noinline)) long spin(long ns)
{
	uint64_t end = __rdtsc() + (uint64_t)((double)ns * ticks_per_ns);
	long rounds = 0;
	while (__rdtsc() < end)
		rounds++;
	return rounds;
}

int main(int argc, char **argv)
{
	long ns = argc > 1 ? atol(argv[1]) : 200, n = argc > 2 ? atol(argv[2]) : 100000;
	uint64_t t0 = now_ns(), c0 = __rdtsc();
	while (now_ns() - t0 < 100000000u)
		;
	ticks_per_ns = (double)(__rdtsc() - c0) / (double)(now_ns() - t0);
	uint64_t inside = 0;
	long sink = 0;
	for (long i = 0; i < n; i++) {
		uint64_t a = __rdtsc();
		sink += spin(ns);
		inside += __rdtsc() - a;
	}
	printf("truth_ns=%.1f sink=%ld\n", (double)inside / (double)n / ticks_per_ns, sink > 0 ? 1L : 0L);
	return 0;
}
