/*
 * Calls lib_work() of libkpt.so.
 *
 *   uselib N     sum of lib_work(i) for i in 0..N-1
 */
#include <stdio.h>
#include <stdlib.h>

long lib_work(long x);

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10, s = 0;

	for (long i = 0; i < n; i++)
		s += lib_work(i);
	printf("lib sum=%ld\n", s);
	return 0;
}
