"""When the planning passes switch to their numba kernels, and loading those kernels.

Above `COMPILED_ACTIONS` compute actions a pass runs its compiled kernel; below it the NumPy
path is cheaper than importing numba (about a second). numba is optional: without it every
pass takes its NumPy path, which gives the same answers.
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


def wanted(n: int) -> bool:
    """Whether a pass over `n` compute actions should take its compiled kernel."""
    return n >= COMPILED_ACTIONS


@cache
def kernel(module: str, name: str) -> Callable[..., Any] | None:
    """`hpcpipe.schedules.<module>.<name>`, compiled on first use (or loaded from numba's
    cache); None when numba is not installed."""
    if importlib.util.find_spec("numba") is None:
        return None
    return getattr(importlib.import_module(f"hpcpipe.schedules.{module}"), name)
