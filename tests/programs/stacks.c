/* Known call paths for user stacks (tests/test_stacks.py), built at -O2 without frame
 * pointers (-fomit-frame-pointer: rbp is an ordinary register, so only the unwind tables
 * can walk these frames):
 *
 *   main -> a -> leaf            3 times
 *   main -> b -> leaf            5 times
 *   main -> stk_through -> leaf  2 times (stk_through is in libstk.so)
 *
 * Each function does work after its call returns, so that no call becomes a tail jump
 * (which would leave a frame out), and none is inlined or cloned.
 *
 *   stacks          makes the calls, prints "stacks TOTAL"
 *   stacks gated    waits for a line on stdin first, and after its line for the end of
 *                   stdin: alive while a tool reads its events (attached with -p) */
#include <stdio.h>
#include <string.h>

#define KEEP __attribute__((noinline, noclone))

int stk_through(int (*f)(int), int x);

volatile int sink;

KEEP int leaf(int x)
{
    sink += x;
    return x * 3 + sink * 0;
}

KEEP int a(int x)
{
    int r = leaf(x + 1);

    sink += r;
    return r + 2;
}

KEEP int b(int x)
{
    int r = leaf(x * 2);

    sink -= r;
    return r + 5;
}

int main(int argc, char **argv)
{
    int total = 0;
    int gated = argc > 1 && strcmp(argv[1], "gated") == 0;
    int c;

    if (gated)
        while ((c = getchar()) != EOF && c != '\n')
            ;

    for (int i = 0; i < 3; i++)
        total += a(i);
    for (int i = 0; i < 5; i++)
        total += b(i);
    for (int i = 0; i < 2; i++)
        total += stk_through(leaf, i);
    printf("stacks %d\n", total);
    fflush(stdout);
    if (gated)
        while (getchar() != EOF)
            ;
    return 0;
}
