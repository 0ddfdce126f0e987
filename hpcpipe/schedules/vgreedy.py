"""ZB-V-style greedy on the V placement under a memory cap (the construction of Qi et al.
2024, "Zero Bubble Pipeline Parallelism", for its V schedule, written for this IR).

Unlike the list scheduler, this greedy builds the order in phases, rank by rank, with each
action's time known as it is placed (uniform costs per chunk):

1. **Warm-up.** One chunk-0 forward on every rank; then, from the last rank up, each rank
   runs as many more chunk-0 forwards (together with every rank above it) as fit the cap and
   the time until its first chunk-1 forward can arrive, then that chunk-1 forward; then rank
   by rank the forwards are levelled so no rank holds fewer than the one above it.
2. **Steady state**, 2m rounds: every rank places its next backward (the chunk whose input
   is there, the up-going chunk first), then its next forward. Before each, owed Ws fill the
   wait for the input when they fit in it, and one more W goes in when the wait would make
   this rank's idle time exceed the worst rank's (the idle time is balanced across ranks).
3. **Cool-down**: the Ws still owed.

The build is repeated once with each rank allowed the idle time the first pass measured, and
over both choices of filling before backwards / forwards; the caller keeps the fastest. Memory
counts chunk activations (a forward +1, its W -1). Chunk 0 runs down the ranks (stage r), chunk
1 back up (stage 2p-1-r): forwards of chunk 0, then chunk 1; backwards of chunk 1 (down the
ranks, from the loss on rank 0), then chunk 0.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["v_greedy_orders"]

_F, _B, _W = 0, 1, 2
_PASSES = 8  # builds per variant while balancing the idle time keeps lowering the worst rank's


class _Build:
    """One pass of the greedy: per-rank clocks, counts, memory and owed Ws."""

    def __init__(self, p: int, m: int, cost: tuple[float, float, float], comm: float, cap: int):
        self.p, self.m, self.cost, self.comm, self.cap = p, m, cost, comm, cap
        self.end: dict[tuple[int, int, int, int], float] = {}  # (kind, chunk, rank, mb)
        self.clock = [0.0] * p
        self.count = [[0] * 6 for _ in range(p)]  # kind * 2 + chunk
        self.mem = [0] * p
        self.idle = [0.0] * p
        self.owed: list[deque[int]] = [deque() for _ in range(p)]  # chunk of each owed W
        self.order: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]

    def done(self, kind: int, chunk: int, rank: int, mb: int) -> float | None:
        return self.end.get((kind, chunk, rank, mb))

    def put(self, kind: int, chunk: int, r: int) -> None:
        mb = self.count[r][kind * 2 + chunk]
        if mb >= self.m:
            raise _Infeasible
        delta = 1 if kind == _F else (-1 if kind == _W else 0)
        if self.mem[r] + delta > self.cap:
            raise _Infeasible
        t = self.clock[r] + self.cost[kind]
        if kind != _W:
            src = r - 1 if chunk == 0 else r + 1  # chunk 0 flows down the ranks, chunk 1 up
            if 0 <= src < self.p:
                ready = self.done(kind, chunk, src, mb)
                if ready is None:
                    raise _Infeasible
                t = max(t, ready + self.comm + self.cost[kind])
        if self.count[r][0] > 0:
            self.idle[r] += t - (self.clock[r] + self.cost[kind])
        self.end[(kind, chunk, r, mb)] = t
        self.clock[r] = t
        self.mem[r] += delta
        self.order[r].append((kind, chunk, mb))
        if kind == _B:
            self.owed[r].append(chunk)
        self.count[r][kind * 2 + chunk] += 1

    def put_w(self, r: int) -> None:
        """The oldest owed W (its microbatch: the next W of that chunk, in B order)."""
        self.put(_W, self.owed[r].popleft(), r)


class _Infeasible(Exception):
    """The cap is too small for this construction."""


def _one_pass(
    p: int,
    m: int,
    cost: tuple[float, float, float],
    comm: float,
    cap: int,
    fill_f: bool,
    fill_b: bool,
    allowed: list[float] | None,
) -> _Build:
    g = _Build(p, m, cost, comm, cap)
    most_allowed = max(allowed) if allowed else 0.0

    def worst_idle(r: int) -> float:
        worst = max(g.idle)
        if allowed:
            worst = max(worst, most_allowed - allowed[r])
        return worst

    def fill(r: int, ready: float | None, always: bool) -> None:
        """Owed Ws into the wait for an input arriving at `ready`, then one more if the
        wait would push this rank's idle past the worst rank's."""
        if ready is None:
            return
        while g.owed[r] and ready + comm >= g.clock[r] + cost[_W]:
            g.put_w(r)
        if g.owed[r] and ready + comm - g.clock[r] > worst_idle(r) - g.idle[r] and always:
            g.put_w(r)

    # 1. warm-up
    for r in range(p):
        g.put(_F, 0, r)
    for r in range(p - 1, -1, -1):
        if r < p - 1:
            arrive = g.end[(_F, 1, r + 1, 0)] + comm
            while (
                g.mem[r] + 2 + 2 * r <= cap
                and g.clock[r] + cost[_F] <= arrive
                and g.count[r][0] < m
            ):
                for j in range(r + 1):
                    g.put(_F, 0, j)
        g.put(_F, 1, r)
    chunk = 0
    for r in range(1, p):
        while (
            g.count[r][0] + g.count[r][1] < g.count[r - 1][0] + g.count[r - 1][1]
            or g.count[r][1] <= g.count[r - 1][1] < m
        ):
            for j in range(p - 1, r - 1, -1):
                if g.count[j][chunk] < m:
                    g.put(_F, chunk, j)
            chunk = 1 - chunk
    # 2. steady state
    for _ in range(2 * m):
        down, up = [], []  # ranks whose next backward is chunk 0 (down) or chunk 1 (up)
        for r in range(p):
            if g.count[r][3] >= g.count[r][2]:
                down.append(r)
            elif (
                r == p - 1 or g.count[r][2] >= m or g.done(_B, 1, r + 1, g.count[r][3]) is not None
            ):
                up.append(r)
            else:
                down.append(r)
        for r, c in [(r, 1) for r in reversed(up)] + [(r, 0) for r in down]:
            src = r + 1 if c == 1 else r - 1
            mb = g.count[r][2 + c]
            ready = g.done(_B, c, src, mb) if 0 <= src < p else None
            fill(r, ready, c == 1 or fill_b)
            g.put(_B, c, r)
        for r in range(p):
            if g.count[r][1] >= m:
                continue
            item = None
            if g.count[r][1] >= g.count[r][0]:
                item = 0
            elif r == p - 1 or g.done(_F, 1, r + 1, g.count[r][1]) is not None:
                item = 1
            elif g.count[r][0] < m and (r == 0 or g.done(_F, 0, r - 1, g.count[r][0]) is not None):
                item = 0
            if item is None:
                continue
            while g.mem[r] + 1 > cap:
                if not g.owed[r]:
                    raise _Infeasible
                g.put_w(r)
            src = r - 1 if item == 0 else r + 1
            ready = g.done(_F, item, src, g.count[r][item]) if 0 <= src < p else None
            fill(r, ready, fill_f)
            g.put(_F, item, r)
    # 3. cool-down
    for r in range(p):
        while g.owed[r]:
            g.put_w(r)
    if any(sum(c) != 6 * m for c in g.count):
        raise _Infeasible
    return g


def v_greedy_orders(
    p: int, m: int, cap: int, cost: tuple[float, float, float] = (1.0, 1.0, 1.0), comm: float = 0.0
) -> list[Schedule]:
    """Every variant the greedy builds under `cap` chunk activations per rank (empty if the
    cap is too small for its warm-up), as Schedules on the V placement named "zb-v"."""
    out = []
    for fill_b in (True, False):
        for fill_f in (True, False):
            allowed: list[float] | None = None
            for _ in range(_PASSES):
                try:
                    g = _one_pass(p, m, cost, comm, cap, fill_f, fill_b, allowed)
                except _Infeasible:
                    break
                if allowed is not None and max(g.idle) >= max(allowed):
                    break  # the balancing stopped helping
                out.append(_schedule(g))
                allowed = list(g.idle)
    return out


def _schedule(g: _Build) -> Schedule:
    p = g.p
    per_rank = []
    for r, rows in enumerate(g.order):
        arr = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        kind, chunk, mb = arr[:, 0], arr[:, 1], arr[:, 2]
        # forwards: chunk 0 is stage r; backwards and Ws: chunk 1 (up) is stage r
        on_first = np.where(kind == _F, chunk == 0, chunk == 1)
        stage = np.where(on_first, r, 2 * p - 1 - r)
        kinds = np.array([Kind.F, Kind.B, Kind.W], dtype=np.int8)[kind]
        per_rank.append((kinds, stage.astype(np.int32), mb))
    return Schedule.from_arrays(
        "zb-v", [(r, 2 * p - 1 - r) for r in range(p)], g.m, per_rank, params=(("p", p), ("m", g.m))
    )
