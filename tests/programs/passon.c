/*
 * A program that runs another: work() N times, then execs PATH with the arguments after it.
 *
 *   passon N PATH [ARG...]   prints "passon SUM", then execv(PATH, [PATH, ARG...])
 *
 * Its work() has the name of target.c's: a bare `work` names this file's, not the other's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

long total;

__attribute__((noinline)) long work(long i)
{
	total += i;
	return total;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: passon N PATH [ARG...]\n");
		return 2;
	}
	long n = atol(argv[1]);
	for (long i = 0; i < n; i++)
		work(i);
	printf("passon %ld\n", total);
	fflush(stdout);
	execv(argv[2], argv + 2);
	perror("execv");
	return 127;
}
