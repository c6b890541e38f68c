"""Fetch-args on a process: evaluated against a stopped thread, compiled into captures that a
detour makes, and a bad pointer read as ``(fault)``, never a fault of the program."""
