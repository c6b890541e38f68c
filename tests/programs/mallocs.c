/*
 * A multi-threaded program that checks what it computes, for probes on malloc (and on a
 * frame-building function) whose tool is killed at random moments:
 *
 *   mallocs THREADS
 *
 * Each worker loops until SIGUSR1 (or SIGTERM, SIGINT): it mallocs a block of 16..79 bytes
 * (with every callee-saved register holding a known value across the call, checked after
 * it), fills it from its loop counter, calls framed() on the counter, checks the block and the
 * result, frees the block, and counts the iteration twice: in its loop counter (a register
 * across the calls, as compiled) and in memory. A register a probe left wrong (the counter, a
 * callee-saved register, the stack pointer) shows as a mismatch: "thread W: BAD ..." on
 * stderr and exit status 1. Otherwise, at the end, "thread W: every call checked" per worker
 * in order, then "total: N threads stopped", and exit status 0. "mallocs PID ready" goes to
 * stderr once every worker runs.
 *
 * framed(x) = 2x + 1 is hand-written so that it begins with the usual frame prologue,
 * `push %rbp` (one byte) then `mov %rsp,%rbp`: two probes on adjacent instructions.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "stop_signals.h"

#define MAX_THREADS 64

long framed(long x);
__asm__(".text\n"
	".globl framed\n"
	".type framed, @function\n"
	"framed:\n"
	"	push %rbp\n"
	"	mov %rsp, %rbp\n"
	"	lea 1(%rdi,%rdi), %rax\n"
	"	pop %rbp\n"
	"	ret\n"
	".size framed, .-framed\n");

/* void *guarded_malloc(size_t size, long seed, long *changed): malloc(size) with rbx, rbp and
   r12-r15 holding seed+0..5 across the call; *changed is nonzero if any of them came back
   different (a callee-saved register malloc's own pushes and pops must give back). */
void *guarded_malloc(size_t size, long seed, long *changed);
__asm__(".text\n"
	".globl guarded_malloc\n"
	".type guarded_malloc, @function\n"
	"guarded_malloc:\n"
	"	push %rbx\n"
	"	push %rbp\n"
	"	push %r12\n"
	"	push %r13\n"
	"	push %r14\n"
	"	push %r15\n"
	"	sub $24, %rsp\n"        /* entered at 8 mod 16; 6 pushes and 24: 0 mod 16 */
	"	mov %rsi, 0(%rsp)\n"
	"	mov %rdx, 8(%rsp)\n"
	"	mov %rsi, %rbx\n"
	"	lea 1(%rsi), %rbp\n"
	"	lea 2(%rsi), %r12\n"
	"	lea 3(%rsi), %r13\n"
	"	lea 4(%rsi), %r14\n"
	"	lea 5(%rsi), %r15\n"
	"	call malloc@PLT\n"
	"	mov 0(%rsp), %rsi\n"
	"	mov %rbx, %rcx\n"
	"	xor %rsi, %rcx\n"
	"	lea 1(%rsi), %rdx\n"
	"	xor %rbp, %rdx\n"
	"	or %rdx, %rcx\n"
	"	lea 2(%rsi), %rdx\n"
	"	xor %r12, %rdx\n"
	"	or %rdx, %rcx\n"
	"	lea 3(%rsi), %rdx\n"
	"	xor %r13, %rdx\n"
	"	or %rdx, %rcx\n"
	"	lea 4(%rsi), %rdx\n"
	"	xor %r14, %rdx\n"
	"	or %rdx, %rcx\n"
	"	lea 5(%rsi), %rdx\n"
	"	xor %r15, %rdx\n"
	"	or %rdx, %rcx\n"
	"	mov 8(%rsp), %rdx\n"
	"	mov %rcx, (%rdx)\n"
	"	add $24, %rsp\n"
	"	pop %r15\n"
	"	pop %r14\n"
	"	pop %r13\n"
	"	pop %r12\n"
	"	pop %rbp\n"
	"	pop %rbx\n"
	"	ret\n"
	".size guarded_malloc, .-guarded_malloc\n");

struct worker {
	long id;
	volatile long count;
	pthread_t thread;
};

static struct worker workers[MAX_THREADS];
static pthread_barrier_t started;

static void bad(long id, const char *what, long got, long want)
{
	fprintf(stderr, "thread %ld: BAD %s=%ld, expected %ld\n", id, what, got, want);
	exit(1);
}

static void *work(void *arg)
{
	struct worker *w = arg;

	pthread_barrier_wait(&started);
	if (w->id == 0) {
		fprintf(stderr, "mallocs %d ready\n", (int)getpid());
		fflush(stderr);
	}
	for (long i = 0; !stop; i++) {
		if (i != w->count)
			bad(w->id, "iterations", i, w->count);
		size_t size = 16 + (size_t)(i % 64);
		long changed = 0;
		unsigned char *p = guarded_malloc(size, i * 8, &changed);
		if (p == NULL)
			bad(w->id, "malloc", 0, (long)size);
		if (changed != 0)
			bad(w->id, "callee-saved registers changed by", changed, 0);
		for (size_t k = 0; k < size; k++)
			p[k] = (unsigned char)(i + (long)k);
		long f = framed(i);
		if (f != 2 * i + 1)
			bad(w->id, "framed", f, 2 * i + 1);
		for (size_t k = 0; k < size; k++)
			if (p[k] != (unsigned char)(i + (long)k))
				bad(w->id, "block byte", p[k], (unsigned char)(i + (long)k));
		free(p);
		w->count = i + 1;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long threads = argc > 1 ? atol(argv[1]) : 4;
	if (threads < 1 || threads > MAX_THREADS) {
		fprintf(stderr, "usage: mallocs THREADS (1..%d)\n", MAX_THREADS);
		return 2;
	}
	stop_on_signals();
	pthread_barrier_init(&started, NULL, (unsigned)threads);
	for (long t = 0; t < threads; t++) {
		workers[t].id = t;
		pthread_create(&workers[t].thread, NULL, work, &workers[t]);
	}
	for (long t = 0; t < threads; t++)
		pthread_join(workers[t].thread, NULL);
	for (long t = 0; t < threads; t++)
		printf("thread %ld: every call checked\n", t);
	printf("total: %ld threads stopped\n", threads);
	return 0;
}
