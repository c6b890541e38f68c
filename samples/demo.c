/* The bundled example program for `make demo`: a few lines of output through libc's
 * write(2), so samples/kprobe_example.py has something to probe. */
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int lines = argc > 1 ? atoi(argv[1]) : 3;
    for (int i = 0; i < lines; i++) {
        char buf[64];
        int n = snprintf(buf, sizeof buf, "demo: line %d of %d\n", i + 1, lines);
        if (write(STDOUT_FILENO, buf, (size_t)n) != n)
            return 1;
    }
    return 0;
}
