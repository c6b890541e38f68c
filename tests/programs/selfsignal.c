/*
 * A single thread that signals itself in a tight loop: nearly every stop the tracer makes it
 * take, it takes with a signal of its own pending (a signal-delivery-stop already reported).
 *
 *   selfsignal   work(i); raise(SIGUSR1) until SIGTERM; its handler counts. stdout: "ready",
 *                then at the end "signals=K calls=K" (0 only when every raise was handled
 *                once and every call of work() returned its value).
 */
#include <signal.h>
#include <stdio.h>

static volatile sig_atomic_t got, stop;
static void on_usr1(int sig) { (void)sig; got++; }
static void on_term(int sig) { (void)sig; stop = 1; }

__attribute__((noinline)) long work(long i)
{
	return i * 3 + 1;
}

int main(void)
{
	signal(SIGUSR1, on_usr1);
	signal(SIGTERM, on_term);
	printf("ready\n");
	fflush(stdout);
	long calls = 0, bad = 0;
	while (!stop) {
		if (work(calls) != calls * 3 + 1)
			bad++;
		calls++;
		raise(SIGUSR1);
		if (got != (sig_atomic_t)calls)
			bad++;
	}
	printf("signals=%ld calls=%ld\n", (long)got, calls);
	return bad ? 2 : 0;
}
