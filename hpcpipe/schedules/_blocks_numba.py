"""The compiled W queue behind `blocks.repeated_peak` (imported only with numba)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def repeated_peak(block, m, period):  # pragma: no cover
    """`blocks._peak` of every rank of `block` (rows F0 F1 B1 B0) repeated `m` times, one
    slot at a time; the largest."""
    ranks = block.shape[0]
    bound = 0
    for r in range(ranks):
        for typ in range(4):
            bound = max(bound, block[r, typ] + period * (m - 1) + 1)
    fwd = np.zeros(bound, dtype=np.int64)
    bwd = np.zeros(bound, dtype=np.int64)
    busy = np.zeros(bound, dtype=np.bool_)
    peak = 0
    for r in range(ranks):
        fwd[:] = 0
        bwd[:] = 0
        busy[:] = False
        for k in range(m):
            for typ in range(4):
                t = block[r, typ] + period * k
                busy[t] = True
                if typ < 2:  # F0, F1
                    fwd[t] += 1
                else:  # B1, B0
                    bwd[t] += 1
        free = 0
        arrived = 0
        started = 0
        lowest = 0  # min over slots so far of (Bs arrived - free slots), at most 0
        for t in range(bound):
            if not busy[t]:
                free += 1
            arrived += bwd[t]
            started += fwd[t]
            lowest = min(lowest, arrived - free)
            peak = max(peak, started - (free + lowest))
    return peak
