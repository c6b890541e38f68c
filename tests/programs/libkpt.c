/* The shared library of the shared-library tests: lib_work() is probed as "libkpt:lib_work"
 * and as "/path/to/libkpt.so:lib_work". */
__attribute__((noinline)) long lib_work(long x) { return x * 5 + 1; }
