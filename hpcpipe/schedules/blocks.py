"""Building-block schedules on the V placement, compacted on a unit-time grid.

A controllable-memory schedule (Qi et al. 2024, "Pipeline Parallelism with Controllable
Memory") is one building block, the F and B of both chunks of a single microbatch on every
rank at fixed time offsets, repeated every 6 units (F, B, W of both chunks), with each W in the
first free slot after its B. The repetition alone leaves the warm-up and cool-down sparse.
Following the paper's construction, the repeated grid is compacted twice, then squeezed:

1. Every action, in time order, moves to the earliest free slot its inputs allow if that does
   not raise the rank's peak memory (F: +1 activation, W: -1). The steady state between a
   rank 0's first chunk-0 backward and the last forward keeps its block positions.
2. The Ws are taken out and the cool-down compacted again, each free slot now running one owed
   W; then the Ws go back into the first free slots (chunk-1 Ws first) and every action runs
   as soon as its inputs and its rank allow (unit costs).

Every number here is a slot on a grid of chunk-time units; a rank's memory counts chunk
activations. The result is an order: the simulator times it under any costs.

Rows hold one rank's action times per type: F0 (chunk-0 forward, stage r), F1 (chunk-1
forward, stage 2p-1-r), B1 (chunk-1 backward), B0 (chunk-0 backward), then the Ws (one row for
both chunks, or W1 and W0 when split).
"""

from __future__ import annotations

import numpy as np

import hpcpipe.schedules._compiled as _compiled
from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["compacted_v", "half_block", "min_block", "repeated_peak"]

F0, F1, B1, B0, W = range(5)
_DOWN = (F0, B1)  # flows from rank r-1 to rank r
_UP = (F1, B0)  # flows from rank r+1 to rank r
PERIOD = 6

Row = list[np.ndarray]


def half_block(p: int) -> np.ndarray:
    """V-Half's block (the paper's offsets): peak (p+2)//2 full-stage microbatches."""
    gap = 3 if p % 2 == 0 else 0
    i = np.arange(p)
    return np.stack([2 * i, 3 * p - i - 2, 3 * p + gap + 2 * i - 1, 6 * p + gap - i - 2], axis=1)


def min_block(p: int) -> np.ndarray:
    """V-Min's block (the paper's offsets): peak (p+4)//3 full-stage microbatches."""
    gap = 2 if p % 3 == 0 else 0
    i = np.arange(p)
    return np.stack([i, 2 * p - i - 1, 2 * p + gap + i, 4 * p + gap - i - 1], axis=1)


def _peak(row: Row) -> int:
    """Peak activations of one rank. With an explicit W row: F +1, W -1 in slot order.
    Without one, each free slot after a B runs one owed W (a unit-server queue: the Ws done by
    slot t are min over u <= t of arrivals(u) + free(t) - free(u))."""
    if len(row) > 4:
        times = np.concatenate(row)
        counts = [row[F0].size + row[F1].size, row[B1].size + row[B0].size]
        counts.append(times.size - sum(counts))
        delta = np.repeat(np.array([1, 0, -1], dtype=np.int64), counts)
        live = np.cumsum(delta[np.argsort(times, kind="stable")])
        return max(0, int(live.max()))
    bound = int(max(int(r.max()) for r in row)) + 1
    fwd = np.zeros(bound, dtype=np.int64)
    bwd = np.zeros(bound, dtype=np.int64)
    np.add.at(fwd, np.concatenate([row[F0], row[F1]]), 1)
    np.add.at(bwd, np.concatenate([row[B1], row[B0]]), 1)
    busy = np.zeros(bound, dtype=bool)
    for r in row:
        busy[r] = True
    free = np.cumsum(~busy)
    arrived = np.cumsum(bwd)
    done = free + np.minimum(np.minimum.accumulate(arrived - free), 0)
    return max(0, int((np.cumsum(fwd) - done).max()))


def repeated_peak(block: np.ndarray, m: int) -> int:
    """Peak chunk activations on the fullest rank of `block` (rows F0 F1 B1 B0 per rank)
    repeated m times, each W in the first free slot after its B. Its compaction keeps it
    (`compacted_v` moves an action only where the rank's peak does not rise; the family of
    `vfamily` is tested for equality with the simulator's peak), so a budget can pick blocks
    before any is built."""
    if _compiled.wanted(block.size * m):  # the search sizes up thousands of blocks at p = 64
        kernel = _compiled.kernel("_blocks_numba", "repeated_peak")
        if kernel is not None:
            return int(kernel(np.ascontiguousarray(block[:, :4], dtype=np.int64), m, PERIOD))
    reps = PERIOD * np.arange(m, dtype=np.int64)
    return max(_peak([block[r, typ] + reps for typ in range(4)]) for r in range(len(block)))


def _put_w(row: Row, split: bool) -> Row:
    """Ws into the first free slots after their Bs (split: a W row per chunk, chunk 1 first)."""
    times = np.concatenate(row[:4])
    kinds = np.repeat(np.arange(4), [r.size for r in row[:4]])
    order = np.argsort(times, kind="stable")
    events = list(zip(times[order].tolist(), kinds[order].tolist(), strict=True))
    out: list[list[int]] = [[], []]
    owed = [0, 0]
    t = j = 0
    n = len(events)
    while j < n or owed[0] or owed[1]:
        if j < n and events[j][0] <= t:
            kind = events[j][1]
            j += 1
            if kind == B1:
                owed[0] += 1
            elif kind == B0:
                owed[1 if split else 0] += 1
        else:
            for w in (0, 1):
                if owed[w]:
                    out[w].append(t)
                    owed[w] -= 1
                    break
        t += 1
    ws = [np.asarray(o, dtype=np.int64) for o in (out if split else out[:1])]
    return [r.copy() for r in row[:4]] + ws


def _eager(rows: list[Row]) -> list[Row]:
    """Run every action as soon as its inputs and its rank allow, in slot order (unit time)."""
    p = len(rows)
    ntypes = len(rows[0])
    keys = [
        (int(t), s, typ, mb)
        for s in range(p)
        for typ in range(ntypes)
        for mb, t in enumerate(rows[s][typ].tolist())
    ]
    keys.sort()
    start = [[np.empty_like(rows[s][typ]) for typ in range(ntypes)] for s in range(p)]
    end = [[[0] * rows[s][typ].size for typ in range(ntypes)] for s in range(p)]
    last = [0] * p
    for _, s, typ, mb in keys:
        t = last[s]
        if typ in _DOWN and s > 0:
            t = max(t, end[s - 1][typ][mb])
        if typ in _UP and s + 1 < p:
            t = max(t, end[s + 1][typ][mb])
        if 0 < typ < 4:
            t = max(t, end[s][typ - 1][mb])
        if mb > 0:
            t = max(t, end[s][typ][mb - 1])
        start[s][typ][mb] = t
        end[s][typ][mb] = last[s] = t + 1
    return start


def _compact(rows: list[Row], with_w: bool) -> list[Row]:
    """One compaction pass (step 1 with the Ws in place, step 2 without), then squeezed."""
    p = len(rows)
    if with_w:
        rows = [_put_w(r, split=False) for r in rows]
    else:
        rows = [[x.copy() for x in r[:4]] for r in rows]
    ntypes = len(rows[0])
    cap = max(_peak(r) for r in rows)
    m = rows[0][F0].size
    keys = sorted(
        (int(t), s, typ, mb)
        for s in range(p)
        for typ in range(ntypes)
        for mb, t in enumerate(rows[s][typ].tolist())
    )
    taken: list[set[int]] = [set() for _ in range(p)]
    phase = 0  # 0 warm-up, 1 steady state (kept), 2 cool-down
    for _, s, typ, mb in keys:
        row = rows[s]
        t = int(row[typ][mb])
        if phase == 0 and typ == B0 and s == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not with_w):
            if phase == 1 and typ == F0 and mb == m - 1:
                phase = 2
            taken[s].add(t)
            continue
        ready = -1
        if typ in _DOWN and s > 0:
            ready = max(ready, int(rows[s - 1][typ][mb]))
        if typ in _UP and s + 1 < p:
            ready = max(ready, int(rows[s + 1][typ][mb]))
        if 0 < typ < 4:
            ready = max(ready, int(row[typ - 1][mb]))
        if typ == W:
            ready = max(ready, int(np.sort(np.concatenate([row[B1], row[B0]]))[mb]))
        if mb > 0:
            ready = max(ready, int(row[typ][mb - 1]))
        for slot in range(ready + 1, t):
            if slot in taken[s]:
                continue
            row[typ][mb] = slot
            if _peak(row) <= cap:
                t = slot
                break
        row[typ][mb] = t
        taken[s].add(t)
    if not with_w:
        rows = [_put_w(r, split=False) for r in rows]
    return _eager(rows)


def _compacted_rows(p: int, m: int, block: np.ndarray) -> list[Row]:
    """Every rank's rows F0 F1 B1 B0 W1 W0 after both compactions."""
    if _compiled.wanted(6 * p * m, weight=4):  # ten blocks take half the search at p = 64
        kernel = _compiled.kernel("_blocks_numba", "compacted_rows")
        if kernel is not None:
            out = kernel(np.ascontiguousarray(block[:, :4], dtype=np.int64), m, PERIOD)
            return [list(out[r]) for r in range(p)]
    rows = [
        [block[r, typ] + PERIOD * np.arange(m, dtype=np.int64) for typ in range(4)]
        for r in range(p)
    ]
    rows = _compact(rows, with_w=True)
    rows = _compact([r[:4] for r in rows], with_w=False)
    return [_put_w(r[:4], split=True) for r in rows]


def compacted_v(name: str, p: int, m: int, block: np.ndarray, params=()) -> Schedule:
    """The block repeated for m microbatches, compacted (module docstring) into a Schedule."""
    rows = _compacted_rows(p, m, block)
    S = 2 * p
    per_rank = []
    for r in range(p):
        # row types F0 F1 B1 B0 W1 W0 -> (kind, stage)
        kind = np.repeat(
            np.array([Kind.F, Kind.F, Kind.B, Kind.B, Kind.W, Kind.W], dtype=np.int8),
            [x.size for x in rows[r]],
        )
        stage_of = np.array([r, S - 1 - r, S - 1 - r, r, S - 1 - r, r], dtype=np.int32)
        typ = np.repeat(np.arange(6), [x.size for x in rows[r]])
        mb = np.concatenate([np.arange(x.size) for x in rows[r]])
        times = np.concatenate(rows[r])
        order = np.lexsort((mb, typ, times))
        per_rank.append((kind[order], stage_of[typ[order]], mb[order]))
    return Schedule.from_arrays(
        name, [(r, S - 1 - r) for r in range(p)], m, per_rank, params=params
    )
