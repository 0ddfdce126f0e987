"""Schedule search: the fastest schedule that fits a per-rank activation memory budget.

Each fixed schedule sits at one point of the time/memory trade-off and was designed for even
stages and free communication. The search builds schedules for the deck's own costs instead:

1. **Greedy list scheduling under a memory cap.** An event-driven simulation in which a free
   rank starts the best of its ready actions (a B first, then the oldest F that fits under the
   cap, deferred Ws last or once too many pend). It runs on both placements, one stage per
   rank and the V shape (rank r holds stages r and 2p-1-r), for a grid of policies: how long
   W may be deferred, which of a V rank's two backwards goes first, and the warm-up depth
   (the most microbatches a rank may hold at once).
2. **Local improvement.** From the best few policies, coordinate descent on each rank's own
   warm-up depth and on the W deferral, keeping a change only when the makespan drops.
3. **Seeds.** Every fixed schedule that fits the budget joins the pool, so the result is never
   slower than the best of them under the same costs.

The fastest candidate wins (ties: the lower peak). Every candidate is re-simulated with
`simulate`, so the makespan and peak memory reported are the simulator's, and the winner is
validated. The search is deterministic: every rank of a run computes the same schedule.

Deadlock freedom of the greedy: a rank admits a new microbatch (its first-chunk F) only if
the first-chunk activations of the microbatches still waiting for their second chunk, plus
the new one and one second chunk, fit under the cap. Then the oldest unfinished microbatch
can always make progress on every rank, so for any cap at or above `min_budget` the greedy
completes (the policy knobs only reorder what is allowed).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.registry import SCHEDULE_NAMES, build_schedule
from hpcpipe.schedules.simulate import CostModel, simulate
from hpcpipe.schedules.validate import validate

__all__ = [
    "BudgetError",
    "CostsFor",
    "Found",
    "Policy",
    "fixed_points",
    "min_budget",
    "pareto_front",
    "search",
]

CostsFor = Callable[[int], CostModel]
"""Number of stages -> the cost model of a schedule with that many stages (`cost_model`)."""

_F, _B, _W = int(Kind.F), int(Kind.B), int(Kind.W)
_INF = math.inf
_REL = 1e-9  # relative tolerance of every memory and time comparison


def _fits(peak: float, budget: float) -> bool:
    return peak <= budget + _REL * max(1.0, abs(budget))


def _faster(a: float, b: float) -> bool:
    """a is a strictly shorter makespan than b (beyond float noise)."""
    return a < b - _REL * max(1.0, abs(b))


class BudgetError(ValueError):
    """No schedule fits the memory budget; `minimum` is the least budget that would."""

    def __init__(self, budget: float, minimum: float):
        self.budget, self.minimum = budget, minimum
        super().__init__(
            f"no schedule fits a memory budget of {budget:g}: every schedule holds at least "
            f"one microbatch's activations on each rank, {minimum:g} on the fullest rank "
            f"(the least budget that fits)"
        )


@dataclass(frozen=True)
class Found:
    """A schedule with its simulated makespan and peak memory (max over ranks), and how the
    search got it ("greedy: ..." with the policy, or "fixed: NAME")."""

    schedule: Schedule
    makespan: float
    peak: float
    how: str


# ---------------------------------------------------------------- the greedy


@dataclass(frozen=True)
class Policy:
    """The greedy's choices where several actions can run.

    `w_limit`: once more than this many Ws are deferred on a rank, it runs the oldest before
    anything else (None: W only fills time when nothing else can run, or frees memory).
    `b_order` (V placement): when both of a rank's backwards are ready, "old" runs the older
    microbatch first, "up" the stage nearer the loss. `depth[r]`: the most microbatches rank r
    may hold at once (None: only the memory cap limits it).
    """

    v_shape: bool
    w_limit: int | None = None
    b_order: str = "old"
    depth: tuple[int, ...] | None = None

    def describe(self) -> str:
        parts = ["V placement" if self.v_shape else "one stage per rank"]
        parts.append("W deferred freely" if self.w_limit is None else f"W after {self.w_limit}")
        if self.v_shape:
            parts.append("older B first" if self.b_order == "old" else "B near the loss first")
        if self.depth is not None:
            parts.append("depth " + ",".join(map(str, self.depth)))
        return "; ".join(parts)


@dataclass(frozen=True)
class _Problem:
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
    def build(cls, p: int, m: int, costs_for: CostsFor, v_shape: bool) -> _Problem:
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


@dataclass(frozen=True)
class _Run:
    order: tuple[tuple[tuple[int, int, int], ...], ...]  # per rank: (kind, stage, microbatch)
    makespan: float
    depth_bound: bool  # whether the depth limit ever refused a forward


def _greedy(prob: _Problem, cap: float, policy: Policy) -> _Run | None:
    """Event-driven list scheduling under a per-rank memory cap (see the module docstring).

    A rank that becomes free looks at the next F and B of each of its stages (microbatches
    in order on a stage) and its deferred Ws, and starts one by `policy`; when nothing is
    ready it sleeps until its next input arrives. Returns None if the cap is below one
    microbatch's activations on some rank.
    """
    p, m = prob.p, prob.m
    S = len(prob.rank_of)
    stages_of, rank_of, act = prob.stages_of, prob.rank_of, prob.act
    t_f, t_b, t_w = prob.dur
    comm, b_frees = prob.comm, prob.b_frees
    limit = cap + _REL * max(1.0, abs(cap))
    if prob.floor > limit:
        return None
    depth = policy.depth or (m,) * p
    w_limit = policy.w_limit
    up_first = policy.b_order == "up"
    f_in = [[_INF] * m for _ in range(S)]  # when each F's input arrives
    b_in = [[_INF] * m for _ in range(S)]
    f_in[0] = [0.0] * m
    nf = [0] * S  # next microbatch to run F (B) on each stage
    nb = [0] * S
    live = [0.0] * p
    held = [0] * p  # microbatches between their first F and first-stage W on the rank
    waiting = [0.0] * p  # first-chunk activations of microbatches not yet on their second chunk
    second = [sum(act[x] for x in row[1:]) for row in stages_of]
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (stage, mb) owing W
    planned = [0.0] * p  # when each rank next looks for work
    left = [3 * m * len(row) for row in stages_of]
    order: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]
    heap = [(0.0, r) for r in range(p)]
    makespan = 0.0
    depth_bound = False

    def arrive(q: int, at: float, free_at: float) -> None:
        at = max(at, free_at)
        if at < planned[q]:
            planned[q] = at
            heapq.heappush(heap, (at, q))

    free = [0.0] * p
    while heap:
        t, r = heapq.heappop(heap)
        if t != planned[r] or not left[r]:
            continue
        row = stages_of[r]
        owed = deferred[r]
        choice = None
        if owed and w_limit is not None and len(owed) > w_limit:
            choice = (_W, *owed[0])
        if choice is None:
            for s in row if not up_first else row[::-1]:
                j = nb[s]
                if (
                    j < m
                    and b_in[s][j] <= t
                    and (choice is None or (not up_first and j < choice[2]))
                ):
                    choice = (_B, s, j)
        if choice is None:
            for s in row[::-1]:  # the second chunk carries an older microbatch
                i = nf[s]
                if i >= m or f_in[s][i] > t or live[r] + act[s] > limit:
                    continue
                if s == row[0]:
                    if waiting[r] + act[s] + second[r] > limit:
                        continue
                    if held[r] >= depth[r]:
                        depth_bound = True
                        continue
                if choice is None or i < choice[2]:
                    choice = (_F, s, i)
        if choice is None and owed:
            choice = (_W, *owed[0])
        if choice is None:
            nxt = _INF
            for s in row:
                if nb[s] < m and b_in[s][nb[s]] > t:
                    nxt = min(nxt, b_in[s][nb[s]])
                if nf[s] < m and f_in[s][nf[s]] > t:
                    nxt = min(nxt, f_in[s][nf[s]])
            planned[r] = nxt
            if nxt < _INF:
                heapq.heappush(heap, (nxt, r))
            continue
        kind, s, i = choice
        order[r].append(choice)
        left[r] -= 1
        if kind == _F:
            end = t + t_f[s]
            nf[s] += 1
            live[r] += act[s]
            if s == row[0]:
                held[r] += 1
                if len(row) > 1:
                    waiting[r] += act[s]
            else:
                waiting[r] -= act[row[0]]
            if s == S - 1:
                b_in[s][i] = end
            else:
                q = rank_of[s + 1]
                f_in[s + 1][i] = end + (comm if q != r else 0.0)
                arrive(q, f_in[s + 1][i], free[q])
        elif kind == _B:
            end = t + t_b[s]
            nb[s] += 1
            live[r] -= b_frees * act[s]
            owed.append((s, i))
            if s > 0:
                q = rank_of[s - 1]
                b_in[s - 1][i] = end + (comm if q != r else 0.0)
                arrive(q, b_in[s - 1][i], free[q])
        else:
            end = t + t_w[s]
            owed.remove((s, i))
            live[r] -= (1.0 - b_frees) * act[s]
            if s == row[0]:
                held[r] -= 1
        makespan = max(makespan, end)
        free[r] = planned[r] = end
        heapq.heappush(heap, (end, r))
    if any(left):  # unreachable for cap >= floor (see the module docstring); kept as a guard
        return None
    return _Run(tuple(tuple(o) for o in order), makespan, depth_bound)


def _to_schedule(prob: _Problem, run: _Run, params: Iterable[tuple[str, object]]) -> Schedule:
    per_rank = []
    for rows in run.order:
        arr = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        per_rank.append((arr[:, 0], arr[:, 1], arr[:, 2]))
    return Schedule.from_arrays("auto", prob.stages_of, prob.m, per_rank, params=params)


@dataclass
class _Candidate:
    makespan: float
    policy: Policy
    run: _Run


def _policies(prob: _Problem) -> list[Policy]:
    """The grid: W deferral x (V only) backward order; depth is swept per policy."""
    b_orders = ("old", "up") if prob.v_shape else ("old",)
    return [
        Policy(prob.v_shape, w_limit, b_order) for w_limit in (None, 1, 2) for b_order in b_orders
    ]


def _sweep(prob: _Problem, cap: float) -> list[_Candidate]:
    """Every grid policy with one uniform depth 1, 2, ... until the depth stops binding."""
    out = []
    for base in _policies(prob):
        for d in range(1, prob.m + 1):
            policy = replace(base, depth=(d,) * prob.p)
            run = _greedy(prob, cap, policy)
            if run is None:
                break
            out.append(_Candidate(run.makespan, policy, run))
            if not run.depth_bound:
                out[-1].policy = replace(base, depth=None)
                break
    return out


def _descend(prob: _Problem, cap: float, start: _Candidate, max_evals: int) -> _Candidate:
    """Coordinate descent on each rank's depth and on the W deferral: keep strict gains."""
    best = start
    depth = list(best.policy.depth or (prob.m,) * prob.p)
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        moves: list[Policy] = []
        for r in range(prob.p):
            for step in (-1, 1):
                d = depth[:]
                d[r] += step
                if 1 <= d[r] <= prob.m:
                    moves.append(replace(best.policy, depth=tuple(d)))
        for w_limit in (None, 0, 1, 2, 3, prob.p):
            if w_limit != best.policy.w_limit:
                moves.append(replace(best.policy, w_limit=w_limit))
        for policy in moves:
            if evals >= max_evals:
                break
            evals += 1
            run = _greedy(prob, cap, policy)
            if run is not None and _faster(run.makespan, best.makespan):
                best = _Candidate(run.makespan, policy, run)
                depth = list(policy.depth or (prob.m,) * prob.p)
                improved = True
    return best


# ---------------------------------------------------------------- the search


def min_budget(p: int, costs_for: CostsFor) -> float:
    """The least peak memory any schedule can have: one microbatch's activations on the
    fullest rank, on the better placement (the greedy with depth 1 reaches it)."""
    return min(_Problem.build(p, 1, costs_for, v).floor for v in (False, True))


def fixed_points(p: int, m: int, costs_for: CostsFor) -> list[Found | tuple[str, str]]:
    """Every fixed schedule simulated under the costs, or (name, why it cannot be built)."""
    out: list[Found | tuple[str, str]] = []
    for name in SCHEDULE_NAMES:
        try:
            sched = build_schedule(name, p, m)
        except ValueError as exc:
            out.append((name, str(exc)))
            continue
        result = simulate(sched, costs_for(sched.num_stages))
        out.append(Found(sched, result.makespan, float(result.peak_memory.max()), f"fixed: {name}"))
    return out


def _effort(p: int, m: int) -> tuple[int, int]:
    """(candidates improved per placement, greedy runs for each): about two million
    simulated actions in all, so p=8, m=32 takes a few seconds and huge cases stay bounded."""
    keep = 6
    runs = min(24 * p * keep, 2_000_000 // (6 * p * m))
    return keep, max(runs // keep, 2 * p)


def search(
    p: int,
    m: int,
    costs_for: CostsFor,
    budget: float | None = None,
    *,
    fixed: Sequence[Found | tuple[str, str]] | None = None,
) -> Found:
    """The fastest schedule found whose simulated peak memory fits `budget` on every rank.

    `budget` is in the units of the cost model's `activation` (None: no limit). Raises
    `BudgetError` (with the least budget that fits) when nothing fits. `fixed` passes
    precomputed `fixed_points` (the Pareto sweep reuses them).
    """
    floor = min_budget(p, costs_for)
    cap = _INF if budget is None else float(budget)
    if not _fits(floor, cap):
        raise BudgetError(cap, floor)
    pool: list[tuple[float, float, int, Found]] = []  # (makespan, peak, arrival, found)

    def add(found: Found) -> None:
        pool.append((found.makespan, found.peak, len(pool), found))

    keep, max_evals = _effort(p, m)
    for v_shape in (True, False):
        prob = _Problem.build(p, m, costs_for, v_shape)
        cands = sorted(_sweep(prob, cap), key=lambda c: c.makespan)
        improved = [_descend(prob, cap, c, max_evals) for c in cands[:keep]]
        for cand in sorted(improved, key=lambda c: c.makespan)[:2]:
            how = "greedy: " + cand.policy.describe()
            sched = _to_schedule(prob, cand.run, (("how", how),))
            result = simulate(sched, prob.costs)
            add(Found(sched, result.makespan, float(result.peak_memory.max()), how))
    for item in fixed if fixed is not None else fixed_points(p, m, costs_for):
        if isinstance(item, Found) and _fits(item.peak, cap):
            add(item)
    valid = sorted(
        (entry for entry in pool if _fits(entry[1], cap)), key=lambda e: (e[0], e[1], e[2])
    )
    for *_, found in valid:
        try:
            validate(found.schedule)
        except ScheduleError:  # pragma: no cover - the greedy only emits dependency orders
            continue
        params = (("p", p), ("m", m), ("memory_budget", budget), ("how", found.how))
        return replace(found, schedule=_renamed(found.schedule, params))
    raise BudgetError(cap, floor)  # pragma: no cover - depth-1 greedy always fits the floor


def _renamed(sched: Schedule, params: Iterable[tuple[str, object]]) -> Schedule:
    """The same actions named "auto", with how the search found them in `params`."""
    return Schedule(
        name="auto",
        stages_of_rank=sched.stages_of_rank,
        num_microbatches=sched.num_microbatches,
        offsets=sched.offsets,
        kinds=sched.kinds,
        stages=sched.stages,
        microbatches=sched.microbatches,
        params=tuple(params),
    )


def pareto_front(
    p: int, m: int, costs_for: CostsFor, fixed: Sequence[Found | tuple[str, str]] | None = None
) -> list[Found]:
    """The makespan vs peak-memory front found by the search, by rising peak: `search` with
    no limit, then again just below each peak found, down to `min_budget`; points that a
    point with a lower peak matches are dropped."""
    fixed = fixed_points(p, m, costs_for) if fixed is None else fixed
    floor = min_budget(p, costs_for)
    found_all: list[Found] = []
    budget: float | None = None
    while True:
        found = search(p, m, costs_for, budget, fixed=fixed)
        found_all.append(found)
        budget = found.peak - 3 * _REL * max(1.0, found.peak)
        if not _fits(floor, budget):
            break
    front: list[Found] = []
    for found in sorted(found_all, key=lambda f: (f.peak, f.makespan)):
        if not front or _faster(found.makespan, front[-1].makespan):
            front.append(found)
    return front
