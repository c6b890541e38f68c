/*
 * A function called in a tight loop, for jump-optimized probes.
 *
 *   optimized T N [R]  T threads (T <= 16) each call work(t, i) for i in 0..N-1, in R rounds
 *                      (default 1); before each round after the first, print "round r" and
 *                      wait for a byte on stdin. tiny() is called once per round: a function
 *                      too short for a jump. hot() is called once per round: its cold part
 *                      jumps into its first bytes.
 *   optimized T N R fork  as above, and first a fork child calls work(0, i) N times, prints
 *                      "child code XX XX XX XX XX" (work's first 5 bytes as it sees them) and
 *                      "child sum S", and exits; the parent waits for it.
 *   optimized T N R exec  as above, then execs itself as "optimized T N" (a new image).
 *   optimized T N R signal  first faulty(NULL) faults inside its first 5 bytes; the SIGSEGV
 *                      handler prints "in handler", waits for a byte on stdin and returns to
 *                      the faulting instruction with rdi fixed; then faulty() is called N times.
 *
 * Output: "round r sum S" after each round, then "total S".
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <ucontext.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static long per_thread_n;
static long sums[16];

__attribute__((noinline)) long work(long t, long i)
{
	long x = t * 1000003 + i;
	return x ^ (x >> 7);
}

__attribute__((noinline)) void tiny(void) { __asm__ volatile(""); }

/* hot() and its cold part as gcc splits them: hot.cold jumps back into hot's first bytes,
 * which a jump at hot must not overwrite (it is never run here). */
long hot(long x);
__asm__(".text\n"
	".globl hot\n"
	".type hot, @function\n"
	"hot:\n"
	"	mov %rdi, %rax\n"
	"	add $1, %rax\n"
	"	add $2, %rax\n"
	"	ret\n"
	".size hot, .-hot\n"
	".type hot.cold, @function\n"
	"hot.cold:\n"
	"	jmp hot + 3\n"
	".size hot.cold, .-hot.cold\n");

/* faulty(p) loads *p at faulty+3: a fault there leaves a signal frame whose rip is inside the
 * region a jump at faulty would displace. */
long faulty(long *p);
__asm__(".text\n"
	".globl faulty\n"
	".type faulty, @function\n"
	"faulty:\n"
	"	nop; nop; nop\n"
	"	mov (%rdi), %rax\n"
	"	ret\n"
	".size faulty, .-faulty\n");

static long valid = 42;

static void on_segv(int sig, siginfo_t *si, void *ctx)
{
	ucontext_t *uc = ctx;
	char c;

	(void)sig;
	(void)si;
	printf("in handler\n");
	if (read(0, &c, 1) < 0)
		_exit(6);
	uc->uc_mcontext.gregs[REG_RDI] = (greg_t)&valid;
}

static void *run(void *arg)
{
	long t = (long)arg, s = 0;

	for (long i = 0; i < per_thread_n; i++)
		s += work(t, i);
	sums[t] = s;
	return NULL;
}

int main(int argc, char **argv)
{
	long nthreads = argc > 1 ? atol(argv[1]) : 1;
	long rounds = argc > 3 ? atol(argv[3]) : 1;
	pthread_t tids[16];
	long total = 0;
	char c;

	per_thread_n = argc > 2 ? atol(argv[2]) : 1000;
	setvbuf(stdout, NULL, _IONBF, 0);
	if (nthreads < 1 || nthreads > 16)
		return 2;
	if (argc > 4 && strcmp(argv[4], "fork") == 0) {
		pid_t child = fork();
		int status;

		if (child == 0) {
			const unsigned char *code = (const unsigned char *)work;
			long s = 0;

			for (long i = 0; i < per_thread_n; i++)
				s += work(0, i);
			printf("child code %02x %02x %02x %02x %02x\nchild sum %ld\n", code[0],
			       code[1], code[2], code[3], code[4], s);
			_exit(0);
		}
		if (child < 0 || waitpid(child, &status, 0) != child || status != 0)
			return 4;
	}
	if (argc > 4 && strcmp(argv[4], "signal") == 0) {
		struct sigaction sa = {.sa_sigaction = on_segv, .sa_flags = SA_SIGINFO};
		long s = 0;

		sigaction(SIGSEGV, &sa, NULL);
		printf("faulty %ld\n", faulty(NULL));
		for (long i = 0; i < per_thread_n; i++)
			s += faulty(&valid);
		printf("faulty sum %ld\n", s);
	}
	for (long r = 0; r < rounds; r++) {
		long s = 0;
		if (r > 0) {
			printf("round %ld\n", r);
			if (read(0, &c, 1) < 0)
				return 3;
		}
		tiny();
		total += hot(0) - 3;
		for (long t = 0; t < nthreads; t++)
			pthread_create(&tids[t], NULL, run, (void *)t);
		for (long t = 0; t < nthreads; t++) {
			pthread_join(tids[t], NULL);
			s += sums[t];
		}
		printf("round %ld sum %ld\n", r, s);
		total += s;
	}
	printf("total %ld\n", total);
	if (argc > 4 && strcmp(argv[4], "exec") == 0) {
		char *again[] = {argv[0], argv[1], argv[2], NULL};

		execv("/proc/self/exe", again);
		return 5;
	}
	return 0;
}
