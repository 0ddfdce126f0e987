"""When the planning passes switch to their numba kernels, and loading those kernels.

Above `COMPILED_ACTIONS` compute actions a pass runs its compiled kernel; below it the NumPy
path is cheaper than importing numba (about a second). Many small passes add up the same way:
the schedule search simulates thousands of schedules of a few thousand actions, so once this
process has run `COMPILED_ACTIONS` actions through NumPy paths every later pass takes its kernel
(the rent-or-buy rule: at most the kernels' load is spent in NumPy first; at p = 16, m = 64
the search became 2.3x faster). numba is optional: without it every pass takes its NumPy path,
which gives the same answers.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["COMPILED_ACTIONS", "kernel", "wanted"]

COMPILED_ACTIONS = 1 << 20
"""Schedules with at least this many compute actions are planned by the compiled kernels."""


_numpy_actions = 0
"""Compute actions this process has passed through NumPy paths so far."""


def wanted(n: int, weight: int = 1) -> bool:
    """Whether a pass over `n` compute actions should take its compiled kernel. `weight`: the
    pass's cost per action in units of a vectorised NumPy pass's (a plain Python loop: 4)."""
    global _numpy_actions
    if n * weight >= COMPILED_ACTIONS or _numpy_actions >= COMPILED_ACTIONS:
        return True
    _numpy_actions += n * weight
    return False


@cache
def kernel(module: str, name: str) -> Callable[..., Any] | None:
    """`hpcpipe.schedules.<module>.<name>`, compiled on first use (or loaded from numba's
    cache); None when numba is not installed."""
    if importlib.util.find_spec("numba") is None:
        return None
    return getattr(importlib.import_module(f"hpcpipe.schedules.{module}"), name)
