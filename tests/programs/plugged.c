/* Linked against libplug.so: its resolver and constructor run before main().
 *
 *   plugged N     sum of plug_work(i) for i in 0..N-1, and plug_fast_ptr(N)
 */
#include <stdio.h>
#include <stdlib.h>

long plug_work(long x);
extern long (*plug_fast_ptr)(long);
extern long plug_seen;

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10, s = 0;

	for (long i = 0; i < n; i++)
		s += plug_work(i);
	printf("plugged sum=%ld fast=%ld seen=%ld\n", s, plug_fast_ptr(n), plug_seen);
	return 0;
}
