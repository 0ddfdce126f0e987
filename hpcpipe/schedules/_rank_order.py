"""Timing of a fixed per-rank order: each action starts once its rank is free and its inputs
are there. The simulator and the lowering's unit-time run both need it.

The answer is a longest path (start = max(previous end on the rank, input end + transfer)),
so any order of evaluation that respects the dependencies gives it bit for bit. The NumPy
path advances every rank by one action per round: about m x (stages per rank) x 3 rounds of
vector calls, which at p = 1024, m = 4096 is ~28,000 rounds over 1,024-entry gathers from
59-million-entry arrays. Above `_compiled.COMPILED_ACTIONS` a compiled worklist (numba, when
installed) visits each action once instead: a rank runs until an input is missing, parks on
the action that produces it, and is woken when that action ends. Below it the NumPy path is
cheaper than importing numba.
"""

from __future__ import annotations

import numpy as np

import hpcpipe.schedules._compiled as _compiled

__all__ = ["run_in_rank_order"]


def run_in_rank_order(
    offsets: np.ndarray,
    dep: np.ndarray,
    dep2: np.ndarray | None,
    dur: np.ndarray | None,
    delay: np.ndarray | None,
    delay2: np.ndarray | None,
    compiled: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Start and end of every action (`end[n]` is the "no input" sentinel, 0), and, on a
    dependency cycle, the actions the stuck ranks wait at (None when none is stuck).

    `dep[a]`, `dep2[a]`: the actions whose ends `a` waits for (`n`: none), plus `delay[a]`,
    `delay2[a]`; `dur` None: every action lasts 1 and no transfer takes time. `compiled`:
    force a path (None: by size and whether numba is there).
    """
    n = dep.size
    if compiled is None:
        compiled = _compiled.wanted(n)
    kernel = _compiled.kernel("_rank_order_numba", "worklist") if compiled else None
    if kernel is not None:
        start = np.empty(n)
        end = np.empty(n + 1)
        ptr = np.ascontiguousarray(offsets[:-1], dtype=np.int64).copy()
        stop = np.ascontiguousarray(offsets[1:], dtype=np.int64)
        has2 = dep2 is not None
        unit = dur is None
        none = np.zeros(1)
        if has2 and delay2 is None and not unit:
            delay2 = np.zeros(n)

        def floats(x: np.ndarray | None) -> np.ndarray:
            return none if unit or x is None else np.ascontiguousarray(x, dtype=np.float64)

        kernel(
            ptr,
            stop,
            np.ascontiguousarray(dep),
            np.ascontiguousarray(dep2 if has2 else dep),
            has2,
            unit,
            floats(dur),
            floats(delay),
            floats(delay2),
            start,
            end,
        )
        stuck = ptr < stop
        return start, end, (ptr[stuck] if stuck.any() else None)
    if dur is None:
        dur, delay, delay2 = np.ones(n), np.zeros(n), None
    assert delay is not None
    return _rounds(offsets, dep, dep2, dur, delay, delay2)


def _rounds(
    offsets: np.ndarray,
    dep: np.ndarray,
    dep2: np.ndarray | None,
    dur: np.ndarray,
    delay: np.ndarray,
    delay2: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One action per rank and round, vectorised over the ranks."""
    n = dep.size
    if dep2 is not None and delay2 is None:
        delay2 = np.zeros(n)
    start = np.empty(n)
    end = np.full(n + 1, np.inf)
    end[n] = 0.0
    ptr = offsets[:-1].copy()
    stop = offsets[1:]
    free = np.zeros(offsets.size - 1)
    act = np.flatnonzero(ptr < stop)
    while act.size:
        a = ptr[act]
        ready = end[dep[a]] + delay[a]  # when the input is there
        if dep2 is not None:
            assert delay2 is not None
            np.maximum(ready, end[dep2[a]] + delay2[a], out=ready)
        ok = ready != np.inf
        if not ok.all():
            if not ok.any():
                return start, end, a
            act_ok, a, ready = act[ok], a[ok], ready[ok]
        else:
            act_ok = act
        st = np.maximum(free[act_ok], ready)
        en = st + dur[a]
        start[a] = st
        end[a] = en
        free[act_ok] = en
        ptr[act_ok] += 1
        act = act[ptr[act] < stop[act]]
    return start, end, None
