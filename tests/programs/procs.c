/*
 * Process life cycle under probes: fork, vfork, posix_spawn, exec and exit.
 *
 *   procs fork N M K     parent: work() N times; fork; child: work() M times, exits 0;
 *                        parent waits, then work() K more times. stderr: "child pid=P".
 *   procs forkwait M K   fork at once; both wait for SIGUSR1 (stderr: "child pid=P" from
 *                        the parent once both wait); child: work() M times, exits 0;
 *                        parent waits for it, then work() K times.
 *   procs forkvfork      fork; the child vforks a grandchild that calls work(500) and
 *                        _exits 0, then calls work() 3 times from 1000; the parent waits,
 *                        then work() 3 times from 2000. stderr: "child pid=P".
 *   procs vfork N        parent: work() N times; a vfork child calls work() (in the
 *                        parent's memory) then execs /bin/true; a second vfork child calls
 *                        work() and _exit(5); parent: work() N more times.
 *   procs spawn N        parent: work() N times around 3 posix_spawn()s of /bin/true.
 *   procs exec N M       work() N times, then exec itself as "procs phase2 M": prints
 *                        "phase2 ready", waits for EOF on stdin, work() M times.
 *   procs exit CODE      work() 3 times, print "works=15", exit(CODE).
 *   procs abort          work() 3 times, print "works=15", abort().
 */
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

__attribute__((noinline)) long work(long x) { return x * 3 + 2; }

static long works(long from, long n)
{
	long s = 0;

	for (long i = from; i < from + n; i++)
		s += work(i);
	return s;
}

static void print_status(const char *what, int st)
{
	if (WIFEXITED(st))
		printf("%s exit=%d\n", what, WEXITSTATUS(st));
	else if (WIFSIGNALED(st))
		printf("%s signal=%d\n", what, WTERMSIG(st));
	else
		printf("%s status=%#x\n", what, st);
}

static int mode_fork(long n, long m, long k)
{
	long s = works(0, n);
	int st = 0; /* printed even if waitpid failed */

	printf("parent before=%ld\n", s);
	pid_t pid = fork();
	if (pid == 0) {
		printf("child sum=%ld\n", works(1000, m));
		exit(0);
	}
	fprintf(stderr, "child pid=%d\n", (int)pid);
	waitpid(pid, &st, 0);
	print_status("child", st);
	printf("parent after=%ld\n", works(2000, k));
	return 0;
}

static int mode_forkwait(long m, long k)
{
	sigset_t usr1;
	int sig, st = 0, ready[2];

	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	sigprocmask(SIG_BLOCK, &usr1, NULL);
	if (pipe(ready) != 0)
		return 1;
	pid_t pid = fork();
	if (pid == 0) {
		close(ready[0]);
		close(ready[1]); /* the parent's read sees EOF: the child is about to wait */
		sigwait(&usr1, &sig);
		printf("child sum=%ld\n", works(1000, m));
		exit(0);
	}
	close(ready[1]);
	char c;
	while (read(ready[0], &c, 1) > 0)
		;
	fprintf(stderr, "child pid=%d\n", (int)pid);
	sigwait(&usr1, &sig);
	waitpid(pid, &st, 0);
	print_status("child", st);
	printf("parent after=%ld\n", works(2000, k));
	return 0;
}

static int mode_forkvfork(void)
{
	int st = 0;
	pid_t pid = fork();
	if (pid == 0) {
		volatile long grandchild_work = 0;
		pid_t grandchild = vfork();
		if (grandchild == 0) {
			grandchild_work = work(500);
			_exit(0);
		}
		waitpid(grandchild, &st, 0);
		print_status("grandchild", st);
		printf("grandchild work=%ld child sum=%ld\n", grandchild_work, works(1000, 3));
		exit(0);
	}
	fprintf(stderr, "child pid=%d\n", (int)pid);
	waitpid(pid, &st, 0);
	print_status("child", st);
	printf("parent after=%ld\n", works(2000, 3));
	return 0;
}

static int mode_vfork(long n)
{
	volatile long child_work = 0;
	int st = 0; /* printed even if waitpid failed */

	printf("parent before=%ld\n", works(0, n));
	pid_t pid = vfork();
	if (pid == 0) {
		char *argv[] = {"true", NULL};
		child_work = work(500);
		execve("/bin/true", argv, environ);
		_exit(127);
	}
	waitpid(pid, &st, 0);
	print_status("vfork+exec child", st);
	printf("child work=%ld\n", child_work);
	pid = vfork();
	if (pid == 0) {
		child_work = work(600);
		_exit(5);
	}
	waitpid(pid, &st, 0);
	print_status("vfork+_exit child", st);
	printf("child work=%ld\n", child_work);
	printf("parent after=%ld\n", works(2000, n));
	return 0;
}

static int mode_spawn(long n)
{
	char *argv[] = {"true", NULL};
	long s = 0;

	for (int i = 0; i < 3; i++) {
		pid_t pid;
		int st = 0, rc;

		s += works(i * 1000, n);
		rc = posix_spawn(&pid, "/bin/true", NULL, NULL, argv, environ);
		if (rc != 0) {
			printf("spawn %d failed rc=%d\n", i, rc);
			continue;
		}
		waitpid(pid, &st, 0);
		char what[32];
		snprintf(what, sizeof what, "spawn %d", i);
		print_status(what, st);
	}
	printf("parent sum=%ld\n", s);
	return 0;
}

static int mode_exec(const char *self, long n, const char *m)
{
	char *argv[] = {"procs", "phase2", (char *)m, NULL};

	printf("phase1 sum=%ld\n", works(0, n));
	execve(self, argv, environ);
	printf("exec failed\n");
	return 1;
}

static int mode_phase2(long m)
{
	char buf[64];

	printf("phase2 ready\n");
	while (read(0, buf, sizeof buf) > 0)
		;
	printf("phase2 sum=%ld\n", works(100, m));
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc > 4 && strcmp(argv[1], "fork") == 0)
		return mode_fork(atol(argv[2]), atol(argv[3]), atol(argv[4]));
	if (argc > 3 && strcmp(argv[1], "forkwait") == 0)
		return mode_forkwait(atol(argv[2]), atol(argv[3]));
	if (argc > 1 && strcmp(argv[1], "forkvfork") == 0)
		return mode_forkvfork();
	if (argc > 2 && strcmp(argv[1], "vfork") == 0)
		return mode_vfork(atol(argv[2]));
	if (argc > 2 && strcmp(argv[1], "spawn") == 0)
		return mode_spawn(atol(argv[2]));
	if (argc > 3 && strcmp(argv[1], "exec") == 0)
		return mode_exec("/proc/self/exe", atol(argv[2]), argv[3]);
	if (argc > 2 && strcmp(argv[1], "phase2") == 0)
		return mode_phase2(atol(argv[2]));
	if (argc > 2 && strcmp(argv[1], "exit") == 0) {
		printf("works=%ld\n", works(0, 3));
		exit(atoi(argv[2]));
	}
	if (argc > 1 && strcmp(argv[1], "abort") == 0) {
		printf("works=%ld\n", works(0, 3));
		abort();
	}
	fprintf(stderr, "usage: procs fork N M K | vfork N | spawn N | exec N M | exit CODE | abort\n");
	return 2;
}
