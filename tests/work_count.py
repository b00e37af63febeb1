"""Python lines a call executes: a deterministic measure of an algorithm's work.

Tests that guard complexity compare these counts at two sizes instead of timing
one run (a clock measures the machine's load as much as the code). Work done
inside C (a list's ``index``, numpy) is not counted.
"""
from __future__ import annotations

import sys


def lines_run(fn, *args, **kwargs):
    """(``fn(*args, **kwargs)``, the number of Python lines it executed)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.settrace(previous)
    return result, count


def growth(call_of_size, small: int, large: int) -> float:
    """How much faster than the size the work grows: (lines at ``large`` / lines at ``small``) /
    (``large`` / ``small``); about 1 for linear work, ``large / small`` for quadratic.
    ``call_of_size(n)`` builds the input of size ``n`` (not counted) and returns the call to count."""
    _, lines_small = lines_run(call_of_size(small))
    _, lines_large = lines_run(call_of_size(large))
    return (lines_large / lines_small) / (large / small)
