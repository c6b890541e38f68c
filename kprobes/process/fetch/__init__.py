"""Fetch-args on a process: the tree walked once (``tree.py``), lowered into closures that
evaluate it against a stopped thread (``evaluate.py``) or into the captures a detour makes
(``fast.py``, evaluated later by the same closures), and a bad pointer read as ``(fault)``,
never a fault of the program (``faults.py``)."""
