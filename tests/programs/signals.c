/*
 * Signals around probes.
 *
 *   signals alarm N INTERVAL_US   a SIGALRM itimer fires while the hot loop calls mix() N
 *                                 times; the handler calls on_alarm(). stdout: "mix=..."
 *                                 (deterministic); stderr: "alarms=K on_alarm=K".
 *   signals trap                  the program's own raise(SIGTRAP) and int3, caught by its own
 *                                 SIGTRAP handler (which calls work()).
 *   signals pause                 a raw pause syscall (kpt_pause) interrupted by SIGALRM.
 *   signals sysloop N INTERVAL_US N raw getppid syscalls (kpt_getppid) under a SIGALRM itimer.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <ucontext.h>
#include <unistd.h>

static volatile sig_atomic_t alarms;
static volatile long on_alarm_calls;
static volatile long spin_sink;

long kpt_pause(void);
long kpt_getppid(void);

/*
 * kpt_pause:   mov $34, %eax (SYS_pause); syscall; ret      -- the syscall is at +0x5
 * kpt_getppid: mov $110, %eax (SYS_getppid); syscall; ret   -- the syscall is at +0x5
 * kpt_int3_site: int3 at +0x0, then kpt_after_int3 (ret)
 */
__asm__(".text\n"
	".globl kpt_pause\n"
	".type kpt_pause, @function\n"
	"kpt_pause:\n"
	"	mov $34, %eax\n"
	"	syscall\n"
	"	ret\n"
	".size kpt_pause, .-kpt_pause\n"
	".globl kpt_getppid\n"
	".type kpt_getppid, @function\n"
	"kpt_getppid:\n"
	"	mov $110, %eax\n"
	"	syscall\n"
	"	ret\n"
	".size kpt_getppid, .-kpt_getppid\n"
	".globl kpt_int3_site\n"
	".type kpt_int3_site, @function\n"
	"kpt_int3_site:\n"
	"	int3\n"
	".globl kpt_after_int3\n"
	"kpt_after_int3:\n"
	"	ret\n"
	".size kpt_int3_site, .-kpt_int3_site\n");
extern char kpt_after_int3[];
void kpt_int3_site(void);

__attribute__((noinline)) unsigned long mix(unsigned long h, unsigned long i)
{
	h ^= i + 0x9e3779b97f4a7c15UL + (h << 6) + (h >> 2);
	return h * 0xff51afd7ed558ccdUL;
}

/* Called by the SIGALRM handler, its only writer: a lock-free atomic is what a handler may
 * write besides a volatile sig_atomic_t (the same load, add and store as ++). */
__attribute__((noinline)) void on_alarm(void)
{
	__atomic_store_n(&on_alarm_calls, __atomic_load_n(&on_alarm_calls, __ATOMIC_RELAXED) + 1,
			 __ATOMIC_RELAXED);
}

__attribute__((noinline)) long work(long x) { return x * 2 + 1; }

static void alarm_handler(int sig)
{
	(void)sig;
	alarms++;
	on_alarm();
}

static void set_itimer(long interval_us, long first_us)
{
	struct itimerval it = {{interval_us / 1000000, interval_us % 1000000},
			       {first_us / 1000000, first_us % 1000000}};
	setitimer(ITIMER_REAL, &it, NULL);
}

static void catch_alarm(int flags)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof sa);
	sa.sa_handler = alarm_handler;
	sa.sa_flags = flags;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGALRM, &sa, NULL);
}

static int mode_alarm(long n, long interval_us)
{
	unsigned long h = 1;

	catch_alarm(SA_RESTART);
	set_itimer(interval_us, interval_us);
	for (long i = 0; i < n; i++) {
		h = mix(h, (unsigned long)i);
		for (int k = 0; k < 200; k++) /* a little work between calls: alarms land anywhere */
			spin_sink += k;
	}
	set_itimer(0, 0);
	printf("mix=%016lx\n", h);
	fprintf(stderr, "alarms=%ld on_alarm=%ld\n", (long)alarms, on_alarm_calls);
	return 0;
}

static volatile int traps;
static volatile long trap_codes[2];
static volatile int trap_rip_ok[2];
static volatile long trap_work;

static void trap_handler(int sig, siginfo_t *si, void *uc_)
{
	ucontext_t *uc = uc_;
	int k = traps;

	(void)sig;
	if (k < 2) {
		trap_codes[k] = si->si_code;
		trap_rip_ok[k] = uc->uc_mcontext.gregs[REG_RIP] == (greg_t)kpt_after_int3;
	}
	traps = k + 1;
	trap_work += work(k);
}

static int mode_trap(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = trap_handler;
	sa.sa_flags = SA_SIGINFO;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTRAP, &sa, NULL);

	raise(SIGTRAP);
	printf("raise: traps=%d code=%ld\n", traps, trap_codes[0]);
	kpt_int3_site();
	printf("int3: traps=%d code=%ld rip_ok=%d\n", traps, trap_codes[1], trap_rip_ok[1]);
	printf("work=%ld\n", trap_work);
	return 0;
}

static int mode_pause(void)
{
	catch_alarm(0);
	set_itimer(0, 100000);
	long r = kpt_pause();
	printf("pause=%ld alarms=%d\n", r, (int)alarms);
	return 0;
}

static int mode_sysloop(long n, long interval_us)
{
	long ppid = getppid(), ok = 0;

	catch_alarm(SA_RESTART);
	set_itimer(interval_us, interval_us);
	for (long i = 0; i < n; i++)
		ok += kpt_getppid() == ppid;
	set_itimer(0, 0);
	printf("sysloop ok=%ld of %ld\n", ok, n);
	fprintf(stderr, "alarms=%ld\n", (long)alarms);
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc > 1 && strcmp(argv[1], "alarm") == 0 && argc > 3)
		return mode_alarm(atol(argv[2]), atol(argv[3]));
	if (argc > 1 && strcmp(argv[1], "trap") == 0)
		return mode_trap();
	if (argc > 1 && strcmp(argv[1], "pause") == 0)
		return mode_pause();
	if (argc > 1 && strcmp(argv[1], "sysloop") == 0 && argc > 3)
		return mode_sysloop(atol(argv[2]), atol(argv[3]));
	fprintf(stderr, "usage: signals alarm N US | trap | pause | sysloop N US\n");
	return 2;
}
