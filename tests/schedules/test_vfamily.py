"""The V block family between the published points: every block builds a valid schedule whose
peak is known before it is built, the family fills the budgets V-Min, V-Half and ZB-V skip,
and the search takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcpipe.schedules import build_schedule, simulate, validate
from hpcpipe.schedules.blocks import compacted_v, repeated_peak
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.config import PipelineConfig, costs_for
from hpcpipe.schedules.ir import read_csv
from hpcpipe.schedules.search import search
from hpcpipe.schedules.vfamily import climbs, members, rank_rows, sized
from hpcpipe.schedules.vshape import building_block, v_placement


def _unit(p: int, m: int):
    return costs_for(PipelineConfig(microbatches=m), p)(2 * p)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8])
def test_every_block_is_a_valid_schedule_with_the_peak_known_before_it_is_built(p):
    for m in (p, 2 * p + 1):
        costs = _unit(p, m)
        for climb in climbs(p):
            block = rank_rows(building_block(p, climb), p)
            sched = compacted_v("v-family", p, m, block)
            validate(sched)  # dependencies, every stage's microbatches in order, channels
            assert [tuple(r) for r in sched.stages_of_rank] == v_placement(p)
            peak = float(simulate(sched, costs).peak_memory.max())
            assert peak == repeated_peak(block, m) * 0.5, (climb, m)  # a chunk: half a share


def test_the_family_fills_the_budgets_between_the_published_points():
    """Unit costs, p = 16, m = 16: V-Min takes 77.5 at peak 6 and V-Half 68.5 at peak 9; the
    family's best at each half-step between is strictly between them and falls as the budget
    grows, and at 7 it is at the lower bound (optimal)."""
    p, m = 16, 16
    costs = _unit(p, m)
    v_min = simulate(build_schedule("v-min", p, m), costs).makespan
    v_half = simulate(build_schedule("v-half", p, m), costs).makespan
    assert (v_min, v_half) == (77.5, 68.5)
    best = []
    for budget in (7.0, 7.5, 8.0, 8.5):
        got = members(p, m, costs, budget, 10**9)
        assert got
        results = [simulate(s, costs) for _, s in got]
        assert all(r.peak_memory.max() <= budget for r in results)
        assert {member.chunks for member, _ in got} == {round(2 * budget)}  # the most it holds
        best.append(min(r.makespan for r in results))
    assert v_min > best[0] > best[1] > best[2] > best[3] > v_half, best
    # the last rank alone proves it (exactly, within 300,000 states of its search)
    bound = lower_bound(v_placement(p), m, costs, 7.0, target=best[0], max_states=300_000)
    assert best[0] == bound.makespan == 74.5 and "rank 15 alone" in bound.why


def test_members_keep_to_the_budget_and_the_count_of_actions():
    p, m = 8, 16
    costs = _unit(p, m)
    assert members(p, m, costs, 3.5, 10**9) == []  # below every block's peak (V-Min's: 4)
    assert members(p, m, costs, 4.0, 10**9)
    assert members(1, m, _unit(1, m), None, 10**9) == []
    every = members(p, m, costs, 5.5, 10**9)
    assert len(every) > 2
    assert len(members(p, m, costs, 5.5, 2 * 6 * p * m)) == 2  # two schedules' actions
    assert members(p, m, costs, 5.5, 6 * p * m - 1) == []
    assert members(65, 130, _unit(65, 130), None, 10**9) == []  # above COMPACT_MAX_P
    # few microbatches: blocks that compact alike are built once
    few = members(p, 2, _unit(p, 2), None, 10**9)
    assert len({s.fingerprint() for _, s in few}) == len(few) >= 1
    assert all(member.chunks * 0.5 <= 5.5 for member, _ in every)
    assert "V block family: climb 3 into" in every[0][0].describe()


def test_blocks_are_sized_once_per_p_and_m_and_shared_read_only():
    """A search per budget (a Pareto sweep) takes the sizes of the first call: the same
    blocks and peaks as sizing each climb afresh, and no caller can change them."""
    p, m = 8, 16
    first = sized(p, m)
    assert sized(p, m) is first
    assert [member.climb for member, _ in first] == list(climbs(p))
    for member, block in first:
        fresh = rank_rows(building_block(p, member.climb), p)
        assert (block == fresh).all() and member.chunks == repeated_peak(fresh, m)
        with pytest.raises(ValueError):
            block[0, 0] = -1
    costs = _unit(p, m)
    assert [(a.climb, s.fingerprint()) for a, s in members(p, m, costs, 5.0, 10**9)] == [
        (a.climb, s.fingerprint()) for a, s in members(p, m, costs, 5.0, 10**9)
    ]


def test_building_block_takes_a_climb_per_second_chunk_stage():
    assert (building_block(4, 2) == building_block(4, [2, 2, 2, 2])).all()
    with pytest.raises(ValueError, match="3 climbs for the 4 second-chunk stages"):
        building_block(4, [1, 2, 1])


def test_the_search_beats_v_half_between_its_budget_and_zb_vs():
    """p = 8, m = 64, unit costs, budget 5.5: V-Half (peak 5) takes 200.5 and neither the
    greedy nor refinement finds better; a family block holding 11 chunks takes 199.5."""
    p, m = 8, 64
    found = search(p, m, costs_for(PipelineConfig(microbatches=m), p), 5.5)
    assert found.makespan == 199.5 and found.peak <= 5.5
    assert found.schedule.param("how").startswith("V block family")
    validate(found.schedule)


def test_a_two_sided_mix_beats_v_min_half_a_microbatch_above_its_peak():
    """Unit costs, p = 12, budget 5.5 and p = 15, budget 6.5: every block that mixes its
    steeper stages on one side takes V-Min's makespan or more there, at every m; two stages
    next to the turn and one next to the end take half a unit less (the misses of the
    schedule_search_p9_12 and _p15 figures before), and the search takes it."""
    for p, budget in ((12, 5.5), (15, 6.5)):
        for m in (p, 2 * p, 8 * p):
            costs = _unit(p, m)
            v_min = simulate(build_schedule("v-min", p, m), costs).makespan
            got = {
                member.climb: simulate(sched, costs).makespan
                for member, sched in members(p, m, costs, budget, 10**9)
            }
            two_sided = (2, 2) + (1,) * (p - 3) + (2,)
            assert got[two_sided] == v_min - 0.5, (p, m)
            one_sided = [t for climb, t in got.items() if climb[0] == 1 or climb[-1] == 1]
            assert one_sided and min(one_sided) >= v_min, (p, m)
    found = search(12, 12, costs_for(PipelineConfig(microbatches=12), 12), 5.5)
    assert found.makespan == 56.0 and found.peak <= 5.5
    assert "2 stages next to the turn and 1 stage next to the end" in found.schedule.param("how")


def test_an_order_at_the_bound_exists_where_the_family_stops_at_v_min():
    """p = 16, m = 16, unit costs, budget 6.5: the family's step there takes V-Min's 77.5, but
    the bound, 76, is reached. The order in data/ was found by OR-Tools CP-SAT (by hand, one
    worker, V-Min as a hint; docs/performance.md) with every stage in microbatch order: it is
    a valid schedule the runtime can run, within the budget, at the bound. The search's next
    target."""
    p, m = 16, 16
    costs = _unit(p, m)
    _assert_at_the_bound("p16_m16_budget6.5_optimum.csv", p, m, 6.5, 76.0, 300_000)
    family = [simulate(s, costs).makespan for _, s in members(p, m, costs, 6.5, 10**9)]
    assert min(family) == simulate(build_schedule("v-min", p, m), costs).makespan == 77.5


def test_an_order_at_the_bound_exists_half_a_microbatch_above_v_min_at_p12():
    """p = 12, m = 12, unit costs, budget 5.5: the search takes a two-sided family block's
    56.0 (V-Min 56.5; no refinement or kick improves either), yet the bound, 55 (the last rank
    alone, exactly), is reached. The order in data/ was found by OR-Tools CP-SAT (by hand, one
    worker, 85 s, F and B of every stage in microbatch order; docs/performance.md): its ranks
    run 8 to 11 forwards before their first backward (V-Min 10 on every rank) and defer W in
    bursts. The search's next target at p = 12."""
    p, m = 12, 12
    _assert_at_the_bound("p12_m12_budget5.5_optimum.csv", p, m, 5.5, 55.0, 100_000)
    assert simulate(build_schedule("v-min", p, m), _unit(p, m)).makespan == 56.5


def test_an_order_at_the_bound_exists_half_a_microbatch_above_v_min_at_p15():
    """p = 15, m = 15, unit costs, budget 6.5: the same place as p = 12's (the search takes a
    two-sided family block's 71.0, V-Min 71.5, bound 70). CP-SAT by hand (one worker, F and B
    of every stage in microbatch order, asked for at most 70: 226 s) finds an order at the
    bound; kept in data/ as the search's target at p = 15."""
    p, m = 15, 15
    _assert_at_the_bound("p15_m15_budget6.5_optimum.csv", p, m, 6.5, 70.0, 100_000)
    assert simulate(build_schedule("v-min", p, m), _unit(p, m)).makespan == 71.5


def _assert_at_the_bound(
    name: str, p: int, m: int, budget: float, makespan: float, states: int
) -> None:
    """The order kept in data/`name` is valid, simulates to `makespan` within `budget` under
    unit costs, and the lower bound of the V placement is that makespan: it is optimal."""
    costs = _unit(p, m)
    known = read_csv(Path(__file__).with_name("data") / name)
    validate(known)
    result = simulate(known, costs)
    assert result.makespan == makespan and result.peak_memory.max() <= budget
    bound = lower_bound(v_placement(p), m, costs, budget, target=makespan, max_states=states)
    assert bound.makespan == makespan
