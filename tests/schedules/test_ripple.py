"""The refinement's second phase (`refine`'s `then`) and its two ways of spending fewer
simulations per kept move: a change that ripples through the steady state one microbatch per
pass is made for the rest of the run at once (`_State.ripple`), and a gap move refused while
the times around it stay the same is not tried again. Under MoE costs (an all-to-all of a
quarter of F and B, 0.1 per message) they take a published schedule below itself at its own
peak, where the plain refinement stops at its simulation cap first."""

from __future__ import annotations

import numpy as np
import pytest

import hpcpipe.schedules.refine as refine_module
from hpcpipe.schedules import build_schedule, simulate, validate
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.config import PipelineConfig, costs_for
from hpcpipe.schedules.refine import refine
from hpcpipe.schedules.search import _refine_evals, _ripple_evals, search


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


def _without_refused_moves(monkeypatch) -> None:
    """Every refused move retried on every pass, as before the refinement remembered them."""

    class Forgets(set):
        def __contains__(self, item) -> bool:
            return False

    init = refine_module._State.__init__

    def forgetful(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.refused = Forgets()

    monkeypatch.setattr(refine_module._State, "__init__", forgetful)


def test_a_ripple_is_made_at_once_and_reaches_the_optimum(monkeypatch):
    """p = 6, m = 48, budget 4 (V-Half's peak): V-Half takes 179.15, the lower bound is
    178.75. The refinement gets there by moving the same four actions one microbatch on per
    pass, 45 times; made at once, the ripple gets there within 250 simulations, where the
    moves alone do not."""
    p, m = 6, 48
    sched = build_schedule("v-half", p, m)
    costs = _moe(p, m)(2 * p)
    assert simulate(sched, costs).makespan == pytest.approx(179.15)
    bound = lower_bound(_v(p), m, costs, 4.0).makespan
    assert bound == pytest.approx(178.75)
    best, result, _ = refine(sched, costs, 4.0, 0, then=250)
    assert result.makespan == pytest.approx(bound)
    assert result.peak_memory.max() <= 4.0
    validate(best)
    _channels_in_order(best)
    monkeypatch.setattr(refine_module, "_period", lambda moves: None)  # one period a pass
    _, alone, _ = refine(sched, costs, 4.0, 0, then=250)
    assert alone.makespan == pytest.approx(179.15)


def test_refused_moves_are_not_tried_again_while_their_gap_is_unchanged(monkeypatch):
    """p = 10, m = 40, budget 6: within 1,666 simulations (the cap of 4 million actions) the
    refinement takes V-Half's 161.95 to 161.65; retrying every refused move on every pass, it
    does not get there."""
    p, m = 10, 40
    sched = build_schedule("v-half", p, m)
    costs = _moe(p, m)(2 * p)
    best, result, _ = refine(sched, costs, 6.0, 0, then=1666)
    assert result.makespan == pytest.approx(161.65)
    assert result.peak_memory.max() <= 6.0
    validate(best)
    _without_refused_moves(monkeypatch)
    _, retried, _ = refine(sched, costs, 6.0, 0, then=1666)
    assert retried.makespan == pytest.approx(161.95)


@pytest.mark.parametrize(
    ("p", "m", "name", "budget"),
    [(4, 8, "v-half", None), (4, 8, "zb-v", None), (4, 8, "1f1b", None), (5, 40, "zb-v", 5.0)],
)
def test_the_refinement_stops_only_where_no_gap_move_helps(p, m, name, budget):
    """Remembering refused moves must not make it stop earlier: where it stops below its
    cap, a fresh refinement of its result (nothing remembered) keeps nothing. MoE costs, at
    each schedule's own peak, and p = 5, m = 40, budget 5, where stopping at the first pass
    that tries nothing new left ZB-V at 143.9 (143.7 with the pass that retries them all)."""
    sched = build_schedule(name, p, m)
    costs = _moe(p, m)(sched.num_stages)
    if budget is None:
        budget = float(simulate(sched, costs).peak_memory.max())
    best, result, used = refine(sched, costs, budget, 0, then=1_000_000)
    assert used < 1_000_000
    _, second, _ = refine(best, costs, budget, 1_000_000, shifts=False)  # plain gap moves
    assert second.makespan == result.makespan
    assert second.end.sum() == result.end.sum()
    if p == 5:
        assert result.makespan == pytest.approx(143.7)


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


def test_the_second_phase_reaches_a_ripple_at_p16_and_is_never_worse():
    """p = 16, m = 128, budget 9: the plain refinement (325 simulations, about 4 million
    actions) leaves V-Half at 485.95; the second phase's 651 more (8 million actions) take it
    to 485.55. The first phase is the plain refinement itself, so the two phases never end
    above it."""
    p, m = 16, 128
    sched = build_schedule("v-half", p, m)
    costs = _moe(p, m)(2 * p)
    evals, then = _refine_evals(p, m), _ripple_evals(p, m)
    assert (evals, then) == (4_000_000 // (6 * p * m), 8_000_000 // (6 * p * m))
    _, plain, used = refine(sched, costs, 9.0, evals)
    assert plain.makespan == pytest.approx(485.95) and used == evals
    best, result, _ = refine(sched, costs, 9.0, evals, then=then)
    assert result.makespan == pytest.approx(485.55)
    assert result.peak_memory.max() <= 9.0
    validate(best)
    _channels_in_order(best)


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
