"""The refinement's two ways of spending fewer simulations per kept move: a change that ripples
through the steady state one microbatch per pass is made for the rest of the run at once
(`_State.ripple`), and a gap move refused while the times around it stay the same is not tried
again. Under MoE costs (an all-to-all of a quarter of F and B, 0.1 per message) both take a
published schedule below itself at its own peak, where the refinement used to stop at the
simulation cap first."""

from __future__ import annotations

import numpy as np
import pytest

import hpcpipe.schedules.refine as refine_module
from hpcpipe.schedules import build_schedule, simulate, validate
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.config import PipelineConfig, costs_for
from hpcpipe.schedules.refine import refine
from hpcpipe.schedules.search import _refine_effort, search


def _moe(p: int, m: int):
    return costs_for(PipelineConfig(microbatches=m, t_alltoall=(0.25,), comm_latency=0.1), p)


def _v(p: int) -> list[tuple[int, int]]:
    return [(r, 2 * p - 1 - r) for r in range(p)]


def _channels_in_order(sched) -> None:
    for row in sched.actions:
        seen: dict[tuple, int] = {}
        for a in row:
            assert seen.get((a.kind, a.stage), -1) < a.microbatch
            seen[(a.kind, a.stage)] = a.microbatch


def test_a_ripple_is_made_at_once_and_reaches_the_optimum():
    """p = 6, m = 48, budget 4 (V-Half's peak): V-Half takes 179.15, the lower bound is
    178.75. The refinement gets there by moving the same four actions one microbatch on per
    pass, 45 times; made at once, the ripple takes fewer than half the simulations."""
    p, m = 6, 48
    sched = build_schedule("v-half", p, m)
    costs = _moe(p, m)(2 * p)
    assert simulate(sched, costs).makespan == pytest.approx(179.15)
    bound = lower_bound(_v(p), m, costs, 4.0).makespan
    assert bound == pytest.approx(178.75)
    evals, _ = _refine_effort(p, m)
    best, result, used = refine(sched, costs, 4.0, evals)
    assert result.makespan == pytest.approx(bound)
    assert result.peak_memory.max() <= 4.0
    validate(best)
    _channels_in_order(best)
    original = refine_module._period
    try:
        refine_module._period = lambda moves: None  # no ripple: one period per pass
        _, alone, used_alone = refine(sched, costs, 4.0, evals)
    finally:
        refine_module._period = original
    assert alone.makespan == pytest.approx(bound)
    assert 2 * used < used_alone


def test_refused_moves_are_not_tried_again_while_their_gap_is_unchanged():
    """p = 10, m = 40, budget 6: the refinement stops by itself (no move helps) within a few
    hundred simulations, below V-Half (161.95); retrying every refused move on every pass
    took more than 3,000 to get there."""
    p, m = 10, 40
    sched = build_schedule("v-half", p, m)
    costs = _moe(p, m)(2 * p)
    best, result, used = refine(sched, costs, 6.0, 100_000, shifts=False)
    assert used < 1_000
    assert result.makespan == pytest.approx(161.65)
    assert result.peak_memory.max() <= 6.0
    validate(best)


def test_a_ripple_move_never_passes_its_own_channel_or_leaves_its_rank():
    """`_made` refuses a move past a microbatch of the same stage and kind, or off the rank,
    and otherwise keeps the order and its inverse consistent."""
    sched = build_schedule("1f1b", 3, 4)
    state = refine_module._State(sched, _moe(3, 4)(3), None, 10)
    order, at = state.order.copy(), state.at()
    first_f = (0, 0, 1, -1)  # rank 0's F of microbatch 1 in front of microbatch 0's
    assert not state._made(order, at, [first_f])
    assert not state._made(order, at, [(0, 0, 0, -1)])  # before the rank's first action
    last = int(sched.offsets[1]) - 1  # rank 0's last action, one further: rank 1
    kind, stage, mb = (int(x[last]) for x in (sched.kinds, sched.stages, sched.microbatches))
    assert not state._made(order, at, [(kind, stage, mb, 1)])
    b0 = next(i for i in range(int(sched.offsets[1])) if sched.kinds[i] != 0)
    back = (int(sched.kinds[b0]), 0, int(sched.microbatches[b0]))
    assert state._made(order, at, [(*back, -1)])  # rank 0's first backward one place earlier
    assert np.array_equal(at[order], np.arange(order.size))
    assert order[b0 - 1] == b0 and order[b0] == b0 - 1
    assert state._made(order, at, [(*back, 1)])  # and back
    assert np.array_equal(order, np.arange(order.size))


def test_the_refinement_cap_reaches_a_ripple_at_p16():
    """p = 16, m = 128, budget 9: V-Half's 485.95 becomes 485.45 in 716 simulations; the
    cap of about four million actions (325 simulations) stopped short of it."""
    p, m = 16, 128
    sched = build_schedule("v-half", p, m)
    costs = _moe(p, m)(2 * p)
    evals, shifts = _refine_effort(p, m)
    assert not shifts and evals * 6 * p * m > 8_000_000
    _, result, used = refine(sched, costs, 9.0, evals, shifts=shifts)
    assert result.makespan == pytest.approx(485.45)
    assert used < evals
    _, short, _ = refine(sched, costs, 9.0, 4_000_000 // (6 * p * m), shifts=False)
    assert short.makespan == pytest.approx(485.95)


@pytest.mark.parametrize(
    ("p", "m", "budget", "published"), [(10, 40, 6.0, 161.95), (11, 44, 11.0, 165.05)]
)
def test_the_search_beats_a_published_schedule_at_its_own_peak_under_moe(p, m, budget, published):
    """V-Half at its peak (p = 10, budget 6) and ZB-V at its (p = 11, budget p): the best
    fixed schedules there, above the lower bound; the search is strictly faster."""
    costs = _moe(p, m)
    found = search(p, m, costs, budget)
    assert found.makespan < published - 1e-6
    assert found.peak <= budget
    validate(found.schedule)
    assert simulate(found.schedule, costs(found.schedule.num_stages)).makespan == pytest.approx(
        found.makespan
    )
