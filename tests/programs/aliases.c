/*
 * count's rows of a function with several names (issue 22, item 7).
 *
 *   aliases N    calls twin N times by each of its three names (twin, twin_too, _twin: one
 *                address), libc's strtol and strtoll (one function of libc's, four names)
 *                N times each, and lone once; never idle
 *
 * Output: sum=...
 */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) long twin(long i) { return i * 2 + 1; }
long twin_too(long i) __attribute__((alias("twin")));
long _twin(long i) __attribute__((alias("twin")));

__attribute__((noinline)) long lone(long i) { return i - 1; }
__attribute__((noinline, used)) long idle(long i) { return i + 2; }

int main(int argc, char **argv)
{
	long n = 3, sum = 0;
	char text[24];

	if (argc > 1)
		sscanf(argv[1], "%ld", &n);
	for (long i = 0; i < n; i++) {
		sum += twin(i) + twin_too(i) + _twin(i);
		snprintf(text, sizeof text, "%ld", i);
		sum += strtol(text, NULL, 10) + strtoll(text, NULL, 10);
	}
	sum += lone(n);
	printf("sum=%ld\n", sum);
	return 0;
}
