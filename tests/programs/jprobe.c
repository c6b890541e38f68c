/*
 * The jprobe tests' program: functions whose arguments travel in every way the SysV ABI has.
 *
 *   jprobe N    for i < N: mixed(i, "name-i", i + 0.5, -i, i * 0.25f, 200 + i, 7, 8, 9 + i)
 *               and by_value({i, -i}, {i, 2 * i, 3 * i}); prints a checksum
 *
 * mixed's nine arguments: a=rdi s=rsi d=xmm0 b=rdx f=xmm1 c=rcx e=r8 g=r9 h=[rsp+8].
 */
#include <stdio.h>
#include <stdlib.h>

struct pt { int x, y; };
struct big { long a, b, c; };

volatile long sink;

__attribute__((noinline)) long mixed(int a, const char *s, double d, long b, float f,
				     unsigned char c, long e, long g, long h)
{
	sink += a + s[0] + (long)d + b + (long)f + c + e + g + h;
	return sink;
}

__attribute__((noinline)) long by_value(struct pt p, struct big q)
{
	return p.x * 10 + p.y + q.a + q.b + q.c;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 3;
	long sum = 0;
	char name[32];
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof name, "name-%d", i);
		sum += mixed(i, name, i + 0.5, -i, i * 0.25f, 200 + i, 7, 8, 9 + i);
		sum += by_value((struct pt){i, -i}, (struct big){i, 2 * i, 3 * i});
	}
	printf("jprobe sum=%ld\n", sum);
	return 0;
}
