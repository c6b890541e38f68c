/*
 * Runs the rescue (kprobes/arch/x86_64/rescue.c, as the bytes the package ships) in this
 * process, one rule at a time, as a tool that died would leave it:
 *
 *   rescue_harness BLOB HANDLER RESTORER CASE [FAULT_HANDLER]
 *
 * BLOB holds the code; HANDLER, RESTORER and FAULT_HANDLER are its entry offsets. The area and its header are
 * laid out as kprobes/arch/x86_64/rescue.py says (header words: see H below). Prints "ok" when
 * the case behaves; the case own-trap-default must die of SIGTRAP instead, and the cases
 * test_rescue_code.py lists as deaths must die of their signal.
 *
 * The fault cases (fetch-*, own-*, sent-*) make the rescue the SIGSEGV and SIGBUS handler
 * too, after the case set the program's own action, with fetch_start..fetch_end (code below,
 * following the fetch fault convention of kprobes/arch/x86_64/abi.py) as the one page of ours.
 */
#define _GNU_SOURCE
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
enum { H_TRAMP = 1, H_INJECT = 2, H_NBP = 3, H_BPS = 4, H_NREDIRECT = 5, H_REDIRECTS = 6,
       H_NRANGE = 7, H_RANGES = 8, H_NPAGE = 136, H_PAGES = 137, H_OLD = 265, H_SAVED = 269,
       H_OLD_FAULT = 296 };

#define FAULTED 0xfa17fa17fa17fa17UL

/* Code of "ours": loads marked as fetches (r11 = the magic, r10 = where to go on). */
__asm__(".text\n"
	".globl fetch_start, fetch_end, fetch_load, nomagic_load, spin, spin_out, own_load\n"
	".hidden fetch_start, fetch_end, fetch_load, nomagic_load, spin, spin_out, own_load\n"
	"fetch_start:\n"
	"fetch_load:\n" /* u64 fetch_load(const u64 *p): *p, or FAULTED if p is bad */
	"	movabs $0x214843544546504b, %r11\n"
	"	lea 1f(%rip), %r10\n"
	"	mov (%rdi), %rax\n"
	"	xor %r11d, %r11d\n"
	"	ret\n"
	"1:	movabs $0xfa17fa17fa17fa17, %rax\n"
	"	xor %r11d, %r11d\n"
	"	ret\n"
	"nomagic_load:\n" /* the same load in our page, not marked: a fault is the program's */
	"	xor %r11d, %r11d\n"
	"	mov (%rdi), %rax\n"
	"	ret\n"
	"spin:\n" /* marked, and spinning: only a signal handler moving rip ends it */
	"	movabs $0x214843544546504b, %r11\n"
	"	lea 2f(%rip), %r10\n"
	"1:	jmp 1b\n"
	"2:	movabs $0xfa17fa17fa17fa17, %rax\n"
	"	xor %r11d, %r11d\n"
	"	ret\n"
	"spin_out:\n"
	"	xor %r11d, %r11d\n"
	"	mov $1, %eax\n"
	"	ret\n"
	"fetch_end:\n"
	"own_load:\n" /* marked, but outside our pages: the program's own */
	"	movabs $0x214843544546504b, %r11\n"
	"	lea 1f(%rip), %r10\n"
	"	mov (%rdi), %rax\n"
	"1:	xor %r11d, %r11d\n"
	"	ret\n");
extern char fetch_start[], fetch_end[], spin_out[];
u64 fetch_load(const void *p);
u64 nomagic_load(const void *p);
u64 spin(void);
u64 own_load(const void *p);

static char *area, *code;
static u64 *h;
static volatile int own_handled;

static void own(int sig) { (void)sig; own_handled = 1; }

static void install(u64 handler, u64 restorer, u64 old_handler)
{
	u64 act[4] = { (u64)area + handler, 4 | 0x04000000, (u64)area + restorer, 0 };
	h[H_OLD] = old_handler;
	h[H_OLD + 1] = old_handler > 1 ? 0x04000000 : 0;
	if (syscall(SYS_rt_sigaction, SIGTRAP, act, NULL, 8) != 0) {
		perror("rt_sigaction");
		exit(2);
	}
}

typedef long (*fn)(void);

static sigjmp_buf back;
static volatile int seen_sig, seen_code;
static void *volatile seen_addr;
static volatile u64 seen_rip;

static void own_info(int sig, siginfo_t *si, void *ucv)
{
	ucontext_t *uc = ucv;
	seen_sig = sig;
	seen_code = si->si_code;
	seen_addr = si->si_addr;
	seen_rip = uc->uc_mcontext.gregs[REG_RIP];
	if (si->si_code == SI_TIMER) {
		uc->uc_mcontext.gregs[REG_RIP] = (greg_t)spin_out;
		return;
	}
	siglongjmp(back, 1);
}

static void own_plain(int sig)
{
	seen_sig = sig;
	siglongjmp(back, 1);
}

/* As Rescue.activate_fetch_faults does (without taking the program's mask and flags): the
   program's own action into the header, the rescue's in its place. */
static void install_fault(u64 handler, u64 restorer, int sig, int index)
{
	u64 act[4] = { (u64)area + handler, 4 | 0x04000000, (u64)area + restorer, 0 };
	if (syscall(SYS_rt_sigaction, sig, act, h + H_OLD_FAULT + 4 * index, 8) != 0) {
		perror("rt_sigaction");
		exit(2);
	}
}

static void own_action(int sig, void *handler, int flags)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = (void (*)(int))handler;
	sa.sa_flags = flags;
	sigaction(sig, &sa, NULL);
}

/* A page of a file past its end: a load from it raises SIGBUS. */
static void *bus_page(void)
{
	int fd = memfd_create("bus", 0);
	char *p = mmap(NULL, 0x2000, PROT_READ, MAP_SHARED, fd, 0);
	if (fd < 0 || p == MAP_FAILED || ftruncate(fd, 0x1000) != 0)
		exit(2);
	return p + 0x1000;
}

static int fault_case(const char *c, u64 handler, u64 restorer)
{
	void *noncanonical = (void *)0xdead000000000000UL, *bad = (void *)0x18;
	void *bus = bus_page();
	int plain = strcmp(c, "own-segv-plain") == 0;
	if (strcmp(c, "own-bus-handler") == 0)
		own_action(SIGBUS, own_info, SA_SIGINFO);
	else if (strcmp(c, "own-segv-handler") == 0 || strcmp(c, "fetch-sent-handler") == 0 ||
		 strcmp(c, "sent-handler") == 0)
		own_action(SIGSEGV, own_info, SA_SIGINFO);
	else if (strcmp(c, "own-segv-plain") == 0)
		own_action(SIGSEGV, own_plain, 0);
	else if (strcmp(c, "own-segv-resethand") == 0)
		own_action(SIGSEGV, own_info, SA_SIGINFO | SA_RESETHAND);
	else if (strcmp(c, "own-segv-ignored") == 0 || strcmp(c, "sent-ignored") == 0)
		own_action(SIGSEGV, SIG_IGN, 0);
	install_fault(handler, restorer, SIGSEGV, 0);
	install_fault(handler, restorer, SIGBUS, 1);
	if (strcmp(c, "fetch-outside") != 0) {
		h[H_PAGES] = (u64)fetch_start;
		h[H_PAGES + 1] = fetch_end - fetch_start;
		h[H_NPAGE] = 1;
	}
	u64 good = 42;

	if (strcmp(c, "fetch") == 0) {
		u64 a = fetch_load(&good), b = fetch_load(NULL), g = fetch_load(noncanonical);
		u64 d = fetch_load(bus);
		int ok = a == 42 && b == FAULTED && g == FAULTED && d == FAULTED;
		printf("%lx %lx %lx %lx %s\n", a, b, g, d, ok ? "ok" : "bad");
	} else if (strcmp(c, "fetch-outside") == 0) {
		fetch_load(NULL); /* not in a page of ours: the program's own, SIG_DFL */
		printf("survived\n");
	} else if (strcmp(c, "fetch-nomagic") == 0) {
		nomagic_load(NULL);
		printf("survived\n");
	} else if (strcmp(c, "fetch-sent-handler") == 0) {
		/* a SIGSEGV from a timer while the thread sits in a marked load: not a fault */
		timer_t t;
		struct sigevent sev = { .sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGSEGV };
		struct itimerspec when = { .it_value = { 0, 20 * 1000 * 1000 } };
		if (timer_create(CLOCK_MONOTONIC, &sev, &t) != 0 || timer_settime(t, 0, &when, 0))
			return 2;
		u64 r = spin();
		printf("%lx %d %d %s\n", r, seen_sig, seen_code,
		       r == 1 && seen_sig == SIGSEGV && seen_code == SI_TIMER ? "ok" : "bad");
	} else if (strncmp(c, "own-", 4) == 0) {
		int sig = strncmp(c, "own-bus", 7) == 0 ? SIGBUS : SIGSEGV;
		void *at = sig == SIGBUS ? bus : bad;
		if (sigsetjmp(back, 1) == 0) {
			own_load(at);
			printf("not faulted\n");
			return 0;
		}
		int want = sig == SIGBUS ? BUS_ADRERR : SEGV_MAPERR;
		int ok = seen_sig == sig;
		if (!plain) /* SA_SIGINFO: the fault's own siginfo and context */
			ok = ok && seen_code == want && seen_addr == at && seen_rip > (u64)own_load &&
			     seen_rip < (u64)own_load + 24;
		if (strcmp(c, "own-segv-resethand") == 0) {
			struct sigaction now;
			sigaction(SIGSEGV, NULL, &now);
			ok = ok && now.sa_handler == SIG_DFL;
		}
		printf("%d %d %p %s\n", seen_sig, seen_code, seen_addr, ok ? "ok" : "bad");
	} else if (strcmp(c, "sent-default") == 0 || strcmp(c, "sent-ignored") == 0) {
		kill(getpid(), SIGSEGV);
		printf("ok\n");
	} else if (strcmp(c, "sent-handler") == 0) {
		if (sigsetjmp(back, 1) == 0) {
			kill(getpid(), SIGSEGV);
			printf("not delivered\n");
			return 0;
		}
		printf("%d %d %s\n", seen_sig, seen_code,
		       seen_sig == SIGSEGV && seen_code == SI_USER ? "ok" : "bad");
	} else {
		return 2;
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc != 5 && argc != 6)
		return 2;
	area = mmap(NULL, 0x400000, PROT_READ | PROT_WRITE | PROT_EXEC,
		    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	code = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE | PROT_EXEC,
		    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	memset(code, 0xcc, 0x1000);
	FILE *f = fopen(argv[1], "rb");
	if (!f || fread(area, 1, 0x1000, f) == 0)
		return 2;
	fclose(f);
	h = (u64 *)(area + 0x1000);
	h[H_BPS] = (u64)(area + 0x2000);
	h[H_REDIRECTS] = (u64)(area + 0x42000);
	h[H_NRANGE] = 1;
	h[H_RANGES] = (u64)(area + 0x62000);
	h[H_RANGES + 1] = 4;
	u64 *bps = (u64 *)(area + 0x2000), *redirects = (u64 *)(area + 0x42000);
	u64 *records = (u64 *)(area + 0x62000);
	const char *c = argv[4];
	install(strtoul(argv[2], 0, 16), strtoul(argv[3], 0, 16),
		strcmp(c, "own-trap-handler") == 0 ? (u64)own : 0);
	if (strncmp(c, "fetch", 5) == 0 || strncmp(c, "own-segv", 8) == 0 ||
	    strncmp(c, "own-bus", 7) == 0 || strncmp(c, "sent-", 5) == 0)
		return argc == 6 ? fault_case(c, strtoul(argv[5], 0, 16), strtoul(argv[3], 0, 16)) : 2;

	/* code+0: mov $42, %eax; ret (a probed function) */
	static const unsigned char forty_two[] = { 0xb8, 0x2a, 0, 0, 0, 0xc3 };
	memcpy(code, forty_two, sizeof forty_two);

	if (strcmp(c, "breakpoint") == 0) {
		bps[0] = (u64)code;
		bps[1] = 0xb8;
		h[H_NBP] = 1;
		code[0] = 0xcc;
		long r = ((fn)code)();
		printf("%ld %s\n", r, r == 42 && (unsigned char)code[0] == 0xb8 ? "ok" : "bad");
	} else if (strcmp(c, "jump-int3-new") == 0 || strcmp(c, "jump-int3-old") == 0) {
		/* A jump being written or taken out at code+0 (breakpoints.py: an int3, the four
		   other bytes, the first byte): an int3 before the jump's four bytes (new) or
		   before the original four (old). The jump goes to a "detour" at code+0x300 that
		   returns 43; the entry carries BP_JUMP (1 << 40) and the jump's four bytes. */
		static const unsigned char forty_three[] = { 0xb8, 0x2b, 0, 0, 0, 0xc3 };
		memcpy(code + 0x300, forty_three, sizeof forty_three);
		const u64 rel = 0x300 - 5;
		bps[0] = (u64)code;
		bps[1] = 0xb8 | 1UL << 40 | rel << 8;
		h[H_NBP] = 1;
		int is_new = c[10] == 'n';
		if (is_new)
			memcpy(code + 1, &rel, 4);
		code[0] = 0xcc;
		long r = ((fn)code)();
		unsigned char want = is_new ? 0xe9 : 0xb8;
		int ok = r == (is_new ? 43 : 42) && (unsigned char)code[0] == want;
		printf("%ld %s\n", r, ok ? "ok" : "bad");
	} else if (strcmp(c, "trampoline") == 0 || strcmp(c, "trampoline-next") == 0) {
		char *tramp = code + 0x100; /* int3s */
		h[H_TRAMP] = (u64)tramp;
		u64 hooked = (u64)tramp + (c[10] == '-' ? 1 : 0);
		long out;
		/* call code+0 with its return address replaced by the trampoline, as an entry
		   hit does; the record holds the real one */
		__asm__ volatile(
			"lea 1f(%%rip), %%rax\n"
			"push %%rax\n"
			"mov %%rsp, 0(%[rec])\n"
			"mov %%rax, 8(%[rec])\n"
			"movq $7, 16(%[rec])\n"
			"mov %[hooked], (%%rsp)\n"
			"jmp *%[target]\n"
			"1: mov %%rax, %[out]\n"
			: [out] "=r"(out)
			: [rec] "r"(records), [hooked] "r"(hooked), [target] "r"(code)
			: "rax", "memory");
		printf("%ld %s\n", out, out == 42 ? "ok" : "bad");
	} else if (strcmp(c, "step-end") == 0 || strcmp(c, "step-next") == 0) {
		/* the slot at code+0x200: a copy of "mov $42, %eax" then int3s; the original
		   instruction at code+0 is followed by its ret */
		char *slot = code + 0x200;
		memcpy(slot, forty_two, 5);
		redirects[0] = (u64)slot;
		redirects[1] = 5;
		redirects[2] = (u64)code;
		h[H_NREDIRECT] = 1;
		fn entry = (fn)(c[5] == 'e' ? slot : slot + 6);
		long r = entry();
		printf("%ld %s\n", r, r == 42 || (c[5] == 'n' && r != 0) ? "ok" : "bad");
	} else if (strcmp(c, "injection") == 0) {
		/* A borrowed thread: its registers saved in the header, sent to the stub with a
		   syscall to run; the rescue must bring back every saved register. */
		u64 *saved = h + H_SAVED;
		h[H_INJECT] = (u64)area + 2;
		long rax_back, r12_back;
		__asm__ volatile(
			"mov $0x1234, %%r12\n"
			"mov %%r12, 24(%[saved])\n"        /* r12 */
			"mov %%rbp, 32(%[saved])\n"        /* rbp */
			"mov %%rbx, 40(%[saved])\n"        /* rbx */
			"mov %%r15, 0(%[saved])\n"
			"mov %%r14, 8(%[saved])\n"
			"mov %%r13, 16(%[saved])\n"
			"mov %%rsi, 104(%[saved])\n"       /* rsi */
			"mov %%rdi, 112(%[saved])\n"       /* rdi */
			"movq $99, 80(%[saved])\n"         /* rax */
			"lea 1f(%%rip), %%rax\n"
			"mov %%rax, 128(%[saved])\n"       /* rip */
			"mov %%rsp, 152(%[saved])\n"       /* rsp */
			"pushf\n pop %%rax\n mov %%rax, 144(%[saved])\n" /* eflags */
			"mov $39, %%eax\n"                 /* getpid, injected */
			"mov $0, %%r12\n"
			"jmp *%[stub]\n"
			"1: mov %%rax, %[rax_back]\n"
			"mov %%r12, %[r12_back]\n"
			: [rax_back] "=m"(rax_back), [r12_back] "=m"(r12_back)
			: [saved] "S"(saved), [stub] "D"(area)
			: "rax", "rcx", "rdx", "r8", "r9", "r10", "r11", "r12", "memory", "cc");
		printf("%ld %lx %s\n", rax_back, r12_back,
		       rax_back == 99 && r12_back == 0x1234 ? "ok" : "bad");
	} else if (strcmp(c, "own-trap-default") == 0 || strcmp(c, "own-trap-handler") == 0) {
		__asm__ volatile("int3");
		printf("%s\n", own_handled ? "ok" : "bad");
	} else {
		return 2;
	}
	return 0;
}
