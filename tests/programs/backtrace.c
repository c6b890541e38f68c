/* A fixed call chain for stack traces (tests/test_backtrace.py, tests/symbols/test_unwind.py).
 *
 *   backtrace [chain] [N]  main -> a -> b -> c, N times (default 1)
 *   backtrace sort         main -> a -> b -> c -> qsort (libc) -> ... -> cmp
 *   backtrace rec N        main -> rec(N) -> rec(N-1) -> ... -> rec(0) -> c
 *
 * Every function does work after its call returns, so that no optimization level turns a
 * call into a tail jump (which would leave a frame out of the stack), and none of them is
 * inlined or cloned, so that each keeps its own symbol at -O2.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEEP __attribute__((noinline, noclone))

volatile int sink;
static int sorting;

KEEP int cmp(const void *l, const void *r)
{
    int x = *(const int *)l, y = *(const int *)r;

    sink++;
    return (x > y) - (x < y);
}

KEEP int c(int x)
{
    sink += x;
    if (sorting) {
        int v[4] = {4, x, 3, 1};

        qsort(v, 4, sizeof v[0], cmp);
        return v[0] + v[3] + sink * 0;
    }
    return x * 2 + sink * 0 + 1;
}

KEEP int b(int x)
{
    int r = c(x + 1);

    sink += r;
    return r + 3;
}

KEEP int a(int x)
{
    int r = b(x * 2);

    sink -= r;
    return r * 5;
}

KEEP int rec(int n)
{
    int r = n > 0 ? rec(n - 1) : c(n);

    sink += n;
    return r + n;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "chain";
    int n = argc > 2 ? atoi(argv[2]) : 1;
    long total = 0;

    if (strcmp(mode, "rec") == 0) {
        total = rec(n);
    } else {
        sorting = strcmp(mode, "sort") == 0;
        for (int i = 0; i < n; i++)
            total += a(i);
    }
    printf("%s %ld\n", mode, total);
    return 0;
}
