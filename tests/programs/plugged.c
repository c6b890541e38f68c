/* Linked against libplug.so: its resolver and constructor run before main().
 *
 *   plugged N [PROGRAM ARGS...]   sum of plug_work(i) for i in 0..N-1, and plug_fast_ptr(N);
 *                                 then exec PROGRAM if given
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

long plug_work(long x);
extern long (*plug_fast_ptr)(long);
extern long plug_seen;

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10, s = 0;

	for (long i = 0; i < n; i++)
		s += plug_work(i);
	printf("plugged sum=%ld fast=%ld seen=%ld\n", s, plug_fast_ptr(n), plug_seen);
	if (argc > 2) {
		fflush(stdout);
		execv(argv[2], argv + 2);
		perror("execv");
		return 127;
	}
	return 0;
}
