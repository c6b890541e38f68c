/*
 * Runs the rescue (kprobes/arch/x86_64/rescue.c, as the bytes the package ships) in this
 * process, one rule at a time, as a tool that died would leave it:
 *
 *   rescue_harness BLOB HANDLER RESTORER CASE
 *
 * BLOB holds the code; HANDLER and RESTORER are its entry offsets. The area and its header are
 * laid out as kprobes/arch/x86_64/rescue.py says (header words: see H below). Prints "ok" when
 * the case behaves; the case own-trap-default must die of SIGTRAP instead.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef unsigned long u64;
enum { H_TRAMP = 1, H_INJECT = 2, H_NBP = 3, H_BPS = 4, H_NREDIRECT = 5, H_REDIRECTS = 6,
       H_NRANGE = 7, H_RANGES = 8, H_OLD = 265, H_SAVED = 269 };

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

int main(int argc, char **argv)
{
	if (argc != 5)
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
