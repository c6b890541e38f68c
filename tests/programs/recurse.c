/* Stacks deeper than a walk's limit, and shallow ones, for the records of the fast tier
 * (tests/test_fast_stack_records.py), built at -O2 without frame pointers:
 *
 *   recurse DEPTH TIMES   TIMES times: bottom() called DEPTH frames down a recursion of
 *                         down(), then bottom() called from main; prints "recurse TOTAL"
 *
 * down() does work after its call returns, so that the recursion stays a recursion. */
#include <stdio.h>
#include <stdlib.h>

#define KEEP __attribute__((noinline, noclone))

volatile long sink;

KEEP long bottom(long x)
{
    sink += x;
    return x + 1;
}

KEEP long down(int n)
{
    long r = n > 0 ? down(n - 1) : bottom(n);

    sink += r;
    return r + n;
}

int main(int argc, char **argv)
{
    int depth = argc > 1 ? atoi(argv[1]) : 300;
    int times = argc > 2 ? atoi(argv[2]) : 20;
    long total = 0;

    for (int i = 0; i < times; i++)
        total += down(depth) + bottom(i);
    printf("recurse %ld\n", total);
    return 0;
}
