/*
 * The fidelity test's program: every instruction boundary of hand(), cmp_ints() and
 * hash_buf() is probed (and of libc's qsort/qsort_r), and the output must not change.
 * Built with -O2 so that gcc emits a jump table for the switch in hand().
 *
 *   fidelity N_HAND N_SORT N_HASH
 *
 * It prints "ready" on stderr and waits for one line on stdin before doing any work, so a
 * reference tool can attach its probes while the binary is mapped.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static long table[16];
long g_acc;
long g_tf_seen;
long g_flags_seen;

__attribute__((noinline)) long leaf(long x) { return x * 7 + 3; }

/* Hand-written: rip-relative loads and stores, calls, jcc, a loop, pushf/popf, a jump table. */
__attribute__((noinline)) long hand(long n)
{
	unsigned long acc = 0; /* wraps: a long would overflow (undefined) */

	for (long i = 0; i < n; i++) {
		table[i & 15] += i;
		acc += (unsigned long)table[(i * 5) & 15];
		if (acc & 1)
			acc += (unsigned long)leaf(i);
		else
			acc ^= (unsigned long)leaf((long)(acc & 0xffff));

		unsigned long fl;
		__asm__ volatile("pushf\n\t"
				 "pop %0\n\t"
				 "push %0\n\t"
				 "popf"
				 : "=r"(fl)
				 :
				 : "cc", "memory");
		g_tf_seen += (fl >> 8) & 1; /* TF must never be visible to the program */
		g_flags_seen += (fl >> 1) & 1; /* bit 1 of RFLAGS is always set */

		switch (i % 7) {
		case 0:
			acc += 11;
			break;
		case 1:
			acc ^= 0x55;
			break;
		case 2:
			acc = acc * 3;
			break;
		case 3:
			acc -= (unsigned long)i;
			break;
		case 4:
			acc += (unsigned long)leaf(i ^ (long)acc);
			break;
		case 5:
			acc = (acc << 3) | (acc >> 61);
			break;
		case 6:
			acc += (unsigned long)g_acc;
			break;
		}
		g_acc += (long)(acc & 0xff);
	}
	return (long)acc;
}

__attribute__((noinline)) int cmp_ints(const void *a, const void *b)
{
	int x = *(const int *)a, y = *(const int *)b;

	return (x > y) - (x < y);
}

__attribute__((noinline)) uint64_t hash_buf(const unsigned char *p, size_t n)
{
	uint64_t h = 1469598103934665603ULL;

	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 1099511628211ULL;
	}
	return h;
}

int main(int argc, char **argv)
{
	long n_hand = argc > 1 ? atol(argv[1]) : 100;
	long n_sort = argc > 2 ? atol(argv[2]) : 64;
	long n_hash = argc > 3 ? atol(argv[3]) : 1000;
	char line[16];

	setvbuf(stdout, NULL, _IONBF, 0);
	fprintf(stderr, "ready\n");
	if (!fgets(line, sizeof line, stdin))
		return 3;

	long h = hand(n_hand);
	printf("hand=%ld acc=%ld tf=%ld flags=%ld\n", h, g_acc, g_tf_seen, g_flags_seen);

	int *v = malloc(sizeof(int) * (size_t)n_sort);
	uint32_t x = 12345;
	for (long i = 0; i < n_sort; i++) {
		x = x * 1103515245u + 12345u;
		v[i] = (int)(x >> 8) % 1000 - 500;
	}
	qsort(v, (size_t)n_sort, sizeof(int), cmp_ints);
	long check = 0;
	for (long i = 0; i < n_sort; i++) {
		check = check * 31 + v[i];
		if (i > 0 && v[i - 1] > v[i])
			printf("unsorted at %ld\n", i);
	}
	printf("sorted min=%d max=%d check=%ld\n", v[0], v[n_sort - 1], check);

	unsigned char *buf = malloc((size_t)n_hash);
	for (long i = 0; i < n_hash; i++)
		buf[i] = (unsigned char)(i * 131 + (i >> 3));
	printf("hash=%016llx\n", (unsigned long long)hash_buf(buf, (size_t)n_hash));
	free(buf);
	free(v);
	return 0;
}
