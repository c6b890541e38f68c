/* At -O2 gcc clones work() and unused() with constants propagated and unused parameters
 * removed (work.constprop.0.isra.0): the clones' DWARF still points at the originals' abstract
 * DIEs, with the original parameter lists, while they take fewer arguments. */
volatile long sink;

static __attribute__((noinline)) long work(long a, long b, const char *s)
{
    for (int i = 0; i < a; i++)
        sink += b * i + s[i % 3];
    return sink;
}

static __attribute__((noinline)) long unused(long a, long unused_arg)
{
    for (int i = 0; i < a; i++)
        sink += i;
    return sink;
}

int main(int argc, char **argv)
{
    (void)argv;
    work(argc, 5, "abc");
    work(argc + 1, 5, "abc");
    unused(argc, 3);
    unused(argc + 2, 4);
    return 0;
}
