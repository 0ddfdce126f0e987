"""The compiled worklist behind `_rank_order.run_in_rank_order` (imported only with numba)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def worklist(ptr, stop, dep, dep2, has2, unit, dur, delay, delay2, start, end):  # pragma: no cover
    """Advance each rank until an input is missing; park it on the producer (one waiting rank
    list per action, linked through `next_waiting`); wake it when the producer ends. Each
    action is timed once; on a cycle the stuck ranks keep `ptr` at the action they wait at.
    `unit`: every action lasts 1 and every transfer 0 (`dur` and the delays are not read).
    """
    n = dep.size
    p = ptr.size
    end[:n] = np.inf  # not run yet
    end[n] = 0.0
    head = np.full(n + 1, -1, dtype=np.int32)  # first rank waiting for each action
    next_waiting = np.full(p, -1, dtype=np.int32)
    free = np.zeros(p)
    ready_ranks = np.empty(p, dtype=np.int64)
    top = 0
    for r in range(p - 1, -1, -1):
        if ptr[r] < stop[r]:
            ready_ranks[top] = r
            top += 1
    while top:
        top -= 1
        r = ready_ranks[top]
        k = ptr[r]
        last = stop[r]
        t_free = free[r]
        while k < last:
            d = dep[k]
            if end[d] == np.inf:
                next_waiting[r] = head[d]
                head[d] = r
                break
            ready = end[d] if unit else end[d] + delay[k]
            if has2:
                d2 = dep2[k]
                if end[d2] == np.inf:
                    next_waiting[r] = head[d2]
                    head[d2] = r
                    break
                ready2 = end[d2] if unit else end[d2] + delay2[k]
                if ready2 > ready:
                    ready = ready2
            st = t_free if t_free > ready else ready
            t_free = st + (1.0 if unit else dur[k])
            start[k] = st
            end[k] = t_free
            w = head[k]
            while w >= 0:
                ready_ranks[top] = w
                top += 1
                nxt = next_waiting[w]
                next_waiting[w] = -1
                w = nxt
            head[k] = -1
            k += 1
        ptr[r] = k
        free[r] = t_free
