/*
 * A program that leaves as soon as it is traced: the pid that exits between a tracer's
 * attach and its first registration.
 *
 *   shy
 *
 * Writes "shy PID ready" to stderr, then calls the leaf hot(i) in a loop, looking after each
 * call at its own TracerPid (/proc/self/status). Once a tracer is there it prints
 * "shy: traced after N calls" on stderr and "shy: left" on stdout and exits with status 0.
 * SIGTERM, SIGINT and SIGUSR1 end it the same way (exit 0, "shy: left") untraced.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stop_signals.h"

volatile long sink;

__attribute__((noinline)) long hot(long i)
{
	sink += i;
	return i * 3 + 1;
}

static int is_traced(void)
{
	char line[256];
	int traced = 0;
	FILE *f = fopen("/proc/self/status", "r");

	if (f == NULL)
		return 0;
	while (fgets(line, sizeof line, f) != NULL) {
		if (strncmp(line, "TracerPid:", 10) == 0) {
			traced = atol(line + 10) != 0;
			break;
		}
	}
	fclose(f);
	return traced;
}

int main(void)
{
	stop_on_signals();

	fprintf(stderr, "shy %d ready\n", (int)getpid());
	fflush(stderr);
	long i = 0;
	while (!STOPPED()) {
		hot(i++);
		if (is_traced()) {
			fprintf(stderr, "shy: traced after %ld calls\n", i);
			break;
		}
	}
	printf("shy: left\n");
	return 0;
}
