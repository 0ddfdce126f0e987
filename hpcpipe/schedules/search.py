"""Schedule search: the fastest schedule that fits a per-rank activation memory budget.

Each fixed schedule sits at one point of the time/memory trade-off and was designed for even
stages and free communication. The search builds schedules for the deck's own costs instead:

1. **Greedy list scheduling under a memory cap** (`listsched`) on both placements, one stage
   per rank and the V shape (rank r holds stages r and 2p-1-r), for a grid of policies: how
   long W may be deferred, which of a V rank's two backwards goes first, whether its
   second-chunk forwards go before its first-chunk backwards, how many second chunks it keeps
   room for, and the warm-up depth (the most microbatches a rank may hold at once).
2. **Local improvement.** From the best few policies, coordinate descent on each rank's own
   warm-up depth, the W deferral and the V rules, keeping a change only when the makespan
   drops; then, from each of them, a descent over the greedy's single choices
   (`Policy.flips`): at one point of the run a rank takes another allowed action and the
   greedy goes on from there, kept when the makespan drops (or stays, with ranks finishing
   earlier in sum).
3. **Seeds.** Every fixed schedule that fits the budget joins the pool, so the result is never
   slower than the best of them under the same costs; on the V placement so do the blocks of
   the V family (`vfamily`) with the most activations the budget holds, the steps between
   V-Min, V-Half and ZB-V.
4. **Refinement.** The fastest few of the pool are improved under the deck's costs by moving
   actions into the gaps of their simulated timeline (`refine`).
5. **Kicks.** The fastest without pairs is kicked out of the refinement's stop: up to 1, 2 or
   3 more forwards on each rank before its first backward, as the budget allows
   (`refine.deepened`), each kicked order refined again.

6. **Escalation.** Where the kicks stopped for their budget and nothing is faster than the
   best fixed schedule, the first kick is refined with one shift pass more; if that takes it
   below, it goes on with shift passes up to `ESCALATE_ACTIONS`.

Steps 4 to 6 skip a candidate already at the lower bound of its own placement (`bound`):
they keep only strictly faster orders, and none exists.

The fastest candidate wins (ties: the lower peak). Every candidate is re-simulated with
`simulate`, so the makespan and peak memory reported are the simulator's, and the winner is
validated. The search is deterministic: every rank of a run computes the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Schedule
from hpcpipe.schedules.listsched import (
    REL,
    CostsFor,
    Policy,
    Problem,
    Run,
    list_schedule,
    run_to_schedule,
)
from hpcpipe.schedules.refine import deepened, refine, shift_pass_evals
from hpcpipe.schedules.registry import SCHEDULE_NAMES, build_schedule
from hpcpipe.schedules.simulate import simulate
from hpcpipe.schedules.validate import validate
from hpcpipe.schedules.vfamily import members

__all__ = [
    "BudgetError",
    "CostsFor",
    "Found",
    "Policy",
    "fixed_points",
    "min_budget",
    "pareto_front",
    "placement_of",
    "search",
]

_INF = math.inf


def _fits(peak: float, budget: float) -> bool:
    return peak <= budget + REL * max(1.0, abs(budget))


def _faster(a: float, b: float) -> bool:
    """a is a strictly shorter makespan than b (beyond float noise)."""
    return a < b - REL * max(1.0, abs(b))


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
    search got it ("greedy: ..." with the policy, "fixed: NAME", "V block family: ..." with
    the block's climbs; "refined " before any of them when refinement moved it)."""

    schedule: Schedule
    makespan: float
    peak: float
    how: str


@dataclass
class _Candidate:
    makespan: float
    policy: Policy
    run: Run


def _policies(prob: Problem) -> list[Policy]:
    """The grid: W deferral x (V only) backward order x late second-chunk forwards; depth is
    swept per policy."""
    v = prob.v_shape
    grid = [
        Policy(v, w_limit, b_order, late_f=late_f)
        for w_limit in (None, 1, 2)
        for b_order in (("old", "up") if v else ("old",))
        for late_f in ((False, True) if v else (False,))
    ]
    if v:  # a shallow warm-up for the late forwards (Policy.reserve)
        grid += [Policy(v, w_limit, "up", late_f=True, reserve=3) for w_limit in (None, 1, 2)]
    return grid


GRID = 15
"""The most policies `_policies` returns (the V placement's)."""

RESERVES = (1, 2, 3)
"""Second-chunk room the descent tries on the V placement (`Policy.reserve`)."""


def _ladder(m: int) -> list[int]:
    """Depths 1, 2, 3, 4, 5, 8, 11, ... (x1.4) up to m: the sweep of a large problem."""
    out, d = [], 1.0
    while round(d) <= m:
        if not out or round(d) != out[-1]:
            out.append(round(d))
        d *= 1.4
    return out if out[-1] == m else [*out, m]


def _sweep_policy(prob: Problem, cap: float, base: Policy, depths: list[int]) -> list[_Candidate]:
    """`base` with each uniform depth in turn, until the depth stops binding."""
    out = []
    for d in depths:
        policy = replace(base, depth=(d,) * prob.p)
        run = list_schedule(prob, cap, policy)
        if run is None:
            break
        out.append(_Candidate(run.makespan, policy, run))
        if not run.depth_bound:
            out[-1].policy = replace(base, depth=None)
            break
    return out


def _sweep(prob: Problem, cap: float, every: bool = True) -> list[_Candidate]:
    """Every grid policy with every uniform depth (small problems); for large ones the first
    policy over the ladder, then the others at the best ladder depth and its neighbours."""
    policies = _policies(prob)
    if every:
        depths = list(range(1, prob.m + 1))
        return [c for base in policies for c in _sweep_policy(prob, cap, base, depths)]
    ladder = _ladder(prob.m)
    out = _sweep_policy(prob, cap, policies[0], ladder)
    if not out:
        return out
    best = min(out, key=lambda c: c.makespan)
    at = ladder.index(best.policy.depth[0]) if best.policy.depth else len(ladder) - 1
    near = ladder[max(0, at - 1) : at + 2]
    for base in policies[1:]:
        out += _sweep_policy(prob, cap, base, near)
    return out


def _descend(prob: Problem, cap: float, start: _Candidate, max_evals: int) -> _Candidate:
    """Coordinate descent on the depth of all ranks at once (steps of 1/8 of it down to 1),
    then of each rank, and on the W deferral: keep strict gains."""
    best = start
    depth = list(best.policy.depth or (prob.m,) * prob.p)
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        moves: list[Policy] = []
        step = max(1, max(depth) // 8)
        while True:
            for sign in (-1, 1):
                d = [x + sign * step for x in depth]
                if min(d) >= 1 and max(d) <= prob.m:
                    moves.append(replace(best.policy, depth=tuple(d)))
            if step == 1:
                break
            step //= 2
        for r in range(prob.p):
            for step in (-1, 1):
                d = depth[:]
                d[r] += step
                if 1 <= d[r] <= prob.m:
                    moves.append(replace(best.policy, depth=tuple(d)))
        for w_limit in (None, 0, 1, 2, 3, prob.p):
            if w_limit != best.policy.w_limit:
                moves.append(replace(best.policy, w_limit=w_limit))
        if prob.v_shape:
            moves.append(replace(best.policy, late_f=not best.policy.late_f))
            for reserve in RESERVES:
                if reserve != best.policy.reserve:
                    moves.append(replace(best.policy, reserve=reserve))
        for policy in moves:
            if evals >= max_evals:
                break
            evals += 1
            run = list_schedule(prob, cap, policy)
            if run is not None and _faster(run.makespan, best.makespan):
                best = _Candidate(run.makespan, policy, run)
                depth = list(policy.depth or (prob.m,) * prob.p)
                improved = True
    return best


FLIP_ACTIONS = 8_000_000
"""Actions the flip descent (`_flip_descent`) may simulate per placement in one search, shared
by the candidates it improves: about a second of compiled greedy. A count, not a time."""


def _gains(a: Run, b: Run) -> bool:
    """a is faster than b, or as fast with ranks that finish earlier in sum (a plateau step:
    the makespan of a V schedule often moves only after several changed choices)."""
    if _faster(a.makespan, b.makespan):
        return True
    return not _faster(b.makespan, a.makespan) and a.ends < b.ends - REL * max(1.0, b.ends)


def _flip_descents(prob: Problem, cap: float, cands: list[_Candidate]) -> list[_Candidate]:
    """`_flip_descent` from each candidate, sharing `FLIP_ACTIONS`: what one leaves unused
    goes to the next. Every candidate gets its turn: the fastest greedy is not always the one
    a changed choice improves (p = 7, m = 14, unit costs, budget 3.5: the two at 53.5 stay, two
    at 54.5 reach 52.5)."""
    left = FLIP_ACTIONS // (3 * prob.m * len(prob.rank_of))
    out = []
    for n, cand in enumerate(cands):
        got, used = _flip_descent(prob, cap, cand, left // (len(cands) - n))
        out.append(got)
        left -= used
    return out


def _flip_descent(
    prob: Problem, cap: float, start: _Candidate, max_runs: int
) -> tuple[_Candidate, int]:
    """Change one choice of the greedy at a time (`Policy.flips`): at choice d take another
    allowed action, and let the greedy run on from there; keep the change when the makespan
    drops, or stays with the ranks finishing earlier in sum (`_gains`). Flips the new run no
    longer reaches are dropped (they change nothing). Choices are visited from both ends of
    the run inwards (the fill and the drain hold the bubble when m is large), cyclically,
    until a full cycle gains nothing or `max_runs` greedy runs are spent.

    A rule picks the same kind of action at every choice; the orders that beat V-Min and V-Half
    half a microbatch above their own peaks differ from the greedy's at a few choices of the
    fill or the drain (p = 7, m = 14, unit costs, budget 3.5: two changed choices take the
    greedy's 54.5 to 52.5, where V-Min takes 53.5)."""
    best = start
    if max_runs < 1:
        return best, 0
    run = list_schedule(prob, cap, best.policy, track=True)
    if run is None:  # pragma: no cover - the start ran
        return best, 1
    alts, flips, runs = run.alts, dict(best.policy.flips), 1
    k, quiet = 0, 0  # the step of the visit, and how many choices in a row gained nothing
    while alts.size and quiet < alts.size and runs < max_runs:
        k %= alts.size
        d = k // 2 if k % 2 == 0 else alts.size - 1 - k // 2  # both ends first
        gained = False
        for a in range(-1, int(alts[d])):
            if flips.get(d, -1) == a or runs >= max_runs:
                continue
            trial = {c: x for c, x in flips.items() if c != d}
            if a >= 0:
                trial[d] = a
            policy = replace(best.policy, flips=tuple(sorted(trial.items())))
            runs += 1
            got = list_schedule(prob, cap, policy, track=True)
            if got is not None and _gains(got, best.run):
                live = {c: x for c, x in trial.items() if c < got.alts.size and x < got.alts[c]}
                policy = replace(policy, flips=tuple(sorted(live.items())))
                best, alts, flips = _Candidate(got.makespan, policy, got), got.alts, live
                gained = True
                break
        quiet = 0 if gained else quiet + 1
        k += 1
    return best, runs


# ---------------------------------------------------------------- the search


def min_budget(p: int, costs_for: CostsFor) -> float:
    """The least peak memory any schedule can have: one microbatch's activations on the
    fullest rank, on the better placement (the greedy with depth 1 reaches it)."""
    return min(Problem.build(p, 1, costs_for, v).floor for v in (False, True))


def fixed_points(
    p: int, m: int, costs_for: CostsFor, placements: Sequence[bool] = (True, False)
) -> list[Found | tuple[str, str]]:
    """Every fixed schedule simulated under the costs, or (name, why it cannot be built);
    with one of the two `placements` only, the schedules laid out that way."""
    out: list[Found | tuple[str, str]] = []
    shapes = _shapes(p, placements)
    for name in SCHEDULE_NAMES:
        try:
            sched = build_schedule(name, p, m)
        except ValueError as exc:
            out.append((name, str(exc)))
            continue
        if shapes is not None and tuple(map(tuple, sched.stages_of_rank)) not in shapes:
            continue
        result = simulate(sched, costs_for(sched.num_stages))
        out.append(Found(sched, result.makespan, float(result.peak_memory.max()), f"fixed: {name}"))
    return out


GREEDY_ACTIONS = 16_000_000
"""Actions the list scheduler may place per placement in one search (a few seconds of CPU with
the compiled greedy, about 20 s without numba): it bounds the search at every size (p = 64,
m = 256 stays under a minute in all). A count, not a time, so the search gives the same
schedule on every machine."""


def _effort(p: int, m: int) -> tuple[int, int, bool]:
    """(candidates improved per placement, greedy runs for each, whether the depth sweep may
    try every depth): small problems get the full sweep and a descent of about two million
    simulated actions (at least 2p steps), large ones what `GREEDY_ACTIONS` leaves after the
    ladder sweep."""
    keep = 6
    runs = GREEDY_ACTIONS // (6 * p * m)
    every = GRID * m <= runs // 2  # the full sweep costs at most half of the budget
    swept = GRID * m if every else len(_ladder(m)) + 3 * (GRID - 1)
    wanted = max(min(24 * p * keep, 2_000_000 // (6 * p * m)) // keep, 2 * p)
    return keep, max(1, min(wanted, (runs - swept) // keep)), every


FAMILY_ACTIONS = 1_000_000
"""Actions of the V block family's schedules (`vfamily.members`) one search may build and
simulate: all of its blocks at the budget's peak up to p = 16, m = 128; 10 of them at p = 64,
m = 256. A count, not a time."""


REFINED = 3
"""How many of the fastest candidates `refine` improves under the deck's costs, each with the
shift pass where one fits: the fastest is not always the one that shifts furthest (p = 3, m = 3,
unit costs, budget 2.5: a greedy order at 11 stays there, V-Half at 11.5 shifts to the optimum,
10.5)."""


KICKS = (1, 2, 3)
"""More forwards ahead of each rank's first backward (`refine.deepened`) tried on the fastest
schedule found, each refined again: a way out of the stop where no single move helps (p = 16,
budget 6.5: V-Min's 77.5, 125.5, 221.5, 413.5 become 77.0, 125.0, 221.0, 413.0 for m = 16..128,
all with up to two)."""

KICK_ACTIONS = 16_000_000
"""Simulated actions each kick's refinement may spend (at least `_refine_evals`): at p = 16,
m = 128 the 1,300 simulations two more forwards need (the refinement's own 325 stop at 414.0)."""


def _kick_evals(p: int, m: int) -> int:
    return max(_refine_evals(p, m), KICK_ACTIONS // (6 * p * m))


ESCALATE_ACTIONS = 1 << 29
"""Simulated actions the escalated kick's refinement may spend (step 6): the shift passes a
kick's own budget leaves out (at p = 13, m = 13 one pass is 16,224 simulations, a kick has
15,779) are what move a V-Half under MoE costs at its own peak down to the bound (budget 7:
78.0 to 76.2 in about 140,000 simulations; p = 15, m = 15, budget 8: 90.5 to 88.4 in about
237,000), 5-15 CPU s. A count, not a time."""

ESCALATE_PASSES = 4
"""Shift passes `ESCALATE_ACTIONS` must hold for the search to escalate at all: fewer rarely
take a kick to the bound (p = 15 took 11), so larger problems do not spend the time."""


def _escalate_evals(p: int, m: int) -> int:
    """Simulations the escalated kick may take; 0 where the passes do not fit."""
    actions = 6 * p * m
    evals = ESCALATE_ACTIONS // actions
    return evals if evals >= ESCALATE_PASSES * shift_pass_evals(actions) else 0


def _refine_evals(p: int, m: int) -> int:
    """Simulations per refined candidate: about four million simulated actions each, at
    most 1500 beyond a full shift pass (so every problem small enough for one gets it: at
    p = 5, m = 5 under MoE costs, budget 3, it takes V-Half's 28.0 to 27.4, the optimum)."""
    actions = 6 * p * m
    return max(40, min(4_000_000 // actions, shift_pass_evals(actions) + 1500))


RIPPLE_ACTIONS = 8_000_000
"""Simulated actions each refined candidate may spend after that on moves into gaps that
make ripples at once (`refine`'s `then`): at p = 16, m = 128, MoE costs, budget 9, they take
V-Half's 485.95 to 485.55 (4 million, the second phase alone stops at 485.95)."""


def _ripple_evals(p: int, m: int) -> int:
    return max(40, RIPPLE_ACTIONS // (6 * p * m))


def search(
    p: int,
    m: int,
    costs_for: CostsFor,
    budget: float | None = None,
    *,
    fixed: Sequence[Found | tuple[str, str]] | None = None,
    placements: Sequence[bool] = (True, False),
) -> Found:
    """The fastest schedule found whose simulated peak memory fits `budget` on every rank.

    `budget` is in the units of the cost model's `activation` (None: no limit). Raises
    `BudgetError` (with the least budget that fits) when nothing fits. `fixed` passes
    precomputed `fixed_points` (the Pareto sweep reuses them). `placements`: the stage
    placements searched (True: the V shape, False: one stage per rank); fixed schedules of
    another placement are left out (a running pipeline keeps its layers where they are).
    """
    floor = min(Problem.build(p, 1, costs_for, v).floor for v in placements)
    cap = _INF if budget is None else float(budget)
    if not _fits(floor, cap):
        raise BudgetError(cap, floor)
    pool: list[tuple[float, float, int, Found]] = []  # (makespan, peak, arrival, found)

    def add(found: Found) -> None:
        pool.append((found.makespan, found.peak, len(pool), found))

    keep, max_evals, every = _effort(p, m)
    for v_shape in placements:
        prob = Problem.build(p, m, costs_for, v_shape)
        cands = sorted(_sweep(prob, cap, every), key=lambda c: c.makespan)
        if not every:  # the budget goes to the best candidate's descent
            keep, max_evals = 1, max_evals * keep
        improved = sorted(
            (_descend(prob, cap, c, max_evals) for c in cands[:keep]), key=lambda c: c.makespan
        )
        improved = _flip_descents(prob, cap, improved)
        for cand in sorted(improved, key=lambda c: c.makespan)[:2]:
            how = "greedy: " + cand.policy.describe()
            sched = run_to_schedule(prob, cand.run, (("how", how),))
            result = simulate(sched, prob.costs)
            add(Found(sched, result.makespan, float(result.peak_memory.max()), how))
    shapes = _shapes(p, placements)

    def placed(found: Found) -> bool:
        return shapes is None or tuple(map(tuple, found.schedule.stages_of_rank)) in shapes

    published = _INF  # the fastest fixed schedule that fits
    for item in fixed if fixed is not None else fixed_points(p, m, costs_for, placements):
        if isinstance(item, Found) and _fits(item.peak, cap) and placed(item):
            add(item)
            published = min(published, item.makespan)
    if True in placements:  # after the published schedules: equal makespan and peak, they win
        for found in _family(p, m, costs_for, budget):
            add(found)
    ranked = sorted((e for e in pool if _fits(e[1], cap)), key=lambda e: (e[0], e[1], e[2]))
    budget_evals, then = _refine_evals(p, m), _ripple_evals(p, m)
    at_bound = _bound_check(costs_for, budget)
    for *_, found in ranked[:REFINED]:
        if found.schedule.pairs.size or at_bound(found):
            continue
        sched, result, _ = refine(
            found.schedule, costs_for(found.schedule.num_stages), budget, budget_evals,
            then=then,
        )  # fmt: skip
        if _faster(result.makespan, found.makespan):
            how = "refined " + found.how
            add(Found(sched, result.makespan, float(result.peak_memory.max()), how))
    cut = _kick(pool, add, cap, budget, costs_for, _kick_evals(p, m), at_bound)
    evals = _escalate_evals(p, m)
    start = _kick_start(pool, cap)
    if (
        cut
        and evals
        and start is not None
        and placement_of(start.schedule) in placements
        and published < _INF
        and not _faster(min(e[0] for e in pool if _fits(e[1], cap)), published)
    ):
        probe = _kick_evals(p, m) + shift_pass_evals(6 * p * m)
        _escalate(pool, add, cap, budget, costs_for, probe, evals)
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


def _kick(
    pool: list[tuple[float, float, int, Found]],
    add: Callable[[Found], None],
    cap: float,
    budget: float | None,
    costs_for: CostsFor,
    evals: int,
    at_bound: Callable[[Found], bool],
) -> bool:
    """Kick the fastest schedule without pairs in the pool that fits (`KICKS`) and refine each
    kicked order; adds those faster than it. Returns whether a refinement stopped for its
    budget (`evals`, or a shift pass it could not hold) rather than for want of a better move."""
    start = _kick_start(pool, cap)
    if start is None or at_bound(start):
        return False
    costs = costs_for(start.schedule.num_stages)
    cut = False
    tried: set[str] = set()
    for extra in KICKS:
        kicked = deepened(start.schedule, costs, budget, extra)
        if kicked is None or kicked.fingerprint() in tried:
            continue  # (where the budget is full, one more forward is all a rank takes)
        tried.add(kicked.fingerprint())
        sched, result, spent = refine(kicked, costs, budget, evals)
        cut = cut or spent >= evals or shift_pass_evals(kicked.kinds.size) > evals
        peak = float(result.peak_memory.max())
        if _fits(peak, cap) and _faster(result.makespan, start.makespan):
            how = f"up to {extra} more F before the first B, refined: {start.how}"
            add(Found(sched, result.makespan, peak, how))
    return cut


def _escalate(
    pool: list[tuple[float, float, int, Found]],
    add: Callable[[Found], None],
    cap: float,
    budget: float | None,
    costs_for: CostsFor,
    probe: int,
    evals: int,
) -> None:
    """Step 6: the first kick of the kicks' start, refined with `probe` simulations; if that
    takes it below the start, on from there with shift passes, up to `evals` simulations in
    all. Where the start is already optimal only the probe is spent."""
    start = _kick_start(pool, cap)
    if start is None:
        return
    costs = costs_for(start.schedule.num_stages)
    kicked = next(
        (k for k in (deepened(start.schedule, costs, budget, e) for e in KICKS) if k is not None),
        None,
    )
    if kicked is None:
        return
    sched, result, spent = refine(kicked, costs, budget, probe)
    if _faster(result.makespan, start.makespan) and _fits(float(result.peak_memory.max()), cap):
        sched, result, _ = refine(sched, costs, budget, evals - spent)
        how = f"a kick refined with shift passes: {start.how}"
        add(Found(sched, result.makespan, float(result.peak_memory.max()), how))


def _kick_start(pool: list[tuple[float, float, int, Found]], cap: float) -> Found | None:
    """The schedule `_kick` kicks: the fastest without pairs in the pool that fits."""
    ranked = sorted((e for e in pool if _fits(e[1], cap)), key=lambda e: (e[0], e[1], e[2]))
    return next((e[3] for e in ranked if not e[3].schedule.pairs.size), None)


BOUND_STATES = 2_000
"""States the bound's searches for ranks alone may take when `_bound_check` proves a candidate
optimal: enough for most candidates at the bound (p = 16, m = 64, heavy ends, budgets 12 and
20: the search takes half and a third of its time); with 20,000 the failed proofs cost more
than the skipped refinements save. A count, not a time."""


def _bound_check(
    costs_for: CostsFor, budget: float | None, states: int = BOUND_STATES
) -> Callable[[Found], bool]:
    """Whether a candidate is at the lower bound of its own placement: refinement and kicks
    keep only strictly faster orders, so they cannot improve it and are skipped (the search's
    result is the same with or without the check). One bound per placement and number of
    microbatches: a bound proven up to a makespan settles every candidate at least as slow
    (none below it exists), so only a faster candidate asks again."""
    known: dict[tuple, tuple[float, float]] = {}  # key -> (makespan asked for, bound)

    def at_bound(found: Found) -> bool:
        sched = found.schedule
        key = (tuple(map(tuple, sched.stages_of_rank)), sched.num_microbatches)
        if key not in known or _faster(found.makespan, known[key][0]):
            bound = lower_bound(
                sched.stages_of_rank, sched.num_microbatches, costs_for(sched.num_stages),
                budget, target=found.makespan, max_states=states,
            )  # fmt: skip
            known[key] = (found.makespan, bound.makespan)
        return not _faster(known[key][1], found.makespan)

    return at_bound


def _family(p: int, m: int, costs_for: CostsFor, budget: float | None) -> list[Found]:
    """The V block family's schedules at the most activations `budget` holds, simulated under
    the costs (the steps between the published V-Min, V-Half and ZB-V)."""
    costs = costs_for(2 * p)
    out = []
    for member, sched in members(p, m, costs, budget, FAMILY_ACTIONS):
        result = simulate(sched, costs)
        peak = float(result.peak_memory.max())
        out.append(Found(sched, result.makespan, peak, member.describe()))
    return out


def _shapes(p: int, placements: Sequence[bool]) -> set[tuple[tuple[int, ...], ...]] | None:
    """The stage layouts of `placements`; None for both (every fixed schedule, interleaved
    ones included, is a candidate then)."""
    if set(placements) == {True, False}:
        return None
    return {_placement(p, v) for v in placements}


def _placement(p: int, v_shape: bool) -> tuple[tuple[int, ...], ...]:
    """The stages each rank holds under a placement (as `Problem.build` lays them out)."""
    return tuple((r, 2 * p - 1 - r) if v_shape else (r,) for r in range(p))


def placement_of(schedule: Schedule) -> bool | None:
    """True (V shape) or False (one stage per rank) when the search can build `schedule`'s
    placement, None otherwise (interleaved round-robin stages)."""
    p = schedule.num_ranks
    rows = tuple(map(tuple, schedule.stages_of_rank))
    for v in (True, False):
        if rows == _placement(p, v):
            return v
    return None


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
        budget = found.peak - 3 * REL * max(1.0, found.peak)
        if not _fits(floor, budget):
            break
    front: list[Found] = []
    for found in sorted(found_all, key=lambda f: (f.peak, f.makespan)):
        if not front or _faster(found.makespan, front[-1].makespan):
            front.append(found)
    return front
