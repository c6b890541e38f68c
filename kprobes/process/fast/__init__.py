"""The optimized tier: an int3 becomes a jump to a detour that counts or records in the program;
the detours' memory, the shared rings and the reader, the shield from other tools' uprobes,
and return probes timed in the program (shadow stacks and trampolines, returns.py)."""
