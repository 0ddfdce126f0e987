"""Never behind the published generators: V-Half, V-Min, ZB-V and ZB-H2 at every p and m.

The figures below are makespans under unit costs (F = B = W = 1 per full stage, a V chunk
half of it; communication free) of the orders the authors' generators produce (Qi et al.,
zero-bubble-pipeline-parallelism: the V-Half / V-Min building-block generator and the ZB-V
greedy), timed by our simulator. `hpcpipe.schedules.blocks` and `hpcpipe.schedules.vgreedy`
implement those two constructions; they must reproduce the figures exactly, and our
generators must be at least as fast at the same peak memory, for every m, odd p included.
"""

from __future__ import annotations

import pytest

from hpcpipe.schedules import build_schedule, simulate, validate
from hpcpipe.schedules.blocks import compacted_v, half_block, min_block
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.listsched import unit_costs
from hpcpipe.schedules.vgreedy import v_greedy_orders

# (p, [m = p, 2p, 4p]) -> makespan of the published generator's order
PUBLISHED = {
    "v-half": {
        2: (7.5, 12.5, 24.5),
        3: (11.5, 20.5, 38.5),
        4: (17, 26.5, 50.5),
        5: (22, 35.5, 65.5),
        8: (32.5, 56.5, 104.5),
        16: (68.5, 116.5, 212.5),
    },
    "v-min": {
        2: (7.5, 13.5, 25.5),
        3: (13, 20.5, 38.5),
        4: (17.5, 29.5, 53.5),
        5: (22.5, 37.5, 67.5),
        8: (37.5, 61.5, 109.5),
        16: (77.5, 125.5, 221.5),
    },
    "zb-v": {
        2: (6.5, 12.5, 24.5),
        3: (10, 19, 37),
        4: (13.5, 25.5, 49.5),
        5: (17, 32, 62),
        8: (27.5, 51.5, 99.5),
        16: (55.5, 103.5, 199.5),
    },
}
ZB_V_GAPS = {
    (5, 2): 0.5,
    (7, 2): 0.5,
    (7, 3): 0.5,
    (8, 2): 0.5,
    (8, 3): 1.0,
    (16, 2): 0.5,
    (16, 3): 1.0,
    (16, 4): 1.5,
    (16, 5): 2.0,
    (16, 6): 2.0,
    (16, 7): 1.0,
}
"""(p, m) -> how far ZB-V stays above the bound there (makespan units), as measured."""
PEAK = {"v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3, "zb-v": lambda p: p}


def span(sched, p: int) -> tuple[float, float]:
    result = simulate(sched, unit_costs(p)(sched.num_stages))
    return result.makespan, float(result.peak_memory.max())


def published_method(name: str, p: int, m: int):
    if name == "v-half":
        return [compacted_v(name, p, m, half_block(p))]
    if name == "v-min":
        return [compacted_v(name, p, m, min_block(p))]
    return v_greedy_orders(p, m, 2 * p)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("p", sorted(PUBLISHED["zb-v"]))
def test_our_constructions_reproduce_the_published_figures(name, p):
    for m, figure in zip((p, 2 * p, 4 * p), PUBLISHED[name][p], strict=True):
        best = min(span(s, p)[0] for s in published_method(name, p, m))
        assert best == pytest.approx(figure), (name, p, m)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 11, 16])
def test_never_behind_at_any_m(name, p):
    for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p, 4 * p} - {0}):
        ours = build_schedule(name, p, m)
        validate(ours)
        mine, peak = span(ours, p)
        assert peak <= PEAK[name](p) + 1e-9, (name, p, m, peak)
        for other in published_method(name, p, m):
            theirs, their_peak = span(other, p)
            if their_peak <= peak + 1e-9:
                assert mine <= theirs + 1e-9, (name, p, m, mine, theirs)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 16])
def test_zb_h2_and_zb_v_reach_the_bound_for_small_m(p):
    # with fewer microbatches than the hand-written orders need (2p-1), the generators fall
    # back to the greedy constructions. ZB-H2 reaches the lower bound for every m; ZB-V too
    # but for m < p/2 + 1 on five or more ranks, where it stays up to 2 units above (the
    # published ZB-V greedy is no faster there: test_never_behind_at_any_m)
    for name in ("zb-h2", "zb-v"):
        for m in range(1, 2 * p):
            sched = build_schedule(name, p, m)
            validate(sched)
            costs = unit_costs(p)(sched.num_stages)
            result = simulate(sched, costs)
            bound = lower_bound(sched.stages_of_rank, m, costs, float(result.peak_memory.max()))
            known = ZB_V_GAPS.get((p, m), 0.0) if name == "zb-v" else 0.0
            assert result.makespan <= bound.makespan + known + 1e-9, (
                name,
                p,
                m,
                result.makespan,
                bound.makespan,
            )


def test_the_issue_table_is_closed():
    # the figures that were behind: V-Half 29/53/101 at p=4 and 36/60/108 at p=8, ZB-V 31 and
    # ZB-H2 34 at p=m=8
    assert [span(build_schedule("v-half", 4, m), 4)[0] for m in (8, 16, 32)] == [26.5, 50.5, 98.5]
    assert [span(build_schedule("v-half", 8, m), 8)[0] for m in (8, 16, 32)] == [32.5, 56.5, 104.5]
    assert span(build_schedule("zb-v", 8, 8), 8) == (27.5, 8.0)
    assert span(build_schedule("zb-h2", 8, 8), 8) == (31.0, 8.0)
