/* The shared library of tests/test_stacks.py: a frame of a library between two of the program
 * (main -> stk_through -> leaf), built like stacks.c at -O2 without frame pointers. */
#define KEEP __attribute__((noinline, noclone))

volatile int stk_sink;

KEEP int stk_through(int (*f)(int), int x)
{
    int r = f(x + 1);

    stk_sink += r; /* work after the call: no tail jump, the frame stays */
    return r + 1;
}
