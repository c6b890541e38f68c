/*
 * The rescue: the SIGTRAP handler a probed program runs on its own when kprobes is gone.
 *
 * While the tool lives, every trap of ours stops the program under ptrace and the tool
 * handles it: this code never runs. When the tool dies without detaching (SIGKILL, the OOM
 * killer), the kernel releases the threads with our int3 bytes, return trampolines and
 * out-of-line copies still in place, and the next trap delivers SIGTRAP to the program.
 * Installed as the program's SIGTRAP handler, this code finds what the tool would have done
 * in tables the tool keeps in the program's memory, and does the least of it:
 *
 *   - an int3 of a probe: write the original byte back, resume at the probed instruction;
 *   - the return trampoline (or the int3 after it): resume at the frame's real return
 *     address;
 *   - the end of a stepped out-of-line copy: resume after the probed instruction;
 *     (the kernel drops the trap of a thread held by a tracer that dies, and the thread
 *     resumes one byte on: that byte is an int3 too, and means the same);
 *   - an injected syscall or call: put back the registers the thread had before it, and
 *     restart the syscall it was borrowed from, as the kernel would have;
 *   - a trap the tool had already handled (rip moved, int3 gone) or put back on its int3
 *     (the kernel delivers a held trap the tool had not reaped): resume as it is;
 *   - anything else is the program's own trap: handed to its own disposition.
 *
 * Once detour code that fetches through pointers is in the program, it is the SIGSEGV and
 * SIGBUS handler too (installed then, not before: Rescue.activate_fetch_faults). A fault the
 * kernel raised in one of our pages with r11 = FETCH_FAULT_MAGIC is a fetch of ours that hit
 * a bad pointer: it goes on at r10 (arch/x86_64/abi.py). Any other is the program's own and
 * is handed to its own disposition as the kernel would have delivered it: its handler, entered
 * in our frame (whose mask and stack are the program's action's) as if the kernel had entered
 * it, or, for SIG_DFL, the default action put back and the faulting instruction run again, to
 * die of it.
 *
 * It is compiled once into position-independent bytes (scripts/build-rescue writes
 * rescue_code.py) and copied into an executable mapping of the program. No libc, no
 * relocations, no writable memory of its own: the header and tables sit at fixed offsets
 * from the code, written by the tool through /proc/PID/mem.
 */
typedef unsigned long u64;
typedef long s64;

#define AREA_HEADER 0x1000UL
#define MAX_PAGES 64
#define MAX_RANGES 64

struct bp { u64 addr, orig; };  /* orig: the byte; at a jump site BP_JUMP and the jump's four others */
struct redirect { u64 from, len, to; };
struct record { u64 slot, real, seq; };
struct range { u64 addr, count; };
struct action { u64 handler, flags, restorer, mask; };

struct header {
	u64 magic;
	u64 tramp;              /* the trampoline's int3, 0 if none */
	u64 inject_trap;        /* the int3 an injection ends on, 0 when none is in progress */
	u64 nbp, bps;           /* breakpoints: address and original byte */
	u64 nredirect, redirects;  /* stepped copies: [from, from+len] -> to + (at - from) */
	u64 nrange;             /* return records: where the frames' real addresses are */
	struct range ranges[MAX_RANGES];
	u64 npage;              /* our executable pages: a rip there is on its way home */
	struct range pages[MAX_PAGES];
	struct action old;      /* the program's own SIGTRAP disposition */
	u64 saved[27];          /* struct user_regs_struct of the thread an injection borrowed */
	struct action old_fault[2];  /* the program's own SIGSEGV and SIGBUS dispositions */
};

/* The entry points, first in the blob: the injection stub, the signal restorer and a
   self-restoring injection's syscall. */
__asm__(".text\n"
	"rescue_start:\n"
	"rescue_stub:\n"
	"	syscall\n"
	"	int3\n"
	"	int3\n"   /* where a thread resumes if the tool dies after the first one trapped */
	"	.p2align 4\n"
	"rescue_restorer:\n"  /* glibc's bytes: unwinders (libgcc, gdb) know it for a signal frame */
	"	mov $15, %rax\n"
	"	syscall\n"
	"	ud2\n"
	"rescue_syscall_ret:\n"  /* a way home with no trap (selfrestore.py), once the rescue */
	"	syscall\n"           /* is no longer the program's SIGTRAP handler */
	"	ret\n"
	"rescue_restarter:\n"    /* its restorer for a thread borrowed from a call with a */
	"	mov $219, %eax\n"    /* restart block: restart_syscall, before rt_sigreturn */
	"	syscall\n"           /* cancels the block; the result in the frame's rax */
	"	mov %rax, 144(%rsp)\n"  /* (rsp: the ucontext; its gregs at 40, rax the 14th) */
	"	mov $15, %rax\n"
	"	syscall\n"
	"	ud2\n");

extern char rescue_start[] __attribute__((visibility("hidden")));

static inline s64 sys3(s64 nr, s64 a, s64 b, s64 c)
{
	s64 ret;
	__asm__ volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c)
			 : "rcx", "r11", "memory");
	return ret;
}

static inline s64 sys4(s64 nr, s64 a, s64 b, s64 c, s64 d)
{
	s64 ret;
	register s64 r10 __asm__("r10") = d;
	__asm__ volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10)
			 : "rcx", "r11", "memory");
	return ret;
}

#define NR_PWRITE64 18
#define NR_OPEN 2
#define NR_CLOSE 3
#define NR_MPROTECT 10
#define NR_RT_SIGACTION 13
#define NR_GETPID 39
#define NR_GETTID 186
#define NR_TGKILL 234
#define NR_RT_TGSIGQUEUEINFO 297
#define NR_RT_SIGPROCMASK 14
#define NR_RESTART_SYSCALL 219
#define SIG_UNBLOCK 1
#define SIGTRAP 5
#define U_RAX 10                    /* struct user_regs_struct: rax, orig_rax */
#define U_ORIG_RAX 15
#define ERESTARTSYS 512             /* the kernel's restart codes (include/linux/errno.h) */
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516
#define SYSCALL_LEN 2
#define SI_KERNEL 0x80
#define PUT_BACK_CODE 0x4b50        /* rescue.py's PUT_BACK_CODE: the tool's mark */
#define PUT_BACK_ERRNO 0x4b505242   /* rescue.py's PUT_BACK_ERRNO */
#define TF 0x100UL
#define SIGBUS 7
#define SA_RESETHAND 0x80000000UL
#define BUS_MCEERR_AO 5
#define FETCH_FAULT_MAGIC 0x214843544546504bUL  /* "KPFETCH!": abi.py's FETCH_FAULT_MAGIC */

/* mcontext gregs (REG_R8 = 0, ...) and their places in struct user_regs_struct */
enum { G_R8, G_R9, G_R10, G_R11, G_R12, G_R13, G_R14, G_R15, G_RDI, G_RSI, G_RBP, G_RBX,
       G_RDX, G_RAX, G_RCX, G_RSP, G_RIP, G_EFL, G_NREGS = 18 };
static const unsigned char user_index[G_NREGS] = {
	9, 8, 7, 6, 3, 2, 1, 0, 14, 13, 4, 5, 12, 10, 11, 19, 16, 18,
};

struct ucontext_min {
	u64 uc_flags, uc_link, ss_sp, ss_flags, ss_size;
	u64 gregs[23];
};

/* The byte that makes the int3 at ``at`` a whole instruction again. ``orig`` holds the
   original byte and, at a jump site (BP_JUMP), the four other bytes of its jump: a tool that
   died while writing or removing the jump (an int3, then the four bytes, then the first)
   left an int3 before the jump's four bytes, and then the jump is finished (its detour is
   never unmapped), or before the original four, and then the original byte goes back. */
#define BP_JUMP (1UL << 40)
static unsigned char first_byte(u64 at, u64 orig)
{
	if (orig & BP_JUMP) {
		const volatile unsigned char *p = (const volatile unsigned char *)at;
		u64 tail = (u64)p[1] | (u64)p[2] << 8 | (u64)p[3] << 16 | (u64)p[4] << 24;
		if (tail == ((orig >> 8) & 0xffffffffUL))
			return 0xe9;
	}
	return (unsigned char)orig;
}

static void put_back(u64 addr, unsigned char byte)
{
	static const char path[] = "/proc/self/mem";
	s64 fd = sys3(NR_OPEN, (s64)path, 2 /* O_RDWR */, 0);
	if (fd >= 0) {
		s64 done = sys4(NR_PWRITE64, fd, (s64)&byte, 1, (s64)addr);
		sys3(NR_CLOSE, fd, 0, 0);
		if (done == 1)
			return;
	}
	/* No /proc: make the page writable for the one byte (the code stays executable). */
	u64 page = addr & ~0xfffUL;
	if (sys3(NR_MPROTECT, page, 0x1000, 7) == 0) {
		*(volatile unsigned char *)addr = byte;
		sys3(NR_MPROTECT, page, 0x1000, 5);
	}
}

static int in_ranges(const struct range *r, u64 n, u64 addr)
{
	for (u64 i = 0; i < n && i < MAX_PAGES; i++)
		if (r[i].addr <= addr && addr < r[i].addr + r[i].count)
			return 1;
	return 0;
}

static void chain(const struct header *h, int sig, void *info, void *uc)
{
	u64 handler = h->old.handler;
	if (handler == 1) /* SIG_IGN */
		return;
	if (handler == 0) { /* SIG_DFL: die of it, as the program would have */
		struct action dfl = { 0, 0, 0, 0 };
		sys4(NR_RT_SIGACTION, sig, (s64)&dfl, 0, 8);
		sys3(NR_TGKILL, sys3(NR_GETPID, 0, 0, 0), sys3(NR_GETTID, 0, 0, 0), sig);
		return;
	}
	if (h->old.flags & 4 /* SA_SIGINFO */)
		((void (*)(int, void *, void *))handler)(sig, info, uc);
	else
		((void (*)(int))handler)(sig);
}

/* Raised by the kernel for the instruction that faulted (not sent by a process, not an
   asynchronous machine-check report): it comes back if the instruction runs again. */
static int is_fault(int sig, int code)
{
	return code > 0 && !(sig == SIGBUS && code == BUS_MCEERR_AO);
}

/* The program's own SIGSEGV or SIGBUS, handed to its own disposition: its handler, to be
   entered in our frame (returned, see rescue_fault_entry), or 0 once the default action or
   the ignoring is done. */
static u64 chain_fault(const struct action *old, int sig, void *info)
{
	struct action dfl = { 0, 0, 0, 0 };
	int code = ((int *)info)[2];
	u64 handler = old->handler;
	if (handler > 1) {
		if (old->flags & SA_RESETHAND)
			sys4(NR_RT_SIGACTION, sig, (s64)&dfl, 0, 8);
		return handler;
	}
	if (handler == 1 && !is_fault(sig, code)) /* SIG_IGN, of a signal that may be ignored */
		return 0;
	/* SIG_DFL (or SIG_IGN of a fault, which the kernel does not let a program ignore): the
	   default action back, and the signal again, to die of it as the program would have:
	   a fault by running its instruction again, a sent signal by sending it again. */
	sys4(NR_RT_SIGACTION, sig, (s64)&dfl, 0, 8);
	if (is_fault(sig, code))
		return 0;
	s64 pid = sys3(NR_GETPID, 0, 0, 0), tid = sys3(NR_GETTID, 0, 0, 0);
	/* its own siginfo where the kernel allows it (a thread other than the main one may not
	   queue SI_USER or SI_TKILL), else as tgkill sends it */
	if (sys4(NR_RT_TGSIGQUEUEINFO, pid, tid, sig, (s64)info) != 0)
		sys3(NR_TGKILL, pid, tid, sig);
	return 0;
}

/* SIGSEGV or SIGBUS: a fetch of ours that hit a bad pointer goes on at r10 (0: return from
   the signal); any other fault is the program's (its handler, or 0). */
__attribute__((used, visibility("hidden"))) u64 rescue_fault(int sig, void *info,
							     struct ucontext_min *uc)
{
	const struct header *h = (const struct header *)(rescue_start + AREA_HEADER);
	u64 *g = uc->gregs;
	if (is_fault(sig, ((int *)info)[2]) && g[G_R11] == FETCH_FAULT_MAGIC &&
	    in_ranges(h->pages, h->npage, g[G_RIP])) {
		g[G_RIP] = g[G_R10];
		return 0;
	}
	return chain_fault(&h->old_fault[sig == SIGBUS], sig, info);
}

/* The SIGSEGV and SIGBUS handler. The program's own handler is entered by a jump, in the
   frame the kernel built for us, as the kernel would have entered it: sig, siginfo and
   context in rdi, rsi, rdx (for every handler, SA_SIGINFO or not, as on x86-64), rax 0, and
   the restorer as its return address, so that it returns through rt_sigreturn and unwinds
   through the signal frame into the code that faulted, with no frame of ours in between. */
__asm__(".text\n"
	"rescue_fault_entry:\n"
	"	push %rdi\n"
	"	push %rsi\n"
	"	push %rdx\n"      /* the kernel entered with rsp = 8 mod 16: now 0, for the call */
	"	call rescue_fault\n"
	"	pop %rdx\n"
	"	pop %rsi\n"
	"	pop %rdi\n"
	"	test %rax, %rax\n"
	"	jz 1f\n"
	"	mov %rax, %r11\n"
	"	xor %eax, %eax\n"
	"	jmp *%r11\n"
	"1:	ret\n");

/* A thread borrowed from inside a syscall goes on as the kernel would have let it go on with
   no handler of the program's to run: rt_sigreturn sets orig_rax = -1, so the kernel's own
   restart does not happen, and is done here. An interrupted call is made again from its
   syscall instruction. A call with a restart block (nanosleep, poll with a timeout, futex
   waits) is finished here by restart_syscall, with SIGTRAP unblocked (a program's handler
   interrupting it may hit a probe of ours): once rt_sigreturn runs, the restart block is
   cancelled and the call would fail with EINTR, which a program with no signal handler of
   its own never expects. A signal the program handles still interrupts it with EINTR, as
   it would have. */
static void restart(const struct header *h, u64 *g)
{
	if ((s64)h->saved[U_ORIG_RAX] < 0)
		return;
	s64 error = -(s64)h->saved[U_RAX];
	if (error == ERESTARTSYS || error == ERESTARTNOINTR || error == ERESTARTNOHAND) {
		g[G_RAX] = h->saved[U_ORIG_RAX];
		g[G_RIP] -= SYSCALL_LEN;
	} else if (error == ERESTART_RESTARTBLOCK) {
		u64 trap = 1UL << (SIGTRAP - 1);
		sys4(NR_RT_SIGPROCMASK, SIG_UNBLOCK, (s64)&trap, 0, 8);
		g[G_RAX] = (u64)sys3(NR_RESTART_SYSCALL, 0, 0, 0);
	}
}

__attribute__((used)) void rescue_handler(int sig, void *info, void *ctx)
{
	const struct header *h = (const struct header *)(rescue_start + AREA_HEADER);
	struct ucontext_min *uc = ctx;
	u64 *g = uc->gregs;
	int code = ((int *)info)[2];
	u64 rip = g[G_RIP];
	u64 at = code == SI_KERNEL ? rip - 1 : rip;

	/* The tool marked the trap it held (si_addr: the probe's int3) before it put the
	   thread back on that int3, and died before it let go: on the int3, the thread traps
	   there again; one byte on, this is that int3's trap. */
	if (code == PUT_BACK_CODE && ((int *)info)[1] == PUT_BACK_ERRNO) {
		u64 mark = *(u64 *)((char *)info + 16);
		if (rip != mark + 1)
			return;
		at = mark;
		code = SI_KERNEL;
	}

	/* An injection in flight: the thread's own registers back. */
	if (h->inject_trap && (at == h->inject_trap || at == h->inject_trap + 1)) {
		for (int i = 0; i < G_NREGS; i++)
			g[i] = h->saved[user_index[i]];
		restart(h, g);
		return;
	}
	/* The return trampoline: the newest record of this stack slot holds the caller. */
	if (h->tramp && (at == h->tramp || at == h->tramp + 1)) {
		u64 slot = g[G_RSP] - 8, best = 0, real = 0;
		for (u64 r = 0; r < h->nrange && r < MAX_RANGES; r++) {
			const struct record *rec = (const struct record *)h->ranges[r].addr;
			for (u64 i = 0; i < h->ranges[r].count; i++)
				if (rec[i].slot == slot && rec[i].seq > best) {
					best = rec[i].seq;
					real = rec[i].real;
				}
		}
		if (real) {
			g[G_RIP] = real;
			return;
		}
		chain(h, sig, info, ctx);
		return;
	}
	/* The end of a stepped copy (its int3, or the int3 after it, where a thread held on
	   the first one resumes when the tool dies): after the probed instruction. */
	const struct redirect *rd = (const struct redirect *)h->redirects;
	for (u64 i = 0; i < h->nredirect; i++)
		if (rd[i].from + rd[i].len <= at && at <= rd[i].from + rd[i].len + 1) {
			g[G_RIP] = rd[i].to + rd[i].len;
			g[G_EFL] &= ~TF;
			return;
		}
	/* A probe's int3: the original byte back, and the probed instruction runs. */
	const struct bp *bp = (const struct bp *)h->bps;
	for (u64 i = 0; i < h->nbp; i++)
		if (bp[i].addr == at) {
			if (*(volatile unsigned char *)at == 0xcc)
				put_back(at, first_byte(at, bp[i].orig));
			g[G_RIP] = at;
			return;
		}
	/* Put back on a probe's int3 by the tool, which died before it let the thread go:
	   the kernel delivers the trap it held, and the thread traps on that int3 again. */
	if (code == SI_KERNEL && *(volatile unsigned char *)rip == 0xcc)
		for (u64 i = 0; i < h->nbp; i++)
			if (bp[i].addr == rip)
				return;
	/* Sent on by the tool before it died (into a copy, to a return address, past an
	   emulated instruction): the trap was already handled. */
	if (in_ranges(h->pages, h->npage, rip)) {
		g[G_EFL] &= ~TF;
		return;
	}
	if (code == SI_KERNEL && *(volatile unsigned char *)(rip - 1) != 0xcc &&
	    !(*(volatile unsigned char *)(rip - 2) == 0xcd && *(volatile unsigned char *)(rip - 1) == 3))
		return;
	chain(h, sig, info, ctx);
}
