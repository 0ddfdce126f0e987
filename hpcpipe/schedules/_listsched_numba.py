"""The compiled greedy behind `listsched.list_schedule` (imported only with numba).

The same event-driven simulation as the Python loop, statement for statement, so that both
give the same order and the same makespan bit for bit: the same float operations in the same
order, and a heap of (time, rank) pairs, whose pops do not depend on how the heap is kept
(equal pairs are interchangeable). The per-rank list of deferred Ws is an array, each row
appended at its tail and taken from its head (a rank defers at most one W per backward).
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

_F, _B, _W = 0, 1, 2


@njit(cache=True)
def greedy(
    p, m, stages_of, n_stages, rank_of, t_f, t_b, t_w, act, b_frees, comm, limit, depth,
    w_limit, up_first, late_f, reserve, second, flip_at, track, alts, order,
):  # fmt: skip  # pragma: no cover (JIT)
    """`list_schedule` for arrays: `stages_of[r, :n_stages[r]]` rank r's stages (first chunk
    first), `depth[r]`, `w_limit` (-1: none), `up_first`, `late_f` and `reserve` (the
    policy's), `flip_at[d]` the alternative taken at choice d (-1: the policy's), and
    `order[r, k]`, (kind, stage, microbatch) of rank r's k-th action, written. With `track`
    (or any flip), `alts[d]` receives the number of alternatives at choice d.
    Returns (complete, makespan, depth_bound, choices, the sum of the ranks' last ends)."""
    S = rank_of.size
    inf = np.inf
    f_in = np.full((S, m), inf)
    b_in = np.full((S, m), inf)
    f_in[0, :] = 0.0
    nf = np.zeros(S, dtype=np.int64)
    nb = np.zeros(S, dtype=np.int64)
    live = np.zeros(p)
    held = np.zeros(p, dtype=np.int64)
    waiting = np.zeros(p)
    owed_s = np.empty((p, 2 * m), dtype=np.int64)
    owed_i = np.empty((p, 2 * m), dtype=np.int64)
    owed_head = np.zeros(p, dtype=np.int64)
    owed_tail = np.zeros(p, dtype=np.int64)
    planned = np.zeros(p)
    left = np.empty(p, dtype=np.int64)
    done = np.zeros(p, dtype=np.int64)
    free = np.zeros(p)
    for r in range(p):
        left[r] = 3 * m * n_stages[r]
    heap = [(0.0, 0)]
    for r in range(1, p):
        heap.append((0.0, r))
    w_frees = 1.0 - b_frees
    makespan = 0.0
    depth_bound = False
    last = S - 1
    n_flips = flip_at.size
    track = track or n_flips > 0
    choices = 0
    c_kind = np.empty(2 * n_stages.max() + 1, dtype=np.int64)
    c_s = np.empty_like(c_kind)
    c_i = np.empty_like(c_kind)
    while len(heap):
        t, r = heapq.heappop(heap)
        if t != planned[r] or left[r] == 0:
            continue
        n_owed = owed_tail[r] - owed_head[r]
        k = n_stages[r]
        r0 = stages_of[r, 0]
        kind = -1
        s = 0
        i = 0
        if w_limit >= 0 and n_owed > w_limit:
            kind = _W
        else:
            for y in range(k):
                x = stages_of[r, k - 1 - y] if up_first else stages_of[r, y]
                j = nb[x]
                if j < m and b_in[x, j] <= t and (kind < 0 or (not up_first and j < i)):
                    kind, s, i = _B, x, j
            if late_f and kind == _B and s == r0 and k > 1:
                x = stages_of[r, 1]
                j = nf[x]
                if j < m and f_in[x, j] <= t and live[r] + act[x] <= limit:
                    kind, s, i = _F, x, j
            if kind < 0:
                live_r = live[r]
                for y in range(k):
                    x = stages_of[r, k - 1 - y]
                    j = nf[x]
                    if j >= m or f_in[x, j] > t or live_r + act[x] > limit:
                        continue
                    if x == r0:
                        room = reserve * second[r] if waiting[r] > 0.5 * act[x] else second[r]
                        if waiting[r] + act[x] + room > limit:
                            continue
                        if held[r] >= depth[r]:
                            depth_bound = True
                            continue
                    if kind < 0 or j < i:
                        kind, s, i = _F, x, j
            if kind < 0 and n_owed:
                kind = _W
        if track and kind >= 0:
            nc = 0
            for y in range(k):
                x = stages_of[r, y]
                j = nb[x]
                if j < m and b_in[x, j] <= t:
                    c_kind[nc], c_s[nc], c_i[nc] = _B, x, j
                    nc += 1
            for y in range(k):
                x = stages_of[r, k - 1 - y]
                j = nf[x]
                if j >= m or f_in[x, j] > t or live[r] + act[x] > limit:
                    continue
                if x == r0:
                    room = reserve * second[r] if waiting[r] > 0.5 * act[x] else second[r]
                    if waiting[r] + act[x] + room > limit or held[r] >= depth[r]:
                        continue
                c_kind[nc], c_s[nc], c_i[nc] = _F, x, j
                nc += 1
            if n_owed:
                c_kind[nc] = _W
                nc += 1
            if nc > 1:
                alts[choices] = nc - 1
                a = flip_at[choices] if choices < n_flips else -1
                choices += 1
                if 0 <= a < nc - 1:
                    for c in range(nc):
                        if c_kind[c] == kind and (kind == _W or (c_s[c] == s and c_i[c] == i)):
                            continue  # the policy's own choice
                        if a == 0:
                            kind, s, i = c_kind[c], c_s[c], c_i[c]
                            break
                        a -= 1
        if kind < 0:
            nxt = inf
            for y in range(k):
                x = stages_of[r, y]
                j = nb[x]
                if j < m:
                    a = b_in[x, j]
                    if t < a < nxt:
                        nxt = a
                j = nf[x]
                if j < m:
                    a = f_in[x, j]
                    if t < a < nxt:
                        nxt = a
            planned[r] = nxt
            if nxt < inf:
                heapq.heappush(heap, (nxt, r))
            continue
        left[r] -= 1
        if kind == _F:
            end = t + t_f[s]
            nf[s] += 1
            live[r] += act[s]
            if s == r0:
                held[r] += 1
                if k > 1:
                    waiting[r] += act[s]
            else:
                waiting[r] -= act[r0]
            if s == last:
                b_in[s, i] = end
            else:
                q = rank_of[s + 1]
                at = end if q == r else end + comm
                f_in[s + 1, i] = at
                if free[q] > at:
                    at = free[q]
                if at < planned[q]:
                    planned[q] = at
                    heapq.heappush(heap, (at, q))
        elif kind == _B:
            end = t + t_b[s]
            nb[s] += 1
            live[r] -= b_frees * act[s]
            owed_s[r, owed_tail[r]] = s
            owed_i[r, owed_tail[r]] = i
            owed_tail[r] += 1
            if s > 0:
                q = rank_of[s - 1]
                at = end if q == r else end + comm
                b_in[s - 1, i] = at
                if free[q] > at:
                    at = free[q]
                if at < planned[q]:
                    planned[q] = at
                    heapq.heappush(heap, (at, q))
        else:
            s = owed_s[r, owed_head[r]]
            i = owed_i[r, owed_head[r]]
            owed_head[r] += 1
            end = t + t_w[s]
            live[r] -= w_frees * act[s]
            if s == r0:
                held[r] -= 1
        order[r, done[r], 0] = kind
        order[r, done[r], 1] = s
        order[r, done[r], 2] = i
        done[r] += 1
        if end > makespan:
            makespan = end
        free[r] = end
        planned[r] = end
        heapq.heappush(heap, (end, r))
    return not left.any(), makespan, depth_bound, choices, free.sum()
