"""The program survives us: the rescue that finishes a hit if the tool dies, the trap guard,
the shield from other tools' uprobes, detach, cleanup at every way out, our pages given back."""
