/* Loads plugins with dlopen() and unloads them with dlclose(), round after round.
 *
 *   plughost LIBS ROUNDS CALLS [wait]
 *
 * LIBS is a comma-separated list of shared objects (paths), all opened at the start of a
 * round and closed at its end; each round calls plug_work(i), i in 0..CALLS-1, of each.
 * "wait": print "ready" and read one line of stdin before the first round (so that a test
 * can attach first). Prints the sum, and "dlopen: ..." on stderr if a load fails. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIBS 4

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: plughost LIBS ROUNDS CALLS [wait]\n");
		return 2;
	}
	char *names[MAX_LIBS];
	int nlibs = 0;
	for (char *tok = strtok(argv[1], ","); tok && nlibs < MAX_LIBS; tok = strtok(NULL, ","))
		names[nlibs++] = tok;
	int rounds = atoi(argv[2]), calls = atoi(argv[3]);
	if (argc > 4 && strcmp(argv[4], "wait") == 0) {
		char line[64];
		printf("ready\n");
		fflush(stdout);
		if (!fgets(line, sizeof line, stdin))
			return 3;
	}
	long sum = 0;
	for (int r = 0; r < rounds; r++) {
		void *handles[MAX_LIBS];
		for (int l = 0; l < nlibs; l++) {
			handles[l] = dlopen(names[l], RTLD_NOW | RTLD_LOCAL);
			if (!handles[l]) {
				fprintf(stderr, "dlopen: %s\n", dlerror());
				return 1;
			}
		}
		for (int l = 0; l < nlibs; l++) {
			long (*work)(long) = (long (*)(long))dlsym(handles[l], "plug_work");
			for (int i = 0; i < calls; i++)
				sum += work(i);
		}
		for (int l = nlibs - 1; l >= 0; l--)
			dlclose(handles[l]);
	}
	printf("plughost sum=%ld\n", sum);
	return 0;
}
