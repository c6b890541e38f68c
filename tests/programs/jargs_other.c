/* A second compilation unit, so that finding a function means finding its CU first. */
extern volatile long sink;
__attribute__((noinline, noipa)) double j_other(unsigned short h, double d)
{
    sink = h;
    return d * 2;
}
