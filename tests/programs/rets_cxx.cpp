// C++ exceptions crossing return-probed frames.
//
//   rets_cxx N    N rounds of: outer(i) -> catcher(i) -> thrower(5) throws from its innermost
//                 frame, through Guard destructors that call leaf(); catcher catches, then
//                 outer returns normally. Prints a checksum that must not change under probes.
//   rets_cxx N wait   the same once a line was read from stdin
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

volatile long sink;

extern "C" __attribute__((noinline)) long leaf(long x) { sink += x; return x + 1; }

struct Guard {
	long v;
	~Guard() { sink += leaf(v); }
};

extern "C" __attribute__((noinline)) long thrower(long n)
{
	Guard g{n};
	if (n == 0)
		throw std::runtime_error("bottom");
	return thrower(n - 1) + 1;
}

extern "C" __attribute__((noinline)) long catcher(long i)
{
	try {
		return thrower(5);
	} catch (const std::exception &e) {
		return i * 10 + leaf(i);
	}
}

extern "C" __attribute__((noinline)) long outer(long i)
{
	sink = sink + i; // code before the call: room for a jump at the entry (one thread)
	return catcher(i) + 1;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10;
	if (argc > 2) {
		char line[64];
		if (!std::fgets(line, sizeof line, stdin))
			return 1;
	}
	long sum = 0;
	for (long i = 0; i < n; i++)
		sum += outer(i);
	std::printf("cxx sum=%ld sink=%ld\n", sum, (long)sink);
	return 0;
}
