"""The Process target: Kprobes on a live process, with the mechanism run by us over ptrace.

The rooms, one mechanism each, each importing only the rooms listed before it
(``docs/decisions.md``, "process/ in rooms" and "Parts and contracts in process/";
``tests/test_layout.py`` checks the order):

- ``engine/``: the trap engine: the event loop, stopping the world, threads, breakpoints,
  out-of-line slots, signals, CPU placement, return trampolines and return probes, jprobes,
  arming (the core's hooks), the rescue's tables; ``contracts.py`` says what it asks of the
  rooms above it;
- ``inject/``: making the program run code for us: a syscall or call in a stopped thread, the
  program's own mmaps and ifunc resolvers, the one injection that goes home by itself;
- ``fetch/``: fetch-args: evaluated at a trap, compiled into captures for a detour, and a bad
  pointer turned into ``(fault)``;
- ``fast/``: the optimized tier: jumps to detours, their memory, the rings and their reader,
  the shield from other tools' uprobes; it falls back to the engine, never the other way;
- ``survival/``: the program survives us: the trap guard, detach, cleanup at every way out,
  giving our pages back;
- ``following/``: following the program: pending probes, the loader, exec, children that exec;
- at the top: ``target.py`` (``Process``, which assembles the parts), ``launch.py``
  (``spawn``/``attach``), ``specs.py`` (probe-language lines placed on a process),
  ``listing.py`` (Appendix A's list), ``stacks.py`` (backtraces).
"""
