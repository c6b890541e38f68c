/* Functions with parameters of every kind the DWARF reader distinguishes, for
 * tests/symbols/test_dwarf.py (which repeats the signatures). Built with jargs_other.c, a
 * second compilation unit. noipa keeps -O2 from cloning a function with a changed signature;
 * main calls everything so that nothing is dropped. */
#include <complex.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PROBED __attribute__((noinline, noipa, used))

struct point { int x, y; };
struct mixed { double d; long n; };
struct vec3 { float x, y, z; };
struct big { long a, b, c; };
struct packed_s { char c; int n; } __attribute__((packed));
union num { long l; double d; };
struct flags { unsigned a : 3, b : 5; int c; };
struct tagged { char tag[3]; short s; };
enum color { RED, GREEN, BLUE };
enum sign { NEG = -1, POS = 1 };
typedef unsigned long my_size;
typedef const char *cstr;

volatile long sink;
extern double j_other(unsigned short h, double d);

PROBED int j_ints(int a, unsigned char b, long c, short d, unsigned long long e, signed char f)
{
    sink = a + b + c + d + (long)e + f;
    return a;
}

PROBED double j_floats(double a, float b, long double c)
{
    sink = (long)(a + b + c);
    return a;
}

PROBED size_t j_strings(const char *s, char *t, unsigned char *u, const signed char *v,
                        uint8_t *bytes, cstr w)
{
    sink = (long)s + (long)t + (long)u + (long)v + (long)bytes + (long)w;
    return 0;
}

PROBED long j_structs(struct point p, struct big b, struct point *pp, union num n,
                      struct vec3 v, struct mixed m, struct packed_s ps)
{
    sink = p.x + b.a + pp->y + n.l + (long)v.x + m.n + ps.n;
    return p.y;
}

PROBED int j_misc(enum color c, bool flag, void *opaque, my_size n, const volatile int *cv,
                  char *const cp, int (*fn)(int), char **argv, enum sign s)
{
    sink = c + flag + (long)opaque + (long)n + (long)cv + (long)cp + (long)fn + (long)argv + s;
    return 1;
}

PROBED int j_variadic(const char *fmt, int count, ...)
{
    va_list ap;
    long total = (long)fmt;
    va_start(ap, count);
    for (int i = 0; i < count; i++)
        total += va_arg(ap, int);
    va_end(ap);
    sink = total;
    return (int)total;
}

PROBED void j_none(void)
{
    sink = 0;
}

PROBED __int128 j_wide(__int128 w, unsigned __int128 uw)
{
    sink = (long)(w + uw);
    return w;
}

PROBED long j_layouts(struct flags f, double complex z, struct tagged t, float complex fz,
                      int matrix[2][3])
{
    sink = f.a + f.b + f.c + (long)creal(z) + t.tag[1] + t.s + (long)cimag(fz) + matrix[1][2];
    return sink;
}

static PROBED int j_static(int unused_at_o2, long k)
{
    sink = k;
    return 0;
}

PROBED struct big j_ret_big(int a)
{
    struct big b = { a, a, a };
    sink = a;
    return b;
}

static int twice(int x)
{
    return 2 * x;
}

/* At -O2: inlined into main and also kept out of line (its address escapes), so the DWARF
 * has an abstract instance (names, types) and a concrete one that points at it. */
static __attribute__((used)) int j_inlined(long a, const char *s)
{
    sink = a + s[0];
    return 3;
}
int (*volatile j_inlined_ptr)(long, const char *) = j_inlined;

int main(int argc, char **argv)
{
    struct point p = { 1, 2 };
    struct big b = { 3, 4, 5 };
    union num n = { .l = 6 };
    struct vec3 v = { 7, 8, 9 };
    struct mixed m = { 10.5, 11 };
    struct packed_s ps = { 'c', 12 };
    struct flags f = { 1, 2, 3 };
    struct tagged t = { "ab", 4 };
    int matrix[2][3] = { { 0 } };
    j_ints(-1, 200, -3, -4, 5, -6);
    j_floats(1.5, 2.5f, 3.5L);
    j_strings("s", argv[0], (unsigned char *)argv[0], (const signed char *)"v",
              (uint8_t *)argv[0], "w");
    j_structs(p, b, &p, n, v, m, ps);
    j_misc(BLUE, true, &p, 13, &argc, argv[0], twice, argv, NEG);
    j_variadic("%d", 2, 14, 15);
    j_none();
    j_wide(16, 17);
    j_layouts(f, 1.0 + 2.0 * I, t, 3.0f, matrix);
    j_static(argc, 18);
    j_ret_big(19);
    j_inlined(20, "x");
    j_inlined_ptr(21, "y");
    j_other(22, 23.5);
    return 0;
}
