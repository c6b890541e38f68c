/* The sink the leaf functions of the test programs add their arguments to, so that no call is
 * optimized away: written by every thread, read by none.
 *
 * `sink += x` on a plain (even volatile) long is a data race when threads call the function,
 * and its signed sum may overflow in a long run: both undefined behaviour. SINK_ADD is the
 * same load, add and store (gcc emits identical code: the probed functions keep their bytes),
 * as relaxed atomics in unsigned arithmetic, which is defined. */
#define SINK_ADD(x)                                                                          \
	__atomic_store_n(&sink,                                                              \
			 (long)((unsigned long)__atomic_load_n(&sink, __ATOMIC_RELAXED) +     \
				(unsigned long)(x)),                                          \
			 __ATOMIC_RELAXED)
