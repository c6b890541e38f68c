"""The Process target: Kprobes on a live process, with the mechanism run by us over ptrace.

The rooms, one mechanism each (``docs/decisions.md``, "process/ in rooms"):

- ``target.py`` (``Process``, what users hold), ``launch.py`` (``spawn``/``attach``),
  ``specs.py`` (probe-language lines placed on a process), ``stacks.py`` (backtraces);
- ``engine/``: the trap engine: the event loop, stopping the world, threads, breakpoints,
  out-of-line slots, signals, CPU placement, return trampolines, jprobes;
- ``fast/``: the optimized tier: jumps to detours, their memory, the rings and their reader;
  it falls back to the engine, which knows it only as the optimizer it drives;
- ``fetch/``: fetch-args: evaluated at a trap, compiled into captures for a detour, and a bad
  pointer turned into ``(fault)``;
- ``following/``: following the program: pending probes, the loader, exec, children that exec;
- ``survival/``: the program survives us: the rescue, the trap guard, the shield from other
  tools' uprobes, detach, cleanup at every way out, giving our pages back;
- ``inject/``: making the program run code for us: a syscall or call in a stopped thread, the
  program's own mmaps and ifunc resolvers, the one injection that goes home by itself.
"""
