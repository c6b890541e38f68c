/* What busy.c, churn.c, hammer.c, placement.c and shy.c share: SIGTERM, SIGINT and SIGUSR1
 * set `stop`, which ends a run that was started to go on until told (the tests end runs early
 * with them). The handler runs in any thread and every worker reads the flag: volatile
 * sig_atomic_t is enough within one thread only, so both sides are relaxed atomics (lock-free,
 * safe in a handler; the same plain loads and store). */
#include <signal.h>
#include <string.h>

static volatile sig_atomic_t stop;
#define STOPPED() __atomic_load_n(&stop, __ATOMIC_RELAXED)

static void on_stop_signal(int sig)
{
	(void)sig;
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
}

static void stop_on_signals(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_stop_signal;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGUSR1, &sa, NULL);
}
