/* What busy.c, churn.c and shy.c share: SIGTERM, SIGINT and SIGUSR1 set `stop`, which ends
 * a run that was started to go on until told (the tests end runs early with them). */
#include <signal.h>
#include <string.h>

static volatile sig_atomic_t stop;

static void on_stop_signal(int sig)
{
	(void)sig;
	stop = 1;
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
