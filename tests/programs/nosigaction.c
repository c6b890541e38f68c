/*
 * A program that may not change its signal actions: a seccomp filter makes rt_sigaction fail
 * with EPERM. kprobes must still probe it (without its rescue handler).
 *
 *   nosigaction N     once the filter is in place, writes "ready" on stderr and waits for a
 *                     line on stdin (time to attach and probe, however long it takes), then
 *                     calls hot(i) N times; prints the sum
 */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

volatile long sink;

__attribute__((noinline)) long hot(long i)
{
	sink += i;
	return i * 3 + 1;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 1000;
	struct sock_filter code[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_rt_sigaction, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { sizeof code / sizeof code[0], code };
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
		perror("seccomp");
		return 2;
	}
	fprintf(stderr, "ready\n");
	fflush(stderr);
	char line[16];
	if (!fgets(line, sizeof line, stdin))
		return 3;
	long sum = 0;
	for (long i = 0; i < n; i++)
		sum += hot(i);
	printf("sum=%ld\n", sum);
	return 0;
}
