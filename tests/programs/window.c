/*
 * A program whose whole state is in use when a tool borrows its thread: the check that an
 * injected call's thread comes home with every register, its FPU and vector state, its
 * signal mask and its alternate signal stack, whether the tool puts them back or the thread
 * does it alone (the tool killed in the middle: kprobes/process/inject/selfrestore.py).
 *
 *   window MODE [MAX]
 *
 *   spin   the main thread loops in rounds: load patterns into the vector registers
 *          (xmm0-15, ymm0-15 with AVX, zmm0-31 and k1-k7 with AVX-512), ten general
 *          registers, MXCSR, the x87 control word and st0, spin a while without a syscall,
 *          then compare everything with the patterns;
 *   sleep  the same, but the round's wait is a nanosleep syscall (20 ms): interrupted, it is
 *          restarted or fails with EINTR, never anything else;
 *   frame  print the layout of the kernel's own signal frame when SIGUSR2 comes, and exit:
 *          "frame RSP FRAME FPSTATE UC_FLAGS SW_BYTES MAGIC2" (hex; SW_BYTES the 48 bytes of
 *          struct _fpx_sw_bytes, MAGIC2 the word at FPSTATE + xstate_size).
 *
 * The vector state used is what the CPU has (CPUID, and the OS's XCR0), at most MAX if given:
 * "sse" (xmm0-15), "avx" (ymm0-15), "avx512" (zmm0-31, k1-k7): "avx" is the program of a CPU
 * without AVX-512, on any CPU.
 *
 * spin and sleep block SIGUSR2 and SIGHUP and set an alternate signal stack first; they write
 * "window PID ready" on stderr after the first round, and run until SIGUSR1. Then they check
 * the mask and the alternate stack again, print "window: every register kept" on stdout and
 * exit 0. A difference prints what changed on stderr and exits 1.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ucontext.h>
#include <unistd.h>

struct image {
	uint8_t vec[32][64]; /* 0 */
	uint64_t k[8];       /* 2048 */
	uint64_t gpr[10];    /* 2112: rbx rbp rdx r8 r9 r10 r12 r13 r14 r15 */
	uint32_t mxcsr;      /* 2192 */
	uint16_t fcw;        /* 2196 */
	uint16_t pad;
	double st0;          /* 2200 */
};

_Static_assert(sizeof(struct image) == 2208, "the offsets below");

/* long window_round(const struct image *in, struct image *out, long level, long sleep) */
long window_round(const struct image *in, struct image *out, long level, long sleep);

#define V16(op, dir)                                                                    \
	op " " dir(0, 0) "\n" op " " dir(64, 1) "\n" op " " dir(128, 2) "\n" op " "      \
	   dir(192, 3) "\n" op " " dir(256, 4) "\n" op " " dir(320, 5) "\n" op " "       \
	   dir(384, 6) "\n" op " " dir(448, 7) "\n" op " " dir(512, 8) "\n" op " "       \
	   dir(576, 9) "\n" op " " dir(640, 10) "\n" op " " dir(704, 11) "\n" op " "     \
	   dir(768, 12) "\n" op " " dir(832, 13) "\n" op " " dir(896, 14) "\n" op " "    \
	   dir(960, 15) "\n"
#define V16HI(op, dir)                                                                  \
	op " " dir(1024, 16) "\n" op " " dir(1088, 17) "\n" op " " dir(1152, 18) "\n" op " " \
	   dir(1216, 19) "\n" op " " dir(1280, 20) "\n" op " " dir(1344, 21) "\n" op " "     \
	   dir(1408, 22) "\n" op " " dir(1472, 23) "\n" op " " dir(1536, 24) "\n" op " "     \
	   dir(1600, 25) "\n" op " " dir(1664, 26) "\n" op " " dir(1728, 27) "\n" op " "     \
	   dir(1792, 28) "\n" op " " dir(1856, 29) "\n" op " " dir(1920, 30) "\n" op " "     \
	   dir(1984, 31) "\n"
#define LX(off, n) #off "(%rdi), %xmm" #n
#define LY(off, n) #off "(%rdi), %ymm" #n
#define LZ(off, n) #off "(%rdi), %zmm" #n
#define SX(off, n) "%xmm" #n ", " #off "(%rdi)"
#define SY(off, n) "%ymm" #n ", " #off "(%rdi)"
#define SZ(off, n) "%zmm" #n ", " #off "(%rdi)"

__asm__(
	".text\n"
	".globl window_round\n"
	".type window_round, @function\n"
	"window_round:\n"
	"push %rbp\n push %rbx\n push %r12\n push %r13\n push %r14\n push %r15\n"
	"sub $40, %rsp\n"
	"mov %rdi, 0(%rsp)\n mov %rsi, 8(%rsp)\n mov %rdx, 16(%rsp)\n mov %rcx, 24(%rsp)\n"
	"movq $0, 32(%rsp)\n"
	"ldmxcsr 2192(%rdi)\n fldcw 2196(%rdi)\n fldl 2200(%rdi)\n"
	"cmp $2, %rdx\n je 3f\n cmp $1, %rdx\n je 2f\n"
	V16("movdqu", LX)
	"jmp 4f\n"
	"2:\n" V16("vmovdqu", LY)
	"jmp 4f\n"
	"3:\n" V16("vmovdqu64", LZ) V16HI("vmovdqu64", LZ)
	"kmovw 2056(%rdi), %k1\n kmovw 2064(%rdi), %k2\n kmovw 2072(%rdi), %k3\n"
	"kmovw 2080(%rdi), %k4\n kmovw 2088(%rdi), %k5\n kmovw 2096(%rdi), %k6\n"
	"kmovw 2104(%rdi), %k7\n"
	"4:\n"
	"mov 2112(%rdi), %rbx\n mov 2120(%rdi), %rbp\n mov 2128(%rdi), %rdx\n"
	"mov 2136(%rdi), %r8\n mov 2144(%rdi), %r9\n mov 2152(%rdi), %r10\n"
	"mov 2160(%rdi), %r12\n mov 2168(%rdi), %r13\n mov 2176(%rdi), %r14\n"
	"mov 2184(%rdi), %r15\n"
	"cmpq $0, 24(%rsp)\n jne 5f\n"
	"mov $3000000, %eax\n"
	"1: sub $1, %eax\n jnz 1b\n"
	"jmp 6f\n"
	"5: lea window_sleep(%rip), %rdi\n xor %esi, %esi\n mov $35, %eax\n syscall\n"
	"mov %rax, 32(%rsp)\n"
	"6: mov 8(%rsp), %rdi\n"
	"mov %rbx, 2112(%rdi)\n mov %rbp, 2120(%rdi)\n mov %rdx, 2128(%rdi)\n"
	"mov %r8, 2136(%rdi)\n mov %r9, 2144(%rdi)\n mov %r10, 2152(%rdi)\n"
	"mov %r12, 2160(%rdi)\n mov %r13, 2168(%rdi)\n mov %r14, 2176(%rdi)\n"
	"mov %r15, 2184(%rdi)\n"
	"cmpq $2, 16(%rsp)\n je 8f\n cmpq $1, 16(%rsp)\n je 7f\n"
	V16("movdqu", SX)
	"jmp 9f\n"
	"7:\n" V16("vmovdqu", SY)
	"vzeroupper\n jmp 9f\n"
	"8:\n" V16("vmovdqu64", SZ) V16HI("vmovdqu64", SZ)
	"kmovw %k1, 2056(%rdi)\n kmovw %k2, 2064(%rdi)\n kmovw %k3, 2072(%rdi)\n"
	"kmovw %k4, 2080(%rdi)\n kmovw %k5, 2088(%rdi)\n kmovw %k6, 2096(%rdi)\n"
	"kmovw %k7, 2104(%rdi)\n vzeroupper\n"
	"9: stmxcsr 2192(%rdi)\n fnstcw 2196(%rdi)\n fstpl 2200(%rdi)\n"
	"ldmxcsr window_mxcsr(%rip)\n fldcw window_fcw(%rip)\n"
	"mov 32(%rsp), %rax\n"
	"add $40, %rsp\n"
	"pop %r15\n pop %r14\n pop %r13\n pop %r12\n pop %rbx\n pop %rbp\n"
	"ret\n"
	".size window_round, .-window_round\n");

const struct timespec window_sleep = {0, 20 * 1000 * 1000};
const uint32_t window_mxcsr = 0x1f80;
const uint16_t window_fcw = 0x037f;

static volatile sig_atomic_t stop;
static char altstack[64 * 1024];

static void on_usr1(int sig)
{
	(void)sig;
	stop = 1;
}

static void fill(struct image *in, long round)
{
	uint8_t *bytes = (uint8_t *)in->vec;
	for (size_t i = 0; i < sizeof in->vec; i++)
		bytes[i] = (uint8_t)(round * 131 + i * 7 + 1);
	for (int i = 0; i < 8; i++)
		in->k[i] = (uint64_t)((round * 17 + i * 4099 + 3) & 0xffff);
	for (int i = 0; i < 10; i++)
		in->gpr[i] = 0x0123456789abcdefULL * (uint64_t)(i + 1) + (uint64_t)round;
	in->mxcsr = round % 2 ? 0x7f80 : 0x3f80; /* round toward zero, toward +inf */
	in->fcw = round % 2 ? 0x0c7f : 0x007f;  /* 24-bit precision; toward zero */
	in->st0 = 1.0 + (double)round / 3.0;
}

static int compare(const struct image *in, const struct image *out, long level, long round)
{
	static const char *const gpr[10] = {"rbx", "rbp", "rdx", "r8",  "r9",
					    "r10", "r12", "r13", "r14", "r15"};
	int nvec = level == 2 ? 32 : 16, width = level == 2 ? 64 : level == 1 ? 32 : 16, bad = 0;
	for (int i = 0; i < nvec; i++)
		if (memcmp(in->vec[i], out->vec[i], (size_t)width)) {
			fprintf(stderr, "round %ld: vector register %d changed\n", round, i);
			bad = 1;
		}
	for (int i = 1; level == 2 && i < 8; i++)
		if (in->k[i] != out->k[i]) {
			fprintf(stderr, "round %ld: k%d changed\n", round, i);
			bad = 1;
		}
	for (int i = 0; i < 10; i++)
		if (in->gpr[i] != out->gpr[i]) {
			fprintf(stderr, "round %ld: %s changed\n", round, gpr[i]);
			bad = 1;
		}
	if (in->mxcsr != (out->mxcsr & ~0x3fu)) { /* the exception flags may rise */
		fprintf(stderr, "round %ld: mxcsr %#x, was %#x\n", round, out->mxcsr, in->mxcsr);
		bad = 1;
	}
	if (in->fcw != out->fcw) {
		fprintf(stderr, "round %ld: x87 control word %#x, was %#x\n", round, out->fcw,
			in->fcw);
		bad = 1;
	}
	if (in->st0 != out->st0) {
		fprintf(stderr, "round %ld: st0 %a, was %a\n", round, out->st0, in->st0);
		bad = 1;
	}
	return bad;
}

static void on_usr2_frame(int sig, siginfo_t *info, void *context)
{
	ucontext_t *uc = context;
	const uint8_t *fp = (const uint8_t *)uc->uc_mcontext.fpregs;
	uint32_t size, magic2;
	(void)sig;
	(void)info;
	memcpy(&size, fp + 464 + 16, 4); /* _fpx_sw_bytes.xstate_size */
	memcpy(&magic2, fp + size, 4);
	printf("frame %llx %lx %lx %lx ", (unsigned long long)uc->uc_mcontext.gregs[REG_RSP],
	       (unsigned long)((const char *)uc - 8), (unsigned long)fp, uc->uc_flags);
	for (int i = 0; i < 48; i++)
		printf("%02x", fp[464 + i]);
	printf(" %x\n", magic2);
	fflush(stdout);
	_exit(0);
}

static _Noreturn void frame_mode(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_usr2_frame;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGUSR2, &sa, NULL);
	fprintf(stderr, "window %d ready\n", (int)getpid());
	for (;;)
		pause();
}

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "spin";
	if (!strcmp(mode, "frame"))
		frame_mode();
	long sleep = !strcmp(mode, "sleep");
	long level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx") ? 1 : 0;
	if (argc > 2) {
		long most = !strcmp(argv[2], "sse") ? 0 : !strcmp(argv[2], "avx") ? 1 : 2;
		if (strcmp(argv[2], "sse") && strcmp(argv[2], "avx") && strcmp(argv[2], "avx512")) {
			fprintf(stderr, "window: MAX is sse, avx or avx512\n");
			return 2;
		}
		level = most < level ? most : level;
	}

	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr1;
	sigaction(SIGUSR1, &sa, NULL);
	sigset_t mask, now;
	sigemptyset(&mask);
	sigaddset(&mask, SIGUSR2);
	sigaddset(&mask, SIGHUP);
	sigprocmask(SIG_SETMASK, &mask, NULL);
	stack_t alt = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0}, alt_now;
	sigaltstack(&alt, NULL);

	static struct image in, out;
	long round = 0, eintr = 0;
	int bad = 0;
	while (!stop && !bad) {
		fill(&in, round);
		memset(&out, 0, sizeof out);
		long rc = window_round(&in, &out, level, sleep);
		if (rc == -4)
			eintr++;
		else if (rc != 0) {
			fprintf(stderr, "round %ld: nanosleep returned %ld\n", round, rc);
			bad = 1;
		}
		bad |= compare(&in, &out, level, round);
		if (round++ == 0)
			fprintf(stderr, "window %d ready\n", (int)getpid());
	}
	/* The kernel writes only its own 8 bytes of a sigset_t: the rest of glibc's 128 is
	 * whatever the stack held, so the sets are compared signal by signal, never whole. */
	sigemptyset(&now);
	sigprocmask(SIG_SETMASK, NULL, &now);
	for (int sig = 1; sig < NSIG; sig++)
		if (sigismember(&now, sig) != sigismember(&mask, sig)) {
			fprintf(stderr, "the signal mask changed: signal %d %s\n", sig,
				sigismember(&now, sig) ? "blocked" : "unblocked");
			bad = 1;
		}
	sigaltstack(NULL, &alt_now);
	if (alt_now.ss_sp != alt.ss_sp || alt_now.ss_size != alt.ss_size || alt_now.ss_flags) {
		fprintf(stderr, "the alternate signal stack changed: %p %zu %d\n", alt_now.ss_sp,
			alt_now.ss_size, alt_now.ss_flags);
		bad = 1;
	}
	fprintf(stderr, "window: %ld rounds at level %ld, %ld interrupted\n", round, level,
		eintr);
	if (bad)
		return 1;
	printf("window: every register kept\n");
	return 0;
}
