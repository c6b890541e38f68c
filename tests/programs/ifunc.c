/*
 * libc's strlen is an ifunc: the symbol's value is a resolver, the function actually called
 * is the one the resolver picked for this CPU. "libc:strlen" must be that one.
 *
 *   ifunc N     prints "strlen=ADDR marker=ADDR" (what dlsym returns in this process and the
 *               address of the marker string), then calls strlen(marker) N times through the
 *               pointer dlsym returned; prints "total=N*13".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char marker[] = "ifunc marker!";

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10;
	size_t (*volatile fn)(const char *) = (size_t (*)(const char *))dlsym(RTLD_DEFAULT, "strlen");
	size_t total = 0;

	setvbuf(stdout, NULL, _IONBF, 0);
	printf("strlen=%#lx marker=%#lx\n", (unsigned long)fn, (unsigned long)marker);
	for (long i = 0; i < n; i++)
		total += fn(marker);
	printf("total=%zu\n", total);
	return 0;
}
