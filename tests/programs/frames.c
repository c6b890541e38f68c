/* Unwind rows of several shapes, for the compact frame tables (tests/symbols/
 * test_frametable.py), built at -O2 with and without frame pointers:
 *
 *   grow     alloca: the CFA is rbp-based even without -fno-omit-frame-pointer
 *   wide     a 64-byte aligned local: the stack is realigned (a CFA expression in main-like
 *            code, through r10, at -O2 without frame pointers)
 *   deep     recursion with callee-saved registers live across the call
 *   bail     a call to a function that does not return
 *   main     calls each, prints "frames TOTAL" */
#include <alloca.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEEP __attribute__((noinline, noclone))

volatile long sink;

KEEP long grow(int n)
{
    char *p = alloca(n + 16);

    memset(p, n & 0x7f, n + 16);
    sink += p[n / 2];
    return sink;
}

KEEP long wide(int n)
{
    char buf[96] __attribute__((aligned(64)));

    memset(buf, n, sizeof buf);
    sink += buf[n % 96];
    return (long)(unsigned long)buf & 63;
}

KEEP long deep(long a, long b, int n)
{
    long x = a * 3 + b, y = b ^ a, z = a - b;

    if (n > 0)
        x += deep(y, z, n - 1);
    sink += x + y + z;
    return x ^ y ^ z;
}

KEEP __attribute__((noreturn)) void fail(const char *why)
{
    fprintf(stderr, "frames: %s\n", why);
    exit(2);
}

KEEP long bail(int n)
{
    if (n < 0)
        fail("negative");
    return n + sink;
}

int main(int argc, char **argv)
{
    long total = 0;

    for (int i = 0; i < 3; i++)
        total += grow(i + 8) + wide(i) + deep(i, i + 1, 4) + bail(i);
    printf("frames %ld\n", total);
    return argc > 5 ? (int)strlen(argv[1]) : 0;
}
