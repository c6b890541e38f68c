/*
 * C++ exceptions and gcc's cold parts, for jump-optimized probes: code that is entered from
 * outside the function's body. Built with g++ -O2.
 *
 *   coldpad N   prints "ready" on stderr, waits for a line on stdin, then calls catcher(i) and
 *               pad_inside(i) for i in 0..N-1 and prints one line of sums.
 *
 * catcher(): a try block with a cleanup (Guard) and two catch clauses; gcc moves the landing
 * pads' work and an unlikely branch into catcher.cold, which jumps back into catcher. may_throw()
 * throws for some i (its throws go to may_throw.cold).
 *
 * pad_inside() is hand-written: its landing pad (.L_pad) is also where the normal path falls
 * through to, two bytes after `xor %edx, %edx`, so a 5-byte jump at that xor would cover the
 * landing pad: the unwinder would resume in the middle of the jump. The selector in edx tells
 * the two paths apart (0: no exception; 1: catch (...)).
 */
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

static long cleanups;
static long cold_calls;

struct Guard {
	long *count;
	~Guard() { *count += 1; }
};

extern "C" __attribute__((noinline)) long may_throw(long i)
{
	if (i % 7 == 3)
		throw std::runtime_error("seven");
	if (i % 11 == 5)
		throw i;
	return i * 3;
}

extern "C" __attribute__((noinline, cold)) void rare(long x)
{
	cold_calls += x & 1 ? 2 : 1;
}

extern "C" __attribute__((noinline)) long catcher(long i)
{
	long acc = i;
	try {
		Guard g{&cleanups};
		acc += may_throw(i);
		acc ^= may_throw(i + 1);
	} catch (const std::runtime_error &e) {
		acc += 100;
	} catch (long v) {
		acc -= v;
	}
	if (__builtin_expect(i % 50 == 49, 0)) {
		rare(i);
		acc += cold_calls;
	}
	return acc * 5 + 1;
}

/* long pad_inside(long i): may_throw(i) + 1, or -i if it threw (caught by catch (...)). */
extern "C" long pad_inside(long i);
__asm__(".text\n"
	".globl pad_inside\n"
	".type pad_inside, @function\n"
	"pad_inside:\n"
	"	.cfi_startproc\n"
	"	.cfi_personality 0x9b, DW.ref.__gxx_personality_v0\n"
	"	.cfi_lsda 0x1b, .LLSDA_pad\n"
	"	push %rbx\n"
	"	.cfi_def_cfa_offset 16\n"
	"	.cfi_offset 3, -16\n"
	"	mov %rdi, %rbx\n"
	".LEHB_pad:\n"
	"	call may_throw\n"
	".LEHE_pad:\n"
	"	add $1, %rax\n"
	"	xor %edx, %edx\n"
	".L_pad:\n"
	"	mov %rax, %rcx\n"
	"	test %edx, %edx\n"
	"	jz .L_done\n"
	"	mov %rax, %rdi\n"
	"	call __cxa_begin_catch\n"
	"	call __cxa_end_catch\n"
	"	mov %rbx, %rcx\n"
	"	neg %rcx\n"
	".L_done:\n"
	"	mov %rcx, %rax\n"
	"	pop %rbx\n"
	"	.cfi_def_cfa_offset 8\n"
	"	ret\n"
	"	.cfi_endproc\n"
	".size pad_inside, .-pad_inside\n"
	/* The LSDA: one call site (the call of may_throw), its landing pad, catch (...). */
	".section .gcc_except_table,\"a\",@progbits\n"
	".align 4\n"
	".LLSDA_pad:\n"
	"	.byte 0xff\n" /* landing pads relative to the function's start */
	"	.byte 0x9b\n" /* type table: indirect pcrel sdata4 */
	"	.uleb128 .LLSDATT_pad - .LLSDATTD_pad\n"
	".LLSDATTD_pad:\n"
	"	.byte 0x1\n" /* call sites: uleb128 */
	"	.uleb128 .LLSDACSE_pad - .LLSDACSB_pad\n"
	".LLSDACSB_pad:\n"
	"	.uleb128 .LEHB_pad - pad_inside\n"
	"	.uleb128 .LEHE_pad - .LEHB_pad\n"
	"	.uleb128 .L_pad - pad_inside\n"
	"	.uleb128 0x1\n" /* action record 1 */
	".LLSDACSE_pad:\n"
	"	.byte 0x1\n" /* type filter 1 */
	"	.byte 0\n" /* no next action */
	"	.align 4\n"
	"	.long 0\n" /* type 1: catch (...) */
	".LLSDATT_pad:\n"
	".text\n");

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 1000;
	char line[16];
	long sum = 0, pads = 0;

	fprintf(stderr, "ready\n");
	if (!fgets(line, sizeof line, stdin))
		return 3;
	for (long i = 0; i < n; i++) {
		sum += catcher(i);
		pads += pad_inside(i);
	}
	printf("sum=%ld cleanups=%ld cold=%ld pads=%ld\n", sum, cleanups, cold_calls, pads);
	return 0;
}
