"""Following the program: probes pending until their file is mapped, the loader's rendezvous,
exec, and followed children that exec (members of the family)."""
