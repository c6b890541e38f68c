/*
 * The program's own int3s, caught by its own SIGTRAP handler, while work() may be probed.
 *
 *   owntraps N [HOLD [GO]]  a loop of work(i); int3; usleep(1000), N times (N = 0: until SIGTERM).
 *                       The handler counts its own int3s (si_code SI_KERNEL, rip right after
 *                       the int3); with HOLD = K, the K-th trap's handler writes "held" on
 *                       stdout and waits, inside the handler (SIGTRAP blocked), for a byte on
 *                       stdin. stdout at the end: "traps=K calls=K sum=S"; the exit status is
 *                       0 only when every int3 was caught exactly once, 2 otherwise. With
 *                       GO = 1 the loop starts at a byte on stdin, once "ready" is written.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static volatile sig_atomic_t traps, bad, stop;
static long hold; /* the trap whose handler waits for stdin (0: none) */
static volatile long sum;

void own_int3(void);
__asm__(".text\n"
	".globl own_int3\n"
	".type own_int3, @function\n"
	"own_int3:\n"
	"	int3\n"
	".globl own_after_int3\n"
	"own_after_int3:\n"
	"	ret\n"
	".size own_int3, .-own_int3\n");
extern char own_after_int3[];

__attribute__((noinline)) long work(long x)
{
	sum += x;
	return x * 2 + 1;
}

static void on_trap(int sig, siginfo_t *si, void *uc_)
{
	ucontext_t *uc = uc_;

	(void)sig;
	if (si->si_code != SI_KERNEL || uc->uc_mcontext.gregs[REG_RIP] != (long)own_after_int3)
		bad = 1;
	traps++;
	if (traps == hold) {
		char c;

		if (write(1, "held\n", 5) != 5 || read(0, &c, 1) != 1)
			bad = 1;
	}
}

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 0;
	long i;
	struct sigaction sa;

	hold = argc > 2 ? atol(argv[2]) : 0;
	long go = argc > 3 ? atol(argv[3]) : 0;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_trap;
	sa.sa_flags = SA_SIGINFO;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTRAP, &sa, NULL);
	sa.sa_flags = 0;
	sa.sa_handler = on_term;
	sigaction(SIGTERM, &sa, NULL);
	printf("ready\n");
	fflush(stdout);
	if (go) {
		char c;

		if (read(0, &c, 1) != 1)
			return 2;
	}
	for (i = 0; (n == 0 || i < n) && !stop; i++) {
		work(i);
		own_int3();
		if (traps != i + 1 || bad) {
			printf("traps=%ld calls=%ld bad=%d\n", (long)traps, i + 1, (int)bad);
			return 2;
		}
		usleep(1000);
	}
	printf("traps=%ld calls=%ld sum=%ld\n", (long)traps, i, sum);
	return 0;
}
