/* The bundled example program for `make demo`: a few lines of output through libc's
 * write(2), so the samples have something to probe. emit_line() is there for the jprobe
 * sample: a function with an int, a string and a double among its arguments. */
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>

__attribute__((noinline)) int emit_line(int fd, const char *text, int number, double fraction)
{
    size_t len = strlen(text);
    if (fraction < 0 || write(fd, text, len) != (ssize_t)len)
        return -1;
    return number;
}

int main(int argc, char **argv)
{
    int lines = argc > 1 ? atoi(argv[1]) : 3;
    for (int i = 0; i < lines; i++) {
        char buf[64];
        snprintf(buf, sizeof buf, "demo: line %d of %d\n", i + 1, lines);
        if (emit_line(STDOUT_FILENO, buf, i + 1, (i + 1.0) / lines) != i + 1)
            return 1;
    }
    return 0;
}
