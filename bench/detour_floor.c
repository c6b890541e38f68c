/*
 * The C detour floor: the least a jump-optimized probe can cost, its detour written by hand.
 *
 *   detour_floor count|record|record-cold|none work_push N [threads=T]
 *
 * This is the bench target (target.c, included below with its main renamed: the same loop,
 * the same work_push, the same timing and the same threads=T mode) whose work_push the
 * program patches itself before the loop: its first 5 bytes become a `jmp` to a detour
 * written here in assembly, which does its work, runs the displaced instructions (`push %rbp;
 * mov %rsp,%rbp; lea 1(%rdi),%rax`: the first whole instructions that cover 5 bytes) and
 * jumps back to work_push+8. No tool, no code generation, no shared memory with another
 * process: what remains is what any in-program probe must pay.
 *
 *   count   `lock incq` of a counter (threads may share it).
 *   record  a 64-byte record in a ring of 64-byte slots: reserve a ticket with `lock cmpxchg`
 *           on the ring's head when head - tail < capacity (else count a drop and write
 *           nothing), then write the TSC (`rdtsc`), the thread pointer (`rdfsbase`), the
 *           argument (rdi) and, last, the commit word (ticket + 1): the protocol of
 *           kprobes/arch/x86_64/shared_area.py reduced to one slot, no probe id, no CPU.
 *   record-cold  the same with the ring's pages not faulted in before the loop, and shared
 *           (shmem, as our memfd ring is): the hits of the first lap fault them in.
 *   none    no patch: the unprobed figure of this binary.
 *
 * Like our detours, both keep every register and the arithmetic flags of the program (the
 * detour cannot know that the flags are dead at a function's entry): the red zone stepped
 * over, the flags saved with `seto; lahf` and restored with `add $0x7f,%al; sahf`. The ring
 * holds every record of a run (nobody reads it during the run), so no drop is timed, and
 * except in record-cold it is mapped with MAP_POPULATE, so no page fault is: a floor.
 *
 * After the target's own `ns_per_call=` line it prints `hits=` (count: the counter; record:
 * records committed + drops), and for record `records=`, `dropped=` and `arg_sum=` (the sum of
 * the arguments recorded), from a walk of the ring that also checks every commit word.
 */
#define main target_main
#include "target.c"
#undef main

#include <stdint.h>
#include <sys/auxv.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOT 64

/* Each word the detours update on its own cache line, as in our shared area. */
#define LINE __attribute__((visibility("hidden"), aligned(64)))
LINE long floor_count;
LINE long floor_head;
LINE long floor_tail;
LINE long floor_drops;
LINE long floor_cap;
__attribute__((visibility("hidden"))) long floor_mask;
__attribute__((visibility("hidden"))) char *floor_ring;

/* A record: the commit word first, as in our ring. */
struct record {
    uint64_t commit, tsc, thread, arg;
    char pad[SLOT - 32];
};

__asm__(
    ".text\n"

    ".globl floor_count_detour\n.hidden floor_count_detour\n"
    ".type floor_count_detour,@function\n.p2align 4\n"
    "floor_count_detour:\n"
    "  lea -128(%rsp), %rsp\n" /* the red zone; lea keeps the flags */
    "  push %rax\n"
    "  seto %al\n"
    "  lahf\n"
    "  lock incq floor_count(%rip)\n"
    "  add $0x7f, %al\n" /* OF again: 1 + 0x7f overflows, 0 + 0x7f does not */
    "  sahf\n"
    "  pop %rax\n"
    "  lea 128(%rsp), %rsp\n"
    "  push %rbp\n" /* the displaced instructions */
    "  mov %rsp, %rbp\n"
    "  lea 1(%rdi), %rax\n"
    "  jmp work_push+8\n"
    ".size floor_count_detour, .-floor_count_detour\n"

    ".globl floor_record_detour\n.hidden floor_record_detour\n"
    ".type floor_record_detour,@function\n.p2align 4\n"
    "floor_record_detour:\n"
    "  lea -128(%rsp), %rsp\n"
    "  push %rax\n"
    "  seto %al\n"
    "  lahf\n"
    "  push %rax\n" /* the flags */
    "  push %rcx\n"
    "  push %rdx\n"
    "  push %rsi\n"
    /* Step 1: ticket rax, if the ring has room; rcx = rax + 1, the commit word. */
    "  mov floor_head(%rip), %rax\n"
    "1:\n"
    "  lea 1(%rax), %rcx\n"
    "  mov %rcx, %rdx\n"
    "  sub floor_tail(%rip), %rdx\n"
    "  cmp floor_cap(%rip), %rdx\n"
    "  jg 3f\n"
    "  lock cmpxchg %rcx, floor_head(%rip)\n"
    "  jne 1b\n"
    /* Step 2: rsi = the ticket's slot. */
    "  mov %rax, %rsi\n"
    "  and floor_mask(%rip), %rsi\n"
    "  shl $6, %rsi\n"
    "  add floor_ring(%rip), %rsi\n"
    /* Step 3: the fields, then the commit word. */
    "  rdtsc\n"
    "  shl $32, %rdx\n"
    "  or %rdx, %rax\n"
    "  mov %rax, 8(%rsi)\n"
    "  rdfsbase %rax\n"
    "  mov %rax, 16(%rsi)\n"
    "  mov %rdi, 24(%rsi)\n"
    "  mov %rcx, (%rsi)\n"
    "  jmp 4f\n"
    /* The ring is full: count the drop, write nothing. */
    "3:\n"
    "  lock incq floor_drops(%rip)\n"
    "4:\n"
    "  pop %rsi\n"
    "  pop %rdx\n"
    "  pop %rcx\n"
    "  pop %rax\n"
    "  add $0x7f, %al\n"
    "  sahf\n"
    "  pop %rax\n"
    "  lea 128(%rsp), %rsp\n"
    "  push %rbp\n"
    "  mov %rsp, %rbp\n"
    "  lea 1(%rdi), %rax\n"
    "  jmp work_push+8\n"
    ".size floor_record_detour, .-floor_record_detour\n");

void floor_count_detour(void), floor_record_detour(void);

/* What the detours displace and re-run: push %rbp; mov %rsp,%rbp; lea 1(%rdi),%rax. */
static const unsigned char displaced[8] = {0x55, 0x48, 0x89, 0xe5, 0x48, 0x8d, 0x47, 0x01};

static void die(const char *what)
{
    perror(what);
    exit(125);
}

/* Step 1 of a run: `jmp to` over the first 5 bytes of `at` (the page made writable and back). */
static void patch_jmp(unsigned char *at, void (*to)(void))
{
    if (memcmp(at, displaced, sizeof displaced) != 0) {
        fprintf(stderr, "detour_floor: work_push does not start as the detours expect\n");
        exit(125);
    }
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)at & ~(uintptr_t)(page - 1);
    size_t len = (uintptr_t)at + 5 > start + (uintptr_t)page ? 2 * (size_t)page : (size_t)page;
    if (mprotect((void *)start, len, PROT_READ | PROT_WRITE | PROT_EXEC) != 0)
        die("mprotect");
    int32_t rel = (int32_t)((intptr_t)to - (intptr_t)(at + 5));
    at[0] = 0xe9;
    memcpy(at + 1, &rel, sizeof rel);
    if (mprotect((void *)start, len, PROT_READ | PROT_EXEC) != 0)
        die("mprotect");
}

/* Step 2 (record): a ring for every record of the run, its pages faulted in now if `warm`. */
static void map_ring(long calls, int warm)
{
    if (!(getauxval(AT_HWCAP2) & 2)) { /* HWCAP2_FSGSBASE */
        fprintf(stderr, "detour_floor: no FSGSBASE (rdfsbase) on this kernel\n");
        exit(125);
    }
    long cap = SLOT;
    while (cap < calls)
        cap *= 2;
    int flags = warm ? MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE : MAP_SHARED | MAP_ANONYMOUS;
    floor_ring = mmap(NULL, (size_t)cap * SLOT, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (floor_ring == MAP_FAILED)
        die("mmap ring");
    floor_cap = cap;
    floor_mask = cap - 1;
}

/* Step 3 (record): every ticket's record committed, and the sum of their arguments. */
static int check_ring(void)
{
    long records = 0, sum = 0;
    for (long t = 0; t < floor_head; t++) {
        const struct record *r = (const struct record *)(floor_ring + (t & floor_mask) * SLOT);
        if (r->commit != (uint64_t)t + 1 || r->thread == 0) {
            fprintf(stderr, "detour_floor: ticket %ld: commit %#lx, thread %#lx\n", t,
                    (unsigned long)r->commit, (unsigned long)r->thread);
            return 1;
        }
        records++;
        sum += (long)r->arg;
    }
    printf("hits=%ld\nrecords=%ld\ndropped=%ld\narg_sum=%ld\n", records + floor_drops, records,
           floor_drops, sum);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4 || strcmp(argv[2], "work_push") != 0) {
        fprintf(stderr, "usage: %s count|record|record-cold|none work_push N [threads=T]\n",
                argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    int record = strncmp(mode, "record", 6) == 0;
    if (strcmp(mode, "count") == 0) {
        patch_jmp((unsigned char *)work_push, floor_count_detour);
    } else if (strcmp(mode, "record") == 0 || strcmp(mode, "record-cold") == 0) {
        map_ring(strtol(argv[3], NULL, 10), strcmp(mode, "record") == 0);
        patch_jmp((unsigned char *)work_push, floor_record_detour);
    } else if (strcmp(mode, "none") != 0) {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    int status = target_main(argc - 1, argv + 1);
    if (status != 0)
        return status;
    if (strcmp(mode, "count") == 0)
        printf("hits=%ld\n", floor_count);
    else if (record)
        return check_ring();
    return 0;
}
