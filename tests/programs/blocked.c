/*
 * A single thread blocked in a syscall while a tool borrows it for its injections:
 *
 *   blocked read   read(0) until a line comes; stdout: "read N: LINE"
 *   blocked poll   poll(stdin, 10 minutes) first (a call the kernel restarts through its
 *                  restart block), then read; stdout: "poll 1", then as read
 *
 * "waiting" on stderr says the thread is about to block. Then probed() is called once (the
 * tool's probe) and the exit status is 0. A failed call prints "... failed: errno E" and
 * exits 1: a call the kernel would have restarted must never fail because of the tool.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

__attribute__((noinline)) int probed(int n)
{
	__asm__ volatile("" ::: "memory");
	return n + 1;
}

int main(int argc, char **argv)
{
	if (argc != 2)
		return 2;
	fprintf(stderr, "waiting\n");
	if (strcmp(argv[1], "poll") == 0) {
		struct pollfd fd = { .fd = 0, .events = POLLIN };
		int ready = poll(&fd, 1, 600000);
		if (ready < 0) {
			printf("poll failed: errno %d\n", errno);
			return 1;
		}
		printf("poll %d\n", ready);
	}
	char line[64];
	ssize_t n = read(0, line, sizeof line - 1);
	if (n < 0) {
		printf("read failed: errno %d\n", errno);
		return 1;
	}
	line[n] = 0;
	printf("read %zd: %s", n, line);
	return probed((int)n) == (int)n + 1 ? 0 : 3;
}
