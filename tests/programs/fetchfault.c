/*
 * Loads that follow the fetch fault convention of detour code (kprobes/arch/x86_64/abi.py:
 * r11 = FETCH_FAULT_MAGIC, r10 = where to go on if the load faults), in the program's own
 * text, for tests/test_fetch_faults.py. The test declares fetch_start..fetch_end as code of
 * kprobes' own (ProgramCalls.note_own_code, as map_xol_page does for a detour page).
 *
 *   fetchfault OWN STEP...
 *
 * OWN is the program's own SIGSEGV and SIGBUS action, set before anything else:
 *   none      SIG_DFL
 *   siginfo   an SA_SIGINFO handler, SA_ONSTACK on an alternate stack, SIGUSR2 in its mask
 *   plain     a handler without SA_SIGINFO
 *   mixed     SIGSEGV: SA_SIGINFO|SA_ONSTACK|SA_NODEFER|SA_RESTART, mask {SIGHUP, SIGUSR2};
 *             SIGBUS: SIG_IGN (for reading the actions back)
 *
 * It prints "code START END", "actions ..." (the kernel's own struct sigaction of SIGSEGV and
 * SIGBUS) and "ready", then waits for a line on stdin, then runs each STEP and prints one line
 * for it, then exits 0:
 *   fetch:T:R   T threads, R rounds each, fetch a good pointer (42), NULL, a non-canonical
 *               address (a general protection fault), a PROT_NONE page and a page past the end
 *               of a file (SIGBUS): marked loads in our code, so the bad ones give FAULTED
 *   fetch1      one marked load from NULL, in the main thread
 *   blocked:R   R marked loads from NULL in a thread that blocks every signal; then whether it
 *               still blocks SIGSEGV and whether SIGSEGV still has a handler
 *   segv        the program's own fault (an unmarked load from 0x18 outside our code)
 *   segv-ours   the program's own fault in our code (the load there, not marked)
 *   segv-magic  the program's own fault, marked, outside our code
 *   bus         the program's own SIGBUS
 *   overflow    the program's own stack overflow (its handler runs on the alternate stack)
 *   sent        kill(getpid(), SIGSEGV)
 *   sent-marked a timer's SIGSEGV while the thread spins in our code, marked as a fetch is
 *   inside      a thread spins in our code until a second line comes on stdin, then
 *               fetches from NULL there (marked)
 *   actions     the actions again
 * A fault step prints what the handler saw: signal, si_code, whether si_addr and the context's
 * rip are the faulting load's, and whether backtrace() in the handler unwinds through the
 * signal frame to that load (or dies of the signal, as the program would without a handler).
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

typedef unsigned long u64;
#define FAULTED 0xfa17fa17fa17fa17UL

__asm__(".text\n"
	".globl fetch_start, fetch_end, fetch_u64, nomagic_load, nomagic_at, own_load, own_at\n"
	".globl magic_load, magic_at, fetch_wait, marked_spin\n"
	"fetch_start:\n"
	"fetch_u64:\n" /* u64 fetch_u64(const u64 *p): *p, or FAULTED if p is bad */
	"	movabs $0x214843544546504b, %r11\n"
	"	lea 1f(%rip), %r10\n"
	"	mov (%rdi), %rax\n"
	"	xor %r11d, %r11d\n"
	"	ret\n"
	"1:	movabs $0xfa17fa17fa17fa17, %rax\n"
	"	xor %r11d, %r11d\n"
	"	ret\n"
	"fetch_wait:\n" /* u64 fetch_wait(volatile int *go, const u64 *p): spins in our code
			     until *go, then fetch_u64(p) */
	"	mov (%rdi), %eax\n"
	"	test %eax, %eax\n"
	"	jz fetch_wait\n"
	"	mov %rsi, %rdi\n"
	"	jmp fetch_u64\n"
	"marked_spin:\n" /* u64 marked_spin(volatile int *go): in our code and marked (as in a
			      fetch) until *go: 1, or FAULTED if taken for a fetch's fault */
	"	movabs $0x214843544546504b, %r11\n"
	"	lea 2f(%rip), %r10\n"
	"1:	mov (%rdi), %eax\n"
	"	test %eax, %eax\n"
	"	jz 1b\n"
	"	xor %r11d, %r11d\n"
	"	mov $1, %eax\n"
	"	ret\n"
	"2:	movabs $0xfa17fa17fa17fa17, %rax\n"
	"	xor %r11d, %r11d\n"
	"	ret\n"
	"nomagic_load:\n" /* in our code, not marked: a fault is the program's */
	"	xor %r11d, %r11d\n"
	"nomagic_at:\n"
	"	mov (%rdi), %rax\n"
	"	ret\n"
	"fetch_end:\n"
	"	int3\n"
	"own_load:\n" /* the program's own load */
	"own_at:\n"
	"	mov (%rdi), %rax\n"
	"	ret\n"
	"magic_load:\n" /* marked, but not in our code: the program's */
	"	movabs $0x214843544546504b, %r11\n"
	"	lea 1f(%rip), %r10\n"
	"magic_at:\n"
	"	mov (%rdi), %rax\n"
	"1:	xor %r11d, %r11d\n"
	"	ret\n");
extern char fetch_start[], fetch_end[], nomagic_at[], own_at[], magic_at[];
u64 fetch_u64(const void *p);
u64 fetch_wait(volatile int *go, const void *p);
u64 marked_spin(volatile int *go);
u64 nomagic_load(const void *p);
u64 own_load(const void *p);
u64 magic_load(const void *p);

static sigjmp_buf back;
static volatile int seen_sig, seen_code, seen_onstack, seen_unwound;
static void *volatile seen_addr;
static volatile u64 seen_rip;
static void *prot_none, *past_eof;

/* Does the handler's stack unwind through the signal frame into the code at rip? */
static int unwinds_to(u64 rip)
{
	void *frames[32];
	int n = backtrace(frames, 32);
	for (int i = 0; i < n; i++)
		if ((u64)frames[i] == rip || (u64)frames[i] == rip + 1)
			return 1;
	return 0;
}

static void on_fault(int sig, siginfo_t *si, void *ucv)
{
	ucontext_t *uc = ucv;
	stack_t ss;
	seen_sig = sig;
	seen_code = si->si_code;
	seen_addr = si->si_addr;
	seen_rip = uc->uc_mcontext.gregs[REG_RIP];
	seen_onstack = sigaltstack(NULL, &ss) == 0 && (ss.ss_flags & SS_ONSTACK);
	seen_unwound = unwinds_to(seen_rip);
	siglongjmp(back, 1);
}

static void on_fault_plain(int sig)
{
	seen_sig = sig;
	seen_code = -1000;
	siglongjmp(back, 1);
}

static void print_actions(const char *what)
{
	u64 segv[4], bus[4];
	syscall(SYS_rt_sigaction, SIGSEGV, NULL, segv, 8);
	syscall(SYS_rt_sigaction, SIGBUS, NULL, bus, 8);
	printf("%s segv %lx %lx %lx %lx bus %lx %lx %lx %lx\n", what, segv[0], segv[1], segv[2],
	       segv[3], bus[0], bus[1], bus[2], bus[3]);
}

static void set_own(const char *own)
{
	static char alt[1 << 16];
	stack_t ss = { .ss_sp = alt, .ss_size = sizeof alt };
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	if (sigaltstack(&ss, NULL) != 0)
		exit(2);
	if (strcmp(own, "none") == 0)
		return;
	if (strcmp(own, "siginfo") == 0) {
		sa.sa_sigaction = on_fault;
		sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
		sigaddset(&sa.sa_mask, SIGUSR2);
	} else if (strcmp(own, "plain") == 0) {
		sa.sa_handler = on_fault_plain;
	} else if (strcmp(own, "mixed") == 0) {
		sa.sa_sigaction = on_fault;
		sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER | SA_RESTART;
		sigaddset(&sa.sa_mask, SIGHUP);
		sigaddset(&sa.sa_mask, SIGUSR2);
		sigaction(SIGSEGV, &sa, NULL);
		signal(SIGBUS, SIG_IGN);
		return;
	} else {
		exit(2);
	}
	sigaction(SIGSEGV, &sa, NULL);
	sigaction(SIGBUS, &sa, NULL);
}

struct worker {
	pthread_t thread;
	int rounds, bad, still_blocked;
};

static void *fetch_worker(void *arg)
{
	struct worker *w = arg;
	u64 good = 42;
	void *noncanonical = (void *)0xdead000000000000UL;
	for (int i = 0; i < w->rounds; i++) {
		w->bad += fetch_u64(&good) != 42;
		w->bad += fetch_u64(NULL) != FAULTED;
		w->bad += fetch_u64(noncanonical) != FAULTED;
		w->bad += fetch_u64(prot_none) != FAULTED;
		w->bad += fetch_u64(past_eof) != FAULTED;
	}
	return NULL;
}

static void step_fetch(int threads, int rounds)
{
	struct worker w[64];
	int bad = 0;
	if (threads > 64)
		exit(2);
	for (int i = 0; i < threads; i++) {
		w[i].rounds = rounds;
		w[i].bad = 0;
		pthread_create(&w[i].thread, NULL, fetch_worker, &w[i]);
	}
	for (int i = 0; i < threads; i++) {
		pthread_join(w[i].thread, NULL);
		bad += w[i].bad;
	}
	printf("fetch: %d threads x %d rounds, %d wrong\n", threads, rounds, bad);
}

static void *blocked_worker(void *arg)
{
	struct worker *w = arg;
	sigset_t all, now;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	for (int i = 0; i < w->rounds; i++)
		w->bad += fetch_u64(NULL) != FAULTED;
	pthread_sigmask(SIG_BLOCK, NULL, &now);
	w->still_blocked = sigismember(&now, SIGSEGV);
	return NULL;
}

static void step_blocked(int rounds)
{
	struct worker w = { .rounds = rounds };
	pthread_t t;
	struct sigaction segv;
	pthread_create(&t, NULL, blocked_worker, &w);
	pthread_join(t, NULL);
	sigaction(SIGSEGV, NULL, &segv);
	printf("blocked: %d wrong, still blocked %d, handled %d\n", w.bad, w.still_blocked,
	       segv.sa_handler != SIG_DFL);
}

struct waiter {
	volatile int go;
	u64 got;
};

static void *wait_worker(void *arg)
{
	struct waiter *w = arg;
	printf("inside: waiting\n");
	w->got = fetch_wait(&w->go, NULL);
	return NULL;
}

/* A thread waits in our code, then fetches from NULL, once a second line comes on stdin. */
static void step_inside(void)
{
	struct waiter w = { 0, 0 };
	pthread_t t;
	char line[64];
	pthread_create(&t, NULL, wait_worker, &w);
	if (!fgets(line, sizeof line, stdin))
		exit(3);
	w.go = 1;
	pthread_join(t, NULL);
	printf("inside: faulted %d\n", w.got == FAULTED);
}

/* A SIGSEGV from a timer while the thread sits in marked code of ours: not a fault, the
   program's own signal. */
static void step_sent_marked(void)
{
	static volatile int go;
	timer_t timer;
	struct sigevent sev = { .sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGSEGV };
	struct itimerspec when = { .it_value = { 0, 20 * 1000 * 1000 } };
	if (timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0 || timer_settime(timer, 0, &when, 0))
		exit(2);
	if (sigsetjmp(back, 1) == 0) {
		u64 got = marked_spin(&go);
		printf("sent-marked: not delivered (%s)\n", got == FAULTED ? "FAULTED" : "?");
		return;
	}
	printf("sent-marked: sig %d code %d\n", seen_sig, seen_code);
}

static void fault(const char *name, u64 (*load)(const void *), const void *at, const char *rip)
{
	if (sigsetjmp(back, 1) == 0) {
		load(at);
		printf("%s: not faulted\n", name);
		return;
	}
	printf("%s: sig %d code %d addr-ok %d rip-ok %d unwound %d\n", name, seen_sig, seen_code,
	       seen_addr == at, seen_rip == (u64)rip, seen_unwound);
}

static volatile int bottomless = 1;

static int deep(int n)
{
	volatile char pad[512];
	pad[0] = (char)n;
	if (!bottomless)
		return 0;
	return deep(n + 1) + pad[0];
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	void *warm[1];
	setvbuf(stdout, NULL, _IONBF, 0);
	backtrace(warm, 1); /* loads the unwinder now, not in a signal handler */
	set_own(argv[1]);
	prot_none = mmap(NULL, 0x1000, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	int fd = memfd_create("past-eof", 0);
	char *file = mmap(NULL, 0x2000, PROT_READ, MAP_SHARED, fd, 0);
	if (prot_none == MAP_FAILED || fd < 0 || file == MAP_FAILED || ftruncate(fd, 0x1000))
		return 2;
	past_eof = file + 0x1000;
	printf("code %lx %lx\n", (u64)fetch_start, (u64)fetch_end);
	print_actions("actions");
	printf("ready\n");
	char line[64];
	if (!fgets(line, sizeof line, stdin))
		return 3;
	for (int i = 2; i < argc; i++) {
		const char *s = argv[i];
		int a = 0, b = 0;
		if (sscanf(s, "fetch:%d:%d", &a, &b) == 2) {
			step_fetch(a, b);
		} else if (sscanf(s, "blocked:%d", &a) == 1) {
			step_blocked(a);
		} else if (strcmp(s, "segv") == 0) {
			fault(s, own_load, (void *)0x18, own_at);
		} else if (strcmp(s, "segv-ours") == 0) {
			fault(s, nomagic_load, (void *)0x18, nomagic_at);
		} else if (strcmp(s, "segv-magic") == 0) {
			fault(s, magic_load, (void *)0x18, magic_at);
		} else if (strcmp(s, "bus") == 0) {
			fault(s, own_load, past_eof, own_at);
		} else if (strcmp(s, "overflow") == 0) {
			if (sigsetjmp(back, 1) == 0) {
				deep(0);
				return 4;
			}
			printf("overflow: sig %d on the alternate stack %d\n", seen_sig, seen_onstack);
		} else if (strcmp(s, "sent") == 0) {
			if (sigsetjmp(back, 1) == 0) {
				kill(getpid(), SIGSEGV);
				printf("sent: not delivered\n");
			} else {
				printf("sent: sig %d code %d\n", seen_sig, seen_code);
			}
		} else if (strcmp(s, "fetch1") == 0) {
			printf("fetch1: faulted %d\n", fetch_u64(NULL) == FAULTED);
		} else if (strcmp(s, "sent-marked") == 0) {
			step_sent_marked();
		} else if (strcmp(s, "inside") == 0) {
			step_inside();
		} else if (strcmp(s, "actions") == 0) {
			print_actions("actions");
		} else {
			return 2;
		}
	}
	return 0;
}
