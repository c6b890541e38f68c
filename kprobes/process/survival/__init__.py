"""The program survives us: the trap guard, detach, cleanup at every way out, our pages
given back. (The rescue's tables are the engine's, which notes every patch in them first.)"""
