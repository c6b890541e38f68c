"""Making the program run code for us: a syscall or a function call in a stopped thread, the
program's own mmaps and ifunc resolvers, and the one injection whose thread goes home by itself."""
