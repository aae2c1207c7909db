"""Profiling on local ranks: T(l) and memory per scheme (``profile.py``, ``profile_ranks.py``) and the
iteration terms measured through the real Trainer (``profile_iteration.py``). Runs the compiler and
the runtime; the planner only reads the tables they write."""
