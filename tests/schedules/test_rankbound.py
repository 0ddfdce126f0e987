"""One rank alone (hpcpipe.schedules.rankbound): the search finds the fastest order, checked
against trying every order of every microbatch by brute force; the bound it gives proves the
fixed V schedules optimal where an exact solver found them optimal; cut short it stays a
bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcpipe.schedules import build_schedule, simulate
from hpcpipe.schedules.bound import lower_bound, rank_alone
from hpcpipe.schedules.listsched import unit_costs
from hpcpipe.schedules.rankbound import RankActions, relaxed_makespan


def brute_force(kinds: RankActions, m: int, budget: float) -> float:
    """Every order of every (kind, microbatch), each action as early as it can start: the
    microbatches keep their identities here (no in-order assumption), and the k-th first
    forward in time gets the k-th release."""
    n = len(kinds.duration)
    best = math.inf

    def go(ends: dict, free: float, span: float, used: float, firsts: int) -> None:
        nonlocal best
        if len(ends) == n * m:
            best = min(best, span)
            return
        for k in range(n):
            for mb in range(m):
                if (k, mb) in ends:
                    continue
                if k == 0:
                    ready = kinds.release + firsts * kinds.release_step
                elif (kinds.pred[k], mb) in ends:
                    ready = ends[kinds.pred[k], mb] + kinds.lag[k]
                else:
                    continue
                if kinds.memory[k] > 0 and used + kinds.memory[k] > budget + 1e-9:
                    continue
                end = max(free, ready) + kinds.duration[k]
                ends[k, mb] = end
                go(ends, end, max(span, end + kinds.tail[k]), used + kinds.memory[k],
                   firsts + (k == 0))  # fmt: skip
                del ends[k, mb]
                if k == 0:
                    break  # first forwards of microbatches not yet started are alike

    go({}, 0.0, 0.0, 0.0, 0)
    return best


@st.composite
def small_ranks(draw):
    """A rank alone small enough for brute force: (its kinds, m, budget), random costs,
    communication, partial freeing by B and budgets from one microbatch up."""
    from hpcpipe.schedules import CostModel

    p, v_shape = draw(st.integers(2, 4)), draw(st.booleans())
    m = draw(st.integers(1, 2 if v_shape else 3))  # V: 12 actions, every order still quick
    stages = 2 * p if v_shape else p
    costs = CostModel(
        t_f=draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=stages, max_size=stages)),
        t_b=draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=stages, max_size=stages)),
        t_w=draw(st.sampled_from([0.0, 0.5, 1.0])),
        comm_latency=draw(st.sampled_from([0.0, 0.25])),
        b_frees=draw(st.sampled_from([0.0, 0.5])),
    )
    r = draw(st.integers(0, p - 1))
    placement = [(q, 2 * p - 1 - q) if v_shape else (q,) for q in range(p)]
    budget = max(draw(st.integers(1, 6)) * 0.5, float(len(placement[r])))  # one always fits
    return rank_alone(placement, r, costs), m, budget


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_ranks())
def test_the_search_finds_what_trying_every_order_finds(problem):
    kinds, m, budget = problem
    exact = brute_force(kinds, m, budget)
    found = relaxed_makespan(kinds, m, budget)
    assert found.exact
    assert found.makespan == pytest.approx(exact)
    capped = relaxed_makespan(kinds, m, budget, target=exact - 0.25)
    assert capped.makespan == pytest.approx(exact - 0.25)  # never above the target


@pytest.mark.parametrize(
    ("name", "p", "m", "budget", "optimum"),
    [
        # optima over every order on every placement (CP-SAT, benchmarks/schedule_exact.py)
        ("v-half", 3, 3, 2.0, 11.5),
        ("v-half", 3, 6, 2.0, 20.5),
        ("v-min", 4, 4, 2.0, 17.5),
        ("v-min", 4, 8, 2.0, 29.5),
    ],
)
def test_the_turning_rank_alone_proves_the_v_schedules_optimal(name, p, m, budget, optimum):
    sched = build_schedule(name, p, m)
    costs = unit_costs(p)(sched.num_stages)
    result = simulate(sched, costs)
    assert result.makespan == pytest.approx(optimum)
    assert float(result.peak_memory.max()) <= budget
    analytic = lower_bound(sched.stages_of_rank, m, costs, budget, max_states=0)
    assert analytic.makespan < optimum  # the terms added on their own fall short
    bound = lower_bound(sched.stages_of_rank, m, costs, budget)
    assert bound.makespan == pytest.approx(optimum)
    assert bound.rank == p - 1 and "alone" in bound.why and "exactly" in bound.why


def test_cut_short_it_is_still_a_bound_and_says_so():
    p, m, budget = 5, 20, 3.0
    sched = build_schedule("v-half", p, m)
    costs = unit_costs(p)(sched.num_stages)
    span = simulate(sched, costs).makespan
    full = lower_bound(sched.stages_of_rank, m, costs, budget)
    cut = lower_bound(sched.stages_of_rank, m, costs, budget, max_states=300)
    analytic = lower_bound(sched.stages_of_rank, m, costs, budget, max_states=0)
    assert analytic.makespan <= cut.makespan <= full.makespan <= span + 1e-9
    kinds = rank_alone(sched.stages_of_rank, p - 1, costs)
    partial = relaxed_makespan(kinds, m, budget, max_states=300)
    assert not partial.exact and partial.states > 300
    assert partial.makespan <= relaxed_makespan(kinds, m, budget).makespan + 1e-9


def test_a_target_stops_the_proof_there():
    p, m, budget = 4, 8, 2.0
    sched = build_schedule("v-min", p, m)
    costs = unit_costs(p)(sched.num_stages)
    capped = lower_bound(sched.stages_of_rank, m, costs, budget, target=29.0)
    assert capped.makespan == pytest.approx(29.0)
    assert lower_bound(sched.stages_of_rank, m, costs, budget, target=40.0).makespan == (
        pytest.approx(29.5)
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_ranks(), st.integers(1, 60))
def test_cut_short_anywhere_with_the_drain_it_stays_below_every_order(problem, states):
    """The drain search (running back from the end) and the forward search charged with its
    idle are both cut short after a few states here, at every depth: the figure is never
    above what trying every order finds, with or without a target."""
    kinds, m, budget = problem
    exact = brute_force(kinds, m, budget)
    for target in (math.inf, exact, exact + 1.0):
        got = relaxed_makespan(kinds, m, budget, target=target, max_states=states)
        assert got.makespan <= exact + 1e-9


def test_the_drain_proves_v_half_optimal_where_the_forward_search_alone_runs_out():
    """p = 10, m = 20, unit costs, budget 6 (V-Half's peak): rank 9 (stages 9 and 10) alone
    cannot beat V-Half's 71.5. Forwards alone that takes about 200,000 states; the drain
    search finds 3 of idle among the rank's last actions (V-Half idles there too, waiting for
    the last backwards), after which every forward order is pruned at once. At m = 80 (the
    forward search alone needs 1.15 million) it proves 251.5 the same way."""
    p, budget = 10, 6.0
    placement = [(q, 2 * p - 1 - q) for q in range(p)]
    for m, optimum in ((20, 71.5), (80, 251.5)):
        sched = build_schedule("v-half", p, m)
        costs = unit_costs(p)(sched.num_stages)
        result = simulate(sched, costs)
        assert result.makespan == optimum and float(result.peak_memory.max()) == budget
        kinds = rank_alone(placement, p - 1, costs)
        got = relaxed_makespan(kinds, m, budget, target=optimum, max_states=60_000)
        assert got.exact and got.makespan == pytest.approx(optimum)
        bound = lower_bound(placement, m, costs, budget, target=optimum, max_states=60_000)
        assert bound.makespan == pytest.approx(optimum) and bound.rank == p - 1
