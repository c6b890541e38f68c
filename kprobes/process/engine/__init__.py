"""The trap engine: wait for a stop, decide what it means, resume; every thread held still
when bytes are patched; breakpoints, out-of-line slots, signals, CPU placement, return
trampolines and return probes, jprobes, the core's hooks, and the rescue's tables."""
