/*
 * One function of each kind ``kprobes list -l`` tells apart, for its tests:
 *
 *   roomy          a plain C function: its entry takes a jump
 *   tiny           one `ret`: 1 byte to its end, too few for the 5 of a jump: a breakpoint
 *   unsized        a function symbol without a size (an assembly label): a breakpoint
 *   loops_back     a loop whose `jl` goes back to its second instruction, inside the five
 *                  bytes a jump at its entry would take: a breakpoint
 *   starts_int3    begins with int3 (another debugger's breakpoint?): refused
 *   starts_int80   begins with `int 0x80`, a software interrupt: refused
 *   in_data        a function symbol in .data, not executable: refused
 *   chosen         a GNU ifunc (its resolver is pick_chosen): judged when placed
 *
 *   listing              calls them all in a loop until SIGTERM, SIGINT or SIGUSR1, after
 *                        writing "listing PID ready" on stderr
 *   listing traceme      the same, traced by its parent (PTRACE_TRACEME): no other tracer
 *                        can attach to it
 */
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
#include <unistd.h>

#include "stop_signals.h"

volatile long sink;

__attribute__((noinline)) long roomy(long i)
{
	sink += i;
	return i * 3 + 1;
}

long tiny(void);
long unsized(void);
long loops_back(void);

__asm__(".text\n"
	".globl tiny\n.type tiny, @function\n"
	"tiny:\n\tret\n"
	".size tiny, .-tiny\n"
	".globl unsized\n.type unsized, @function\n"
	"unsized:\n\txor %eax, %eax\n\tret\n"
	".globl loops_back\n.type loops_back, @function\n"
	"loops_back:\n\txor %eax, %eax\n"
	"1:\n\tinc %eax\n\tcmp $10, %eax\n\tjl 1b\n\tret\n"
	".size loops_back, .-loops_back\n"
	".globl starts_int3\n.type starts_int3, @function\n"
	"starts_int3:\n\tint3\n\tret\n"
	".size starts_int3, .-starts_int3\n"
	".globl starts_int80\n.type starts_int80, @function\n"
	"starts_int80:\n\tint $0x80\n\tret\n"
	".size starts_int80, .-starts_int80\n"
	".data\n"
	".globl in_data\n.type in_data, @function\n"
	"in_data:\n\tret\n"
	".size in_data, .-in_data\n"
	".text\n");

static long chosen_impl(void) { return 7; }
static long (*pick_chosen(void))(void) { return chosen_impl; }
long chosen(void) __attribute__((ifunc("pick_chosen")));

int main(int argc, char **argv)
{
	stop_on_signals();
	if (argc > 1 && strcmp(argv[1], "traceme") == 0 && ptrace(PTRACE_TRACEME, 0, 0, 0) != 0) {
		perror("ptrace");
		return 1;
	}
	fprintf(stderr, "listing %d ready\n", (int)getpid());
	for (long i = 0; !STOPPED(); i++) {
		sink += roomy(i) + tiny() + unsized() + loops_back() + chosen();
		usleep(1000);
	}
	return 0;
}
