"""The compiled structure check behind `_table.compute_table` (imported only with numba)."""

from __future__ import annotations

import numpy as np
from numba import njit

from hpcpipe.schedules.ir import Kind

_F, _B, _W, _BW = int(Kind.F), int(Kind.B), int(Kind.W), int(Kind.BW)


@njit(cache=True)
def dependencies(kind, stage, mb, rank, rank_of, m, f_at, b_at, dep, cross):  # pragma: no cover
    """Fill `f_at`, `b_at`, `dep` and `cross` (see `ComputeTable`) of an unlowered schedule and
    check its structure, in three passes: count each (stage, microbatch, kind), then find
    every action's dependency, then check the same-rank order. False at the first problem,
    without saying what: the NumPy path then finds and reports it.
    """
    n = kind.size
    S = rank_of.size
    count = np.zeros(4 * S * m, dtype=np.uint8)
    for a in range(n):
        s = stage[a]
        if rank_of[s] != rank[a]:
            return False  # a stage on another rank
        key = s * m + mb[a]
        k = kind[a]
        code = key * 4 + k
        if count[code]:
            return False  # a duplicate
        count[code] = 1
        if k == _F:
            f_at[key] = a
        elif k != _W:
            b_at[key] = a
    for key in range(S * m):
        c = count[key * 4 : key * 4 + 4]
        if not c[_F] or c[_B] == c[_BW] or c[_W] != c[_B]:
            return False  # a missing or surplus F, B, W or BW
    last = S - 1
    for a in range(n):
        s = stage[a]
        key = s * m + mb[a]
        k = kind[a]
        if k == _F:
            d = n if s == 0 else f_at[key - m]
        elif k == _W:
            d = b_at[key]
        else:
            if f_at[key] > a:
                return False  # a backward before its own forward
            d = f_at[key] if s == last else b_at[key + m]
        dep[a] = d
        if d < n:
            crosses = rank[d] != rank[a]
            cross[a] = crosses
            if not crosses and d > a:
                return False  # a same-rank dependency later on the rank
        else:
            cross[a] = False
    return True
