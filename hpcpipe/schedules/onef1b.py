"""1F1B (PipeDream-Flush, Narayanan et al. 2021): warm up, then one forward one backward.

Rank r runs min(p-1-r, m) forwards, then alternates F and fused BW, then drains the remaining
backwards. Same bubble as GPipe, (p-1)(T_F+T_B+T_W), but at most p-r microbatches live on rank r
(peak p on rank 0) instead of m.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._build import check_pm
from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["one_f_one_b", "one_f_one_b_rank"]


def one_f_one_b_rank(r: int, p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(kinds, microbatches) of rank r in 1F1B order."""
    warm = min(p - 1 - r, m)
    steady = m - warm
    kinds = np.empty(2 * m, dtype=np.int8)
    mbs = np.empty(2 * m, dtype=np.int64)
    kinds[:warm] = Kind.F
    mbs[:warm] = np.arange(warm)
    mid = slice(warm, warm + 2 * steady)
    kinds[mid][0::2] = Kind.F
    kinds[mid][1::2] = Kind.BW
    mbs[mid][0::2] = np.arange(warm, m)
    mbs[mid][1::2] = np.arange(steady)
    kinds[warm + 2 * steady :] = Kind.BW
    mbs[warm + 2 * steady :] = np.arange(steady, m)
    return kinds, mbs


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B for any p >= 1, m >= 1 (with m < p the warm-up is cut to m forwards)."""
    check_pm("1f1b", p, m)
    per_rank = []
    for r in range(p):
        kinds, mbs = one_f_one_b_rank(r, p, m)
        per_rank.append((kinds, np.full(kinds.size, r, dtype=np.int32), mbs))
    return Schedule.from_arrays(
        "1f1b", [(r,) for r in range(p)], m, per_rank, params=(("p", p), ("m", m))
    )
