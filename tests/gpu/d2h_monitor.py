"""Counting device-to-host conversions of real CuPy arrays (Python 3.12+, `sys.monitoring`).

CuPy's array type is a Cython class: its `get` cannot be patched and it has no hook for
copies. What can be seen is every call made from Python code: `sys.monitoring`'s CALL event
reports the callable and its first argument, so `float(a)`, `int(a)`, `bool(a)`, `str(a)`,
`a.get()`, `a.item()`, `a.tolist()` and `cupy.asnumpy(a)` with `a` a device array are counted
where our code (not CuPy's own, whose inner calls would count one copy twice) makes them.
Implicit conversions that make no call (`if a:`, f-string formatting) are not seen; the
fake-device tests on CPU count those too.

    with D2HMonitor(cupy.ndarray, cupy.asnumpy, library=cupy) as mon:
        trainer.step(0)
    mon.count, mon.sites
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

__all__ = ["D2HMonitor", "available"]

_CONVERSIONS = {float: "float", int: "int", bool: "bool", complex: "complex", str: "str"}
_METHODS = {"get", "item", "tolist"}


def available() -> str | None:
    """None when the monitor can run here, else why not."""
    if sys.version_info < (3, 12):
        return f"sys.monitoring needs Python 3.12+ (this is {sys.version.split()[0]})"
    return None


class D2HMonitor:
    """Counts host conversions of `array_type` instances called from code outside `library`."""

    def __init__(self, array_type: type, asnumpy: Any, library: Any = None):
        self.array_type = array_type
        self.asnumpy = asnumpy
        path = getattr(library, "__file__", None)
        self.library_dir = os.path.dirname(path) if path else None
        self.count = 0
        self.sites: Counter[str] = Counter()
        self._tool: int | None = None

    def reset(self) -> None:
        self.count = 0
        self.sites.clear()

    def _hit(self, code: Any, what: str) -> None:
        self.count += 1
        self.sites[f"{what} @ {os.path.basename(code.co_filename)}:{code.co_name}"] += 1

    def _on_call(self, code: Any, offset: int, fn: Any, arg0: Any) -> Any:
        if self.library_dir and code.co_filename.startswith(self.library_dir):
            return None  # CuPy's own calls: the outer call was already counted
        kind = self.array_type
        name = _CONVERSIONS.get(fn) if isinstance(fn, type) else None
        if name is not None:
            if isinstance(arg0, kind):
                self._hit(code, f"{name}()")
            return None
        if fn is self.asnumpy:
            if isinstance(arg0, kind):
                self._hit(code, "asnumpy")
            return None
        method = getattr(fn, "__name__", None)
        if method in _METHODS:
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, kind) or (owner is None and isinstance(arg0, kind)):
                self._hit(code, f".{method}()")
        return None

    def __enter__(self) -> D2HMonitor:
        why = available()
        if why:
            raise RuntimeError(why)
        mon = sys.monitoring  # type: ignore[attr-defined]
        for tool in (mon.PROFILER_ID, mon.OPTIMIZER_ID, 3, 4):
            try:
                mon.use_tool_id(tool, "hpcpipe-d2h-monitor")
            except ValueError:
                continue
            self._tool = tool
            break
        else:
            raise RuntimeError("no free sys.monitoring tool id")
        mon.register_callback(self._tool, mon.events.CALL, self._on_call)
        mon.set_events(self._tool, mon.events.CALL)
        return self

    def __exit__(self, *exc: Any) -> None:
        mon = sys.monitoring  # type: ignore[attr-defined]
        if self._tool is not None:
            mon.set_events(self._tool, 0)
            mon.register_callback(self._tool, mon.events.CALL, None)
            mon.free_tool_id(self._tool)
            self._tool = None
