/* The plugin of the following tests (tests/test_following.py): loaded at startup by
 * "plugged", by dlopen() in "plughost".
 *
 * plug_work() is called once by the constructor, then by the host; plug_resolve() is the
 * resolver of the ifunc plug_fast, which the loader runs while it relocates the library
 * (plug_fast_ptr needs it), before any constructor. */
__attribute__((noinline)) long plug_work(long x) { return x * 3 + 1; }

static long fast_impl(long x) { return x + 2; }

__attribute__((noinline)) void *plug_resolve(void) { return (void *)fast_impl; }

long plug_fast(long x) __attribute__((ifunc("plug_resolve")));
long (*plug_fast_ptr)(long) = plug_fast;

long plug_seen;

__attribute__((constructor)) static void plug_init(void) { plug_seen = plug_work(-1); }
