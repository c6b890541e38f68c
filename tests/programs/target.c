/*
 * The API tests' program: a few small functions with known results, and hand-written
 * assembly whose instruction layout the tests rely on (see kpt_asm below).
 *
 *   target N      calls work(0..N-1), then compute(7), show(message), kpt_asm(1), kpt_asm(0)
 *
 * Output (N = 5):
 *   sum=...  compute=22  show hello kprobes  asm1=7 asm0=5 data=1
 */
#include <stdio.h>
#include <stdlib.h>

char message[] = "hello kprobes";
long counter;

__attribute__((noinline)) int compute(int x) { return x * 3 + 1; }

__attribute__((noinline)) long work(long i)
{
	counter += i;
	return counter ^ (i << 1);
}

__attribute__((noinline)) void show(char *s) { printf("show %s\n", s); }

long kpt_asm(long x);
long kpt_leaf(long x);
void kpt_iret(void);
void kpt_int3(void);

/*
 * kpt_asm(x): returns x + 5 + (x != 0) and adds x to kpt_data. Offsets (checked by the
 * tests with objdump):
 *   +0x00 push %rbx                 1 byte   (emulated: push reg)
 *   +0x01 movabs $..., %rax         10 bytes (boostable; +0x02..+0x0a are not boundaries)
 *   +0x0b lea kpt_data(%rip), %rbx  7 bytes  (rip-relative)
 *   +0x12 mov (%rbx), %rcx
 *   +0x15 add %rdi, %rcx
 *   +0x18 mov %rcx, (%rbx)
 *   +0x1b call kpt_leaf
 *   +0x20 test %rdi, %rdi
 *   +0x23 je 1f
 *   +0x25 add $1, %rax
 *   1: pop %rbx
 *      ret
 * kpt_iret and kpt_int3 are never called: they hold instructions a probe must refuse.
 */
__asm__(".data\n"
	".p2align 3\n"
	".globl kpt_data\n"
	".type kpt_data, @object\n"
	".size kpt_data, 8\n"
	"kpt_data: .quad 0\n"
	".text\n"
	".globl kpt_leaf\n"
	".type kpt_leaf, @function\n"
	"kpt_leaf:\n"
	"	lea 0x5(%rdi), %rax\n"
	"	ret\n"
	".size kpt_leaf, .-kpt_leaf\n"
	".globl kpt_asm\n"
	".type kpt_asm, @function\n"
	"kpt_asm:\n"
	"	push %rbx\n"
	"	movabs $0x1122334455667788, %rax\n"
	"	lea kpt_data(%rip), %rbx\n"
	"	mov (%rbx), %rcx\n"
	"	add %rdi, %rcx\n"
	"	mov %rcx, (%rbx)\n"
	"	call kpt_leaf\n"
	"	test %rdi, %rdi\n"
	"	je 1f\n"
	"	add $1, %rax\n"
	"1:	pop %rbx\n"
	"	ret\n"
	".size kpt_asm, .-kpt_asm\n"
	".globl kpt_iret\n"
	".type kpt_iret, @function\n"
	"kpt_iret:\n"
	"	nop\n"
	"	iretq\n"
	".size kpt_iret, .-kpt_iret\n"
	".globl kpt_int3\n"
	".type kpt_int3, @function\n"
	"kpt_int3:\n"
	"	nop\n"
	"	int3\n"
	"	ret\n"
	".size kpt_int3, .-kpt_int3\n");

extern long kpt_data;

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 5;
	long sum = 0;

	setvbuf(stdout, NULL, _IONBF, 0);
	for (long i = 0; i < n; i++)
		sum += work(i);
	printf("sum=%ld\n", sum);
	printf("compute=%d\n", compute(7));
	show(message);
	long a1 = kpt_asm(1);
	long a0 = kpt_asm(0);
	printf("asm1=%ld asm0=%ld data=%ld\n", a1, a0, kpt_data);
	if (argc > 2) /* never true in the tests: keeps the refused functions referenced */
		kpt_iret(), kpt_int3();
	return 0;
}
