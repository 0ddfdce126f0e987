"""The compiled placement behind `lower.lower_with_times` (imported only with numba)."""

from __future__ import annotations

import numpy as np
from numba import njit

from hpcpipe.schedules.ir import Kind

_F, _W = int(Kind.F), int(Kind.W)
_SEND_F, _RECV_F, _SEND_B, _RECV_B = (int(k) for k in Kind if k >= Kind.SEND_F)


@njit(cache=True)
def place(kind, stage, mb, rank, cross, rank_of, offsets, pair_first, n_pairs):  # pragma: no cover
    """One pass over the compute actions in rank order, writing the lowered arrays: a RECV
    right before each action whose input comes from another rank, a SEND right after each one
    whose result goes to another rank; a pair (`pair_first[a]`: `a` is an F half) gets both
    halves' RECVs before it and both SENDs after it, each in the halves' order.

    Returns (kinds, stages, microbatches, lowered offsets, lowered position of each pair's F
    half, lowered position of each compute action). `offsets`: the compute actions' per-rank
    ranges.
    """
    n = kind.size
    p = offsets.size - 1
    last = rank_of.size - 1
    send = np.zeros(n, dtype=np.bool_)
    total = n
    for a in range(n):
        k = kind[a]
        s = stage[a]
        to = -1
        if k == _F:
            if s < last:
                to = rank_of[s + 1]
        elif k != _W and s > 0:  # a B or BW
            to = rank_of[s - 1]
        if to >= 0 and to != rank[a]:
            send[a] = True
            total += 1
        if cross[a]:
            total += 1
    kinds = np.empty(total, dtype=np.int8)
    stages = np.empty(total, dtype=np.int32)
    mbs = np.empty(total, dtype=np.int32)
    out_offsets = np.zeros(p + 1, dtype=np.int64)
    pairs = np.empty(n_pairs, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    w = 0
    j = 0
    for r in range(p):
        a = offsets[r]
        while a < offsets[r + 1]:
            group = 2 if pair_first[a] else 1
            for h in range(a, a + group):
                if cross[h]:
                    kinds[w] = _RECV_F if kind[h] == _F else _RECV_B  # by the consumer's kind
                    stages[w] = stage[h]
                    mbs[w] = mb[h]
                    w += 1
            if group == 2:
                pairs[j] = w
                j += 1
            for h in range(a, a + group):
                pos[h] = w
                kinds[w] = kind[h]
                stages[w] = stage[h]
                mbs[w] = mb[h]
                w += 1
            for h in range(a, a + group):
                if send[h]:
                    kinds[w] = _SEND_F if kind[h] == _F else _SEND_B
                    stages[w] = stage[h]
                    mbs[w] = mb[h]
                    w += 1
            a += group
        out_offsets[r + 1] = w
    return kinds, stages, mbs, out_offsets, pairs, pos
