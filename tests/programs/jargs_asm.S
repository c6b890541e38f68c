/* An assembler function: with -g, GNU as describes it as a DWARF subprogram with no
 * parameters and an unspecified return type, which must not be taken for "takes nothing". */
    .text
    .globl  j_asm_add
    .type   j_asm_add, @function
j_asm_add:
    leaq    (%rdi,%rsi), %rax
    ret
    .size   j_asm_add, .-j_asm_add
    .section .note.GNU-stack,"",@progbits
