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
        peak = max(peak, _queue_peak(fwd, bwd, busy, bound))
    return peak


@njit(cache=True)
def _queue_peak(fwd, bwd, busy, bound):  # pragma: no cover
    """Most activations held over slots 0..bound-1: F +1 each, and each free slot after a B
    runs one owed W (-1)."""
    peak = 0
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


# Row types of `blocks`: F0 F1 B1 B0 (t4[rank, type, microbatch]), then the Ws (w[rank, :]);
# the even ones (F0, B1) flow from rank r-1 to rank r, the odd ones from rank r+1.
_F0, _F1, _B1, _B0, _W = 0, 1, 2, 3, 4


@njit(cache=True)
def _put_w(t4, s, split, out):  # pragma: no cover
    """`blocks._put_w` of rank s into `out` (2m slots; split: W1 then W0, m each)."""
    m = t4.shape[2]
    n = 4 * m
    times = np.empty(n, dtype=np.int64)
    kinds = np.empty(n, dtype=np.int64)
    for typ in range(4):
        for j in range(m):
            times[typ * m + j] = t4[s, typ, j]
            kinds[typ * m + j] = typ
    order = np.argsort(times, kind="mergesort")
    owed0 = 0
    owed1 = 0
    n0 = 0
    n1 = 0
    t = 0
    j = 0
    while j < n or owed0 > 0 or owed1 > 0:
        if j < n and times[order[j]] <= t:
            kind = kinds[order[j]]
            j += 1
            if kind == _B1:
                owed0 += 1
            elif kind == _B0:
                if split:
                    owed1 += 1
                else:
                    owed0 += 1
        elif owed0 > 0:
            out[n0] = t
            n0 += 1
            owed0 -= 1
        elif owed1 > 0:
            out[m + n1] = t
            n1 += 1
            owed1 -= 1
        t += 1


@njit(cache=True)
def _time(t4, w, s, typ, mb):  # pragma: no cover
    return t4[s, typ, mb] if typ < 4 else w[s, mb]


@njit(cache=True)
def _sorted_keys(t4, w, ntypes):  # pragma: no cover
    """(slot, rank, type, microbatch) of every action in that order, as four arrays."""
    p, _, m = t4.shape
    n = p * (4 * m + (2 * m if ntypes > 4 else 0))
    lo = t4.min()
    if ntypes > 4:
        lo = min(lo, w.min())
    key = np.empty(n, dtype=np.int64)
    ks = np.empty(n, dtype=np.int64)
    ktyp = np.empty(n, dtype=np.int64)
    kmb = np.empty(n, dtype=np.int64)
    i = 0
    for s in range(p):
        for typ in range(ntypes):
            count = m if typ < 4 else 2 * m
            for mb in range(count):
                t = _time(t4, w, s, typ, mb) - lo
                key[i] = ((t * p + s) * 5 + typ) * (2 * m) + mb
                ks[i] = s
                ktyp[i] = typ
                kmb[i] = mb
                i += 1
    order = np.argsort(key)
    return ks[order], ktyp[order], kmb[order]


@njit(cache=True)
def _eager(t4, w):  # pragma: no cover
    """`blocks._eager` of the rows with their (unsplit) W row."""
    p = t4.shape[0]
    ks, ktyp, kmb = _sorted_keys(t4, w, 5)
    s4 = np.empty_like(t4)
    sw = np.empty_like(w)
    e4 = np.zeros_like(t4)
    ew = np.zeros_like(w)
    last = np.zeros(p, dtype=np.int64)
    for i in range(ks.size):
        s, typ, mb = ks[i], ktyp[i], kmb[i]
        t = last[s]
        if typ < 4:
            if typ % 2 == 0 and s > 0:
                t = max(t, e4[s - 1, typ, mb])
            if typ % 2 == 1 and s + 1 < p:
                t = max(t, e4[s + 1, typ, mb])
            if typ > 0:
                t = max(t, e4[s, typ - 1, mb])
            if mb > 0:
                t = max(t, e4[s, typ, mb - 1])
            s4[s, typ, mb] = t
            e4[s, typ, mb] = t + 1
        else:
            if mb > 0:
                t = max(t, ew[s, mb - 1])
            sw[s, mb] = t
            ew[s, mb] = t + 1
        last[s] = t + 1
    return s4, sw


@njit(cache=True)
def _row_peak(t4, w, s, with_w, up, down, busy):  # pragma: no cover
    """`blocks._peak` of rank s (`up`, `down`, `busy`: scratch, one entry per slot)."""
    m = t4.shape[2]
    top = 0
    for typ in range(4):
        for j in range(m):
            top = max(top, t4[s, typ, j])
    if with_w:
        for j in range(2 * m):
            top = max(top, w[s, j])
    bound = top + 1
    up[:bound] = 0
    down[:bound] = 0
    busy[:bound] = False
    for typ in range(4):
        for j in range(m):
            t = t4[s, typ, j]
            busy[t] = True
            if typ < 2:
                up[t] += 1
            elif not with_w:
                down[t] += 1
    peak = 0
    if with_w:  # F +1, W -1, a slot's Fs before its Ws
        for j in range(2 * m):
            down[w[s, j]] += 1
        live = 0
        for t in range(bound):
            live += up[t]
            peak = max(peak, live)
            live -= down[t]
        return peak
    return _queue_peak(up, down, busy, bound)


@njit(cache=True)
def _compact(t4, with_w):  # pragma: no cover
    """`blocks._compact`: one pass over the rows F0 F1 B1 B0, then squeezed (returns the
    rows and their unsplit W row)."""
    p, _, m = t4.shape
    t4 = t4.copy()
    w = np.zeros((p, 2 * m), dtype=np.int64)
    if with_w:
        for s in range(p):
            _put_w(t4, s, False, w[s])
    ntypes = 5 if with_w else 4
    bound = t4.max() + 1
    if with_w:
        bound = max(bound, w.max() + 1)
    up = np.zeros(bound, dtype=np.int64)
    down = np.zeros(bound, dtype=np.int64)
    busy = np.zeros(bound, dtype=np.bool_)
    cap = 0
    for s in range(p):
        cap = max(cap, _row_peak(t4, w, s, with_w, up, down, busy))
    ks, ktyp, kmb = _sorted_keys(t4, w, ntypes)
    taken = np.zeros((p, bound), dtype=np.bool_)
    bs = np.empty(2 * m, dtype=np.int64)
    phase = 0  # 0 warm-up, 1 steady state (kept), 2 cool-down
    for i in range(ks.size):
        s, typ, mb = ks[i], ktyp[i], kmb[i]
        t = _time(t4, w, s, typ, mb)
        if phase == 0 and typ == _B0 and s == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not with_w):
            if phase == 1 and typ == _F0 and mb == m - 1:
                phase = 2
            taken[s, t] = True
            continue
        ready = -1
        if typ < 4 and typ % 2 == 0 and s > 0:
            ready = max(ready, t4[s - 1, typ, mb])
        if typ % 2 == 1 and s + 1 < p:
            ready = max(ready, t4[s + 1, typ, mb])
        if 0 < typ < 4:
            ready = max(ready, t4[s, typ - 1, mb])
        if typ == _W:
            bs[:m] = t4[s, _B1]
            bs[m:] = t4[s, _B0]
            ready = max(ready, np.sort(bs)[mb])
        if mb > 0:
            ready = max(ready, _time(t4, w, s, typ, mb - 1))
        for slot in range(ready + 1, t):
            if taken[s, slot]:
                continue
            if typ < 4:
                t4[s, typ, mb] = slot
            else:
                w[s, mb] = slot
            if _row_peak(t4, w, s, with_w, up, down, busy) <= cap:
                t = slot
                break
        if typ < 4:
            t4[s, typ, mb] = t
        else:
            w[s, mb] = t
        taken[s, t] = True
    if not with_w:
        for s in range(p):
            _put_w(t4, s, False, w[s])
    return _eager(t4, w)


@njit(cache=True)
def compacted_rows(block, m, period):  # pragma: no cover
    """`blocks.compacted_v`'s rows: F0 F1 B1 B0 W1 W0 of every rank, [rank, type, mb]."""
    p = block.shape[0]
    t4 = np.empty((p, 4, m), dtype=np.int64)
    for s in range(p):
        for typ in range(4):
            for k in range(m):
                t4[s, typ, k] = block[s, typ] + period * k
    t4, _ = _compact(t4, True)
    t4, _ = _compact(t4, False)
    out = np.empty((p, 6, m), dtype=np.int64)
    w = np.empty(2 * m, dtype=np.int64)
    for s in range(p):
        _put_w(t4, s, True, w)
        out[s, :4] = t4[s]
        out[s, 4] = w[:m]
        out[s, 5] = w[m:]
    return out
