/*
 * A process tree made on demand, for following a process and what it starts (-p, -c).
 *
 *   tree N        prints "ready", waits for a line on stdin, then (every hit counted once):
 *                   main thread: work() N times; a thread: work() N times;
 *                   fork: the child works 2N times, vforks a grandchild that execs
 *                         "tree leaf N", waits for it, exits;
 *                   clone (the raw syscall, a new process): the child works 3N times, exits;
 *                   posix_spawn of "tree leaf N";
 *                   waits for every child; work() N times more; "done".
 *   tree go N     the same without waiting for stdin (for -c).
 *   tree leaf N   leaf() once, work() N times.
 *
 * work() hits: the process alone 3N; with every process it starts 3N + 2N + N + 3N + N = 10N;
 * leaf() hits: 0 in the process alone, 2 with its children.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

__attribute__((noipa)) long work(long x) { return x * 3 + 2; }
__attribute__((noipa)) long leaf(long x) { return x + 1; }

static long n;

static long works(long count)
{
	long s = 0;

	for (long i = 0; i < count; i++)
		s += work(i);
	return s;
}

static void *thread_main(void *arg)
{
	(void)arg;
	works(n);
	return NULL;
}

static void reap(pid_t pid, const char *what)
{
	int st = 0;

	if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
		fprintf(stderr, "tree: %s failed (%#x)\n", what, st);
		exit(1);
	}
}

static int run(const char *self)
{
	char count[32];
	char *leaf_argv[] = {"tree", "leaf", count, NULL};
	pthread_t thread;
	pid_t pid;

	snprintf(count, sizeof count, "%ld", n);
	works(n);
	pthread_create(&thread, NULL, thread_main, NULL);
	pthread_join(thread, NULL);

	pid = fork();
	if (pid == 0) {
		works(2 * n);
		pid_t grandchild = vfork();
		if (grandchild == 0) {
			execve(self, leaf_argv, environ);
			_exit(127);
		}
		reap(grandchild, "vfork+exec");
		exit(0);
	}
	reap(pid, "fork");

	pid = (pid_t)syscall(SYS_clone, SIGCHLD, 0, NULL, NULL, 0);
	if (pid == 0) {
		works(3 * n);
		_exit(0);
	}
	reap(pid, "clone");

	if (posix_spawn(&pid, self, NULL, NULL, leaf_argv, environ) != 0) {
		fprintf(stderr, "tree: posix_spawn failed\n");
		return 1;
	}
	reap(pid, "posix_spawn");

	works(n);
	printf("done\n");
	return 0;
}

int main(int argc, char **argv)
{
	char line[64];
	char self[4096];
	ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);

	if (len < 0)
		return 2;
	self[len] = '\0';
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc > 2 && strcmp(argv[1], "leaf") == 0) {
		leaf(0);
		n = atol(argv[2]);
		works(n);
		return 0;
	}
	if (argc > 2 && strcmp(argv[1], "go") == 0) {
		n = atol(argv[2]);
		return run(self);
	}
	if (argc > 1) {
		n = atol(argv[1]);
		printf("ready\n");
		if (!fgets(line, sizeof line, stdin))
			return 3;
		return run(self);
	}
	fprintf(stderr, "usage: tree N | tree go N | tree leaf N\n");
	return 2;
}
