"""List scheduling under a per-rank memory cap: the engine of the schedule search and of the
generators that have no closed form for small m (ZB-V and ZB-H2 with m < 2p-1).

An event-driven simulation in which a free rank starts the best of its ready actions (a B
first, then the oldest F that fits under the cap, deferred Ws last or once too many pend), on
one stage per rank or on the V placement (rank r holds stages r and 2p-1-r). A `Policy` sets
the choices where several actions can run.

Deadlock freedom: a rank admits a new microbatch (its first-chunk F) only if the first-chunk
activations of the microbatches still waiting for their second chunk, plus the new one and one
second chunk, fit under the cap. Then the oldest unfinished microbatch can always make progress
on every rank, so for any cap at or above one microbatch's activations on the fullest rank
(`Problem.floor`) the greedy completes (the policy knobs only reorder what is allowed).

The search runs this greedy thousands of times; once `_compiled` says the Python loop's cost
has added up, it runs the same loop compiled (`_listsched_numba`, with numba), which gives the
same run bit for bit and is about 10x faster (p = 16, m = 64: 0.6 ms a run, not 6.6).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

import hpcpipe.schedules._compiled as _compiled
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.simulate import CostModel

__all__ = [
    "CostsFor",
    "Policy",
    "Problem",
    "Run",
    "list_schedule",
    "run_to_schedule",
    "unit_costs",
    "unit_list_schedule",
]

CostsFor = Callable[[int], CostModel]
"""Number of stages -> the cost model of a schedule with that many stages (`cost_model`)."""

_F, _B, _W = int(Kind.F), int(Kind.B), int(Kind.W)
_INF = math.inf
REL = 1e-9  # relative tolerance of every memory and time comparison


def unit_costs(p: int) -> CostsFor:
    """F = B = W = 1 and one unit of activations per full stage (1/p of the model), each
    stage of an S-stage schedule its share: the costs the published figures assume."""
    return lambda stages: CostModel(
        t_f=p / stages, t_b=p / stages, t_w=p / stages, activation=p / stages
    )


@dataclass(frozen=True)
class Policy:
    """The greedy's choices where several actions can run.

    `w_limit`: once more than this many Ws are deferred on a rank, it runs the oldest before
    anything else (None: W only fills time when nothing else can run, or frees memory).
    `b_order` (V placement): when both of a rank's backwards are ready, "old" runs the older
    microbatch first, "up" the stage nearer the loss. `depth[r]`: the most microbatches rank r
    may hold at once (None: only the memory cap limits it). `late_f` (V placement): a ready
    forward of the second chunk (the stage nearer the loss) goes before a backward of the first:
    it carries its microbatch towards the loss, the longer remaining path (at p = 6, m = 6,
    budget 4, unit costs this reaches the optimum, 23.5, where V-Half takes 24). `reserve`
    (V placement): a first-chunk forward starts only while the rank keeps room for this many
    second chunks beside the microbatches already waiting for theirs. 1 is the least that can
    never deadlock; more keeps a warm-up shallow where memory is tight (p = 7, m = 7, budget
    3.5, unit costs: 3 reaches 32 where V-Min takes 32.5). An idle rank always keeps room
    for at least one. `flips`: (d, a) pairs, at the d-th choice (a rank free with more than one
    action allowed, counted over the run) take the a-th other allowed action, in the order
    backwards (the rank's stages in order), forwards (second chunk first), W; a choice the run
    no longer reaches, or an a beyond its alternatives, changes nothing. The search's descent
    over them reaches orders no rule does (p = 8, m = 8, unit costs, budget 5.5: one flip
    takes 32.5 to 31.5).
    """

    v_shape: bool
    w_limit: int | None = None
    b_order: str = "old"
    depth: tuple[int, ...] | None = None
    late_f: bool = False
    reserve: int = 1
    flips: tuple[tuple[int, int], ...] = ()

    def flip_array(self) -> np.ndarray:
        """`flips` as one entry per choice (-1: the policy's own)."""
        out = np.full(max((d for d, _ in self.flips), default=-1) + 1, -1, dtype=np.int64)
        for d, a in self.flips:
            out[d] = a
        return out

    def describe(self) -> str:
        parts = ["V placement" if self.v_shape else "one stage per rank"]
        parts.append("W deferred freely" if self.w_limit is None else f"W after {self.w_limit}")
        if self.v_shape:
            parts.append("older B first" if self.b_order == "old" else "B near the loss first")
            if self.late_f:
                parts.append("second-chunk F before first-chunk B")
            if self.reserve != 1:
                parts.append(f"room for {self.reserve} second chunks")
        if self.depth is not None:
            parts.append("depth " + ",".join(map(str, self.depth)))
        if self.flips:
            n = len(self.flips)
            parts.append(f"{n} choice{'s' if n > 1 else ''} changed")
        return "; ".join(parts)


@dataclass(frozen=True)
class Problem:
    """One placement's per-stage costs as plain lists: the greedy reads them per action."""

    p: int
    m: int
    v_shape: bool
    stages_of: tuple[tuple[int, ...], ...]
    rank_of: tuple[int, ...]
    dur: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]  # F, B, W per stage
    act: tuple[float, ...]
    b_frees: float
    comm: float
    costs: CostModel

    @classmethod
    def build(cls, p: int, m: int, costs_for: CostsFor, v_shape: bool) -> Problem:
        stages_of = tuple((r, 2 * p - 1 - r) if v_shape else (r,) for r in range(p))
        S = 2 * p if v_shape else p
        costs = costs_for(S)
        arr = costs.stage_arrays(S)
        rank_of = [0] * S
        for r, row in enumerate(stages_of):
            for s in row:
                rank_of[s] = r
        return cls(
            p=p,
            m=m,
            v_shape=v_shape,
            stages_of=stages_of,
            rank_of=tuple(rank_of),
            dur=(
                tuple(arr["t_f"].tolist()),
                tuple(arr["t_b"].tolist()),
                tuple(arr["t_w"].tolist()),
            ),
            act=tuple(arr["activation"].tolist()),
            b_frees=costs.b_frees,
            comm=costs.comm_time,
            costs=costs,
        )

    @property
    def floor(self) -> float:
        """Least possible peak: one microbatch's activations on the fullest rank."""
        return max(sum(self.act[s] for s in row) for row in self.stages_of)

    @cached_property
    def kernel_arrays(self) -> tuple[np.ndarray, ...]:
        """For the compiled greedy: stages_of (padded), stages per rank, rank_of, F, B, W
        durations and activations (built once: a search runs the greedy thousands of times)."""
        stages = np.zeros((self.p, 2), dtype=np.int64)
        counts = np.array([len(row) for row in self.stages_of], dtype=np.int64)
        for r, row in enumerate(self.stages_of):
            stages[r, : len(row)] = row
        floats = [np.asarray(x, dtype=np.float64) for x in (*self.dur, self.act)]
        return (stages, counts, np.asarray(self.rank_of, dtype=np.int64), *floats)

    @cached_property
    def second(self) -> np.ndarray:
        """Each rank's second-chunk activations, summed as the Python loop sums them."""
        return np.array([sum(self.act[x] for x in row[1:]) for row in self.stages_of], dtype=float)


@dataclass(frozen=True)
class Run:
    order: tuple[np.ndarray, ...]  # per rank: rows of (kind, stage, microbatch)
    makespan: float
    depth_bound: bool  # whether the depth limit ever refused a forward
    alts: np.ndarray | None = None  # tracked runs: the alternatives at each choice
    ends: float = 0.0  # the sum of the ranks' last ends (ties of makespan: less is better)


def list_schedule(prob: Problem, cap: float, policy: Policy, track: bool = False) -> Run | None:
    """Event-driven list scheduling under a per-rank memory cap (see the module docstring).

    A rank that becomes free looks at the next F and B of each of its stages (microbatches
    in order on a stage) and its deferred Ws, and starts one by `policy`; when nothing is
    ready it sleeps until its next input arrives. Returns None if the cap is below one
    microbatch's activations on some rank. With `track` (or any `policy.flips`) the run counts
    the alternatives at each choice (`Run.alts`), which the search's flip descent tries.
    """
    limit = cap + REL * max(1.0, abs(cap))
    if prob.floor > limit:
        return None
    depth = policy.depth or (prob.m,) * prob.p
    w_limit = -1 if policy.w_limit is None else policy.w_limit
    greedy = (
        _compiled.kernel("_listsched_numba", "greedy")
        if _compiled.wanted(3 * prob.m * len(prob.rank_of), weight=4)
        else None
    )
    flip_at = policy.flip_array()
    track = track or flip_at.size > 0
    if greedy is not None:
        return _compiled_run(prob, greedy, limit, depth, w_limit, policy, flip_at, track)
    p, m = prob.p, prob.m
    S = len(prob.rank_of)
    stages_of, rank_of, act = prob.stages_of, prob.rank_of, prob.act
    t_f, t_b, t_w = prob.dur
    comm, b_frees = prob.comm, prob.b_frees
    w_frees = 1.0 - b_frees
    up_first = policy.b_order == "up"
    late_f = policy.late_f
    reserve = policy.reserve
    b_rows = [row[::-1] if up_first else row for row in stages_of]
    f_rows = [row[::-1] for row in stages_of]  # the second chunk carries an older microbatch
    first = [row[0] for row in stages_of]
    f_in = [[_INF] * m for _ in range(S)]  # when each F's input arrives
    b_in = [[_INF] * m for _ in range(S)]
    f_in[0] = [0.0] * m
    nf = [0] * S  # next microbatch to run F (B) on each stage
    nb = [0] * S
    live = [0.0] * p
    held = [0] * p  # microbatches between their first F and first-stage W on the rank
    waiting = [0.0] * p  # first-chunk activations of microbatches not yet on their second chunk
    second = [sum(act[x] for x in row[1:]) for row in stages_of]
    two = [len(row) > 1 for row in stages_of]
    deferred: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]  # (stage, mb) owing W
    planned = [0.0] * p  # when each rank next looks for work
    left = [3 * m * len(row) for row in stages_of]
    order: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]
    heap = [(0.0, r) for r in range(p)]
    push, pop = heapq.heappush, heapq.heappop
    makespan = 0.0
    depth_bound = False
    last = S - 1
    free = [0.0] * p
    alts: list[int] = []
    while heap:
        t, r = pop(heap)
        if t != planned[r] or not left[r]:
            continue
        owed = deferred[r]
        kind = -1
        s = i = 0
        if w_limit >= 0 and len(owed) > w_limit:
            kind = _W
        else:
            for x in b_rows[r]:
                j = nb[x]
                if j < m and b_in[x][j] <= t and (kind < 0 or (not up_first and j < i)):
                    kind, s, i = _B, x, j
            if late_f and kind == _B and s == first[r] and two[r]:
                x = stages_of[r][1]
                j = nf[x]
                if j < m and f_in[x][j] <= t and live[r] + act[x] <= limit:
                    kind, s, i = _F, x, j
            if kind < 0:
                live_r = live[r]
                r0 = first[r]
                for x in f_rows[r]:
                    j = nf[x]
                    if j >= m or f_in[x][j] > t or live_r + act[x] > limit:
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
            if kind < 0 and owed:
                kind = _W
        if track and kind >= 0:  # the allowed actions, as the flips count them
            allowed = [(_B, x, nb[x]) for x in stages_of[r] if nb[x] < m and b_in[x][nb[x]] <= t]
            r0 = first[r]
            for x in f_rows[r]:
                j = nf[x]
                if j >= m or f_in[x][j] > t or live[r] + act[x] > limit:
                    continue
                if x == r0:
                    room = reserve * second[r] if waiting[r] > 0.5 * act[x] else second[r]
                    if waiting[r] + act[x] + room > limit or held[r] >= depth[r]:
                        continue
                allowed.append((_F, x, j))
            if owed:
                allowed.append((_W, 0, 0))
            if len(allowed) > 1:
                d = len(alts)
                alts.append(len(allowed) - 1)
                a = int(flip_at[d]) if d < flip_at.size else -1
                if 0 <= a < len(allowed) - 1:
                    own = (kind, s, i) if kind != _W else (_W, 0, 0)
                    kind, s, i = [c for c in allowed if c != own][a]
        if kind < 0:
            nxt = _INF
            for x in stages_of[r]:
                j = nb[x]
                if j < m:
                    a = b_in[x][j]
                    if t < a < nxt:
                        nxt = a
                j = nf[x]
                if j < m:
                    a = f_in[x][j]
                    if t < a < nxt:
                        nxt = a
            planned[r] = nxt
            if nxt < _INF:
                push(heap, (nxt, r))
            continue
        left[r] -= 1
        if kind == _F:
            order[r].append((_F, s, i))
            end = t + t_f[s]
            nf[s] += 1
            live[r] += act[s]
            if s == first[r]:
                held[r] += 1
                if two[r]:
                    waiting[r] += act[s]
            else:
                waiting[r] -= act[first[r]]
            if s == last:
                b_in[s][i] = end
            else:
                q = rank_of[s + 1]
                at = end if q == r else end + comm
                f_in[s + 1][i] = at
                if free[q] > at:
                    at = free[q]
                if at < planned[q]:
                    planned[q] = at
                    push(heap, (at, q))
        elif kind == _B:
            order[r].append((_B, s, i))
            end = t + t_b[s]
            nb[s] += 1
            live[r] -= b_frees * act[s]
            owed.append((s, i))
            if s > 0:
                q = rank_of[s - 1]
                at = end if q == r else end + comm
                b_in[s - 1][i] = at
                if free[q] > at:
                    at = free[q]
                if at < planned[q]:
                    planned[q] = at
                    push(heap, (at, q))
        else:
            s, i = owed.popleft()
            order[r].append((_W, s, i))
            end = t + t_w[s]
            live[r] -= w_frees * act[s]
            if s == first[r]:
                held[r] -= 1
        if end > makespan:
            makespan = end
        free[r] = planned[r] = end
        push(heap, (end, r))
    if any(left):  # unreachable for cap >= floor (see the module docstring); kept as a guard
        return None
    return Run(
        tuple(np.asarray(o, np.int64).reshape(-1, 3) for o in order),
        makespan,
        depth_bound,
        np.asarray(alts, dtype=np.int64) if track else None,
        sum(free),
    )


def _compiled_run(
    prob: Problem,
    greedy: Callable[..., tuple[bool, float, bool]],
    limit: float,
    depth: tuple[int, ...],
    w_limit: int,
    policy: Policy,
    flip_at: np.ndarray,
    track: bool,
) -> Run | None:
    """`list_schedule` by the compiled greedy (`_listsched_numba`), which gives the same run."""
    arrays = prob.kernel_arrays
    lengths = 3 * prob.m * arrays[1]
    order = np.empty((prob.p, int(lengths.max()), 3), dtype=np.int64)
    alts = np.empty(int(lengths.sum()) if track else 0, dtype=np.int64)
    complete, makespan, depth_bound, choices, ends = greedy(
        prob.p,
        prob.m,
        *arrays,
        prob.b_frees,
        prob.comm,
        limit,
        np.asarray(depth, dtype=np.int64),
        w_limit,
        policy.b_order == "up",
        policy.late_f,
        policy.reserve,
        prob.second,
        flip_at,
        track,
        alts,
        order,
    )
    if not complete:  # unreachable for cap >= floor, as in the Python loop
        return None
    return Run(
        tuple(order[r, :n] for r, n in enumerate(lengths)),
        makespan,
        bool(depth_bound),
        alts[:choices] if track else None,
        ends,
    )


def run_to_schedule(prob: Problem, run: Run, params: Iterable[tuple[str, object]]) -> Schedule:
    """The greedy's order as a Schedule named "auto" (the search renames what it returns)."""
    per_rank = [(rows[:, 0], rows[:, 1], rows[:, 2]) for rows in run.order]
    return Schedule.from_arrays("auto", prob.stages_of, prob.m, per_rank, params=params)


def unit_list_schedule(name: str, p: int, m: int, v_shape: bool, cap: float) -> Schedule:
    """The fastest greedy order under unit costs and a cap (full-stage microbatches), over the
    W-deferral and backward-order policies: the generators' schedule where no closed form
    reaches the bound (ZB-V and ZB-H2 with m < 2p-1)."""
    prob = Problem.build(p, m, unit_costs(p), v_shape)
    best: Run | None = None
    for w_limit in (None, 1, 2):
        for b_order in ("old", "up") if v_shape else ("old",):
            run = list_schedule(prob, cap, Policy(v_shape, w_limit, b_order))
            if run is not None and (best is None or run.makespan < best.makespan - REL):
                best = run
    if best is None:
        raise ValueError(f"{name}: a cap of {cap:g} microbatches is below one microbatch")
    return Schedule.from_arrays(
        name,
        prob.stages_of,
        m,
        [(rows[:, 0], rows[:, 1], rows[:, 2]) for rows in best.order],
        params=(("p", p), ("m", m)),
    )
