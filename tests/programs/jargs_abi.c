/* One call with more arguments than registers, of every class, for the live ABI check: a
 * debugger stopped at the first instruction of each j_abi_* function must find every argument
 * where kprobes.arch.x86_64.abi.assign_locations says. The values are repeated in
 * tests/arch/test_abi.py. */
#include <stdbool.h>

#define PROBED __attribute__((noinline, noipa, used))

struct pair_f { float x, y; };            /* SSE */
struct mixed { double d; long n; };        /* SSE, INTEGER */
struct two_l { long a, b; };               /* INTEGER, INTEGER */
struct big { long a, b, c; };              /* MEMORY: 24 bytes */
struct packed_s { char c; int n; } __attribute__((packed)); /* MEMORY: unaligned */
struct vec3 { float x, y, z; };            /* SSE, SSE */
struct ld_s { long double v; };            /* MEMORY: X87 */

volatile long sink;

PROBED long j_abi_many(int i1, double d1, struct pair_f pf, long i2, struct mixed mx,
                       struct big bg, float f1, const char *s, long double ld, unsigned char uc,
                       struct two_l tl, short i5, __int128 w, double d2, double d3, double d4,
                       double d5, double d6, double d7, double d8, long i7, struct vec3 v3,
                       bool flag, struct packed_s ps, struct ld_s lds)
{
    sink = i1 + (long)d1 + (long)pf.x + i2 + mx.n + bg.c + (long)f1 + s[0] + (long)ld + uc
         + tl.b + i5 + (long)w + (long)(d2 + d3 + d4 + d5 + d6 + d7 + d8) + i7 + (long)v3.z
         + flag + ps.n + (long)lds.v;
    return sink;
}

/* The hidden result pointer takes rdi: the five longs start in rsi, and the sixth spills. */
PROBED struct big j_abi_sret(long a, long b, long c, long d, long e, long f)
{
    struct big r = { a + b, c + d, e + f };
    return r;
}

/* All or nothing: five integer registers are taken, so two_l (two eightbytes) goes to the
 * stack, and the long after it still gets r9. */
PROBED long j_abi_allornothing(long a, long b, long c, long d, long e, struct two_l tl, long f)
{
    sink = a + b + c + d + e + tl.a + tl.b + f;
    return sink;
}

int main(void)
{
    struct pair_f pf = { 1.25f, -2.5f };
    struct mixed mx = { 3.75, -4 };
    struct big bg = { 5, -6, 7 };
    struct two_l tl = { 8, -9 };
    struct vec3 v3 = { 10.5f, 11.5f, -12.5f };
    struct packed_s ps = { 'P', 13 };
    struct ld_s lds = { -14.25L };
    j_abi_many(-1, 0.5, pf, 2, mx, bg, 1.5f, "str", 2.75L, 200, tl, -3,
               ((__int128)0x1234 << 64) | 0x5678, 20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0,
               -27, v3, true, ps, lds);
    struct big r = j_abi_sret(31, 32, 33, 34, 35, 36);
    sink = r.a;
    j_abi_allornothing(41, 42, 43, 44, 45, tl, 46);
    return 0;
}
