/*
 * The decode benchmark's event source. It prints `ready` on stderr and waits for a line on
 * stdin, so that probes are in place before it works, then:
 *
 *   decode_target call N        calls decode_work(i, names[i % 4], i * 3) N times
 *   decode_target open N PATH   opens and closes PATH N times (the kernel's do_sys_openat2)
 *
 * and prints `calls=<N>`. decode_work is called through a volatile pointer, so every call is
 * a real call with the string's pointer in rsi.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const names[] = {
    "alpha",
    "bravo-charlie",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "delta echo foxtrot",
};

/* push rbp first, as a function built with frame pointers starts: the kernel's uprobes
 * emulate it (no single-step), so the program makes events as fast as uprobes can. */
__asm__(
    ".text\n"
    ".globl decode_work\n.type decode_work,@function\n.p2align 4\n"
    "decode_work:\n"
    "  push %rbp\n"
    "  mov %rsp, %rbp\n"
    "  movsbq (%rsi), %rax\n"
    "  add %rdi, %rax\n"
    "  mov %edx, %edx\n"
    "  add %rdx, %rax\n"
    "  pop %rbp\n"
    "  ret\n"
    ".size decode_work, .-decode_work\n");

long decode_work(long n, const char *s, unsigned x);

int main(int argc, char **argv)
{
    if (argc < 3 || (strcmp(argv[1], "open") == 0 && argc != 4)) {
        fprintf(stderr, "usage: %s call N | open N PATH\n", argv[0]);
        return 2;
    }
    long n = strtol(argv[2], NULL, 10);
    char line[64];
    fprintf(stderr, "ready\n");
    if (!fgets(line, sizeof line, stdin))
        return 1;
    volatile long sink = 0;
    if (strcmp(argv[1], "call") == 0) {
        long (*volatile fn)(long, const char *, unsigned) = decode_work;
        for (long i = 0; i < n; i++)
            sink += fn(i, names[i % 4], (unsigned)(i * 3));
    } else {
        for (long i = 0; i < n; i++) {
            int fd = open(argv[3], O_RDONLY);
            if (fd < 0) {
                perror(argv[3]);
                return 1;
            }
            close(fd);
        }
    }
    printf("calls=%ld\n", n);
    return 0;
}
