"""The layout search against brute force on small worlds, and its deck-level behaviour."""

from __future__ import annotations

import functools
import itertools

import pytest
from test_layout_cost import _work

from hpcpipe.layout.cost import Layout, Workload, layout_cost, predict
from hpcpipe.layout.machine import Link, Machine
from hpcpipe.layout.search import VIRTUAL_STAGES, divisors, search_layouts
from hpcpipe.layout.shapes import UnitShape
from hpcpipe.model.models import balance_placement
from hpcpipe.schedules import build_schedule
from hpcpipe.schedules.registry import SCHEDULE_NAMES, stages_per_rank
from hpcpipe.topology import DIMS

INTRA = Link(latency=2e-6, bandwidth=50e9, alltoall_bandwidth=40e9)
INTER = Link(latency=10e-6, bandwidth=5e9, alltoall_bandwidth=3e9)


def _machine(memory: float = 1e12, rpn: int = 4) -> Machine:
    return Machine(ranks_per_node=rpn, memory_bytes=memory, flops=1e12, intra=INTRA, inter=INTER)


def _units(n: int = 8, moe_every: int = 2) -> list[UnitShape]:
    out = [UnitShape("Embedding", 20_000, 0, 100, 8, False)]
    for i in range(n):
        moe = moe_every and (i + 1) % moe_every == 0
        out.append(UnitShape("Block", 300_000, 2_000_000 if moe else 0, 600_000, 20_000, bool(moe)))
    out.append(UnitShape("LossHead", 20_000, 0, 50_000, 3_000, False))
    return out


def _split(units):
    weights = [u.flops_per_token for u in units]

    def split(n_stages, placement):
        return balance_placement(weights, n_stages, placement)

    return split


def _brute_force(work, machine, world, experts):
    """Every candidate simulated: the ranking the search must reproduce. Orders that cross
    nodes with the same groups cost the same; one of each is kept, as the search does."""
    split = _split(work.units)
    build = functools.cache(build_schedule)
    found = {}
    for pp in divisors(world):
        dp = world // pp
        if work.global_batch % dp:
            continue
        rows = work.global_batch // dp
        # m: every divisor of the rows in [pp, 8 pp] (else the largest below pp), and rows
        ms = [d for d in range(pp, 8 * pp + 1) if rows % d == 0] or [
            max(d for d in range(1, pp + 1) if rows % d == 0)
        ]
        ms = ms if rows in ms else [*ms, rows]
        eps = [e for e in divisors(dp) if experts % e == 0] if experts else [1]
        for ep, order, m, name in itertools.product(eps, itertools.permutations(DIMS), ms,
                                                    SCHEDULE_NAMES):  # fmt: skip
            for v in VIRTUAL_STAGES if name == "interleaved-1f1b" else (None,):
                n_stages = pp * stages_per_rank(name, v)
                if n_stages > len(work.units):
                    continue
                try:
                    sched = build(name, pp, m, v)
                except ValueError:
                    continue
                layout = Layout(pp, dp, ep, order, name, v, m)
                cost = layout_cost(
                    work, machine, world, layout, sched,
                    tuple(split(n_stages, sched.stages_of_rank)),
                )  # fmt: skip
                if cost.memory.max() <= machine.memory_bytes:
                    key = (pp, ep, name, v, m, tuple(cost.crosses.values()))
                    pred = predict(cost)
                    found.setdefault(key, (pred.step, pred.memory, layout))
    return sorted(found.values())


@pytest.mark.parametrize(
    "world, experts, memory, top",
    [(8, 4, 1e12, 8), (8, 0, 1e12, 3), (8, 0, 1e12, 12), (16, 4, 6e7, 8)],
)
def test_search_finds_what_brute_force_finds(world, experts, memory, top):
    work = _work(_units(moe_every=2 if experts else 0), batch=32, top_k=2 if experts else 0)
    machine = _machine(memory)
    result = search_layouts(
        work, machine, world, experts=experts, top=top, partition=_split(work.units)
    )
    brute = _brute_force(work, machine, world, experts)
    assert len(brute) > top  # a ranking, not a trivial one
    if memory < 1e9:
        assert result.rejected["memory"].count > 0  # and the budget binds
    assert len(result.ranked) == min(top, len(brute))
    # the same layouts in the same order, ties (equal steps are common) broken the same way
    assert [c.layout for _, c in result.ranked] == [lay for _, _, lay in brute[:top]]
    assert [p.step for p, _ in result.ranked] == [s for s, _, _ in brute[:top]]
    assert result.simulated <= result.candidates


def test_memory_rejections_say_which_rank_needs_what():
    work = _work(_units(), batch=64, top_k=2)
    result = search_layouts(work, _machine(6e7), 16, experts=4, top=3, partition=_split(work.units))
    memory = result.rejected["memory"]
    assert memory.count > 0
    assert "needs" in memory.example and "GiB" in memory.example and "rank" in memory.example
    assert all(c.memory.max() <= 6e7 for _, c in result.ranked)


def test_nothing_fits_gives_an_empty_ranking_with_the_reasons():
    work = _work(_units(), batch=64, top_k=2)
    result = search_layouts(work, _machine(1e3), 8, experts=4, top=3, partition=_split(work.units))
    assert result.ranked == []
    assert result.rejected["memory"].count > 0


def test_search_is_deterministic():
    work = _work(_units(), batch=64, top_k=2)
    runs = [
        [c.layout for _, c in search_layouts(
            work, _machine(), 16, experts=4, top=5, partition=_split(work.units)
        ).ranked]
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1]


def test_the_order_decides_which_traffic_crosses_nodes():
    """pp inside a node: its messages are fast and the gradient reduction crosses; the other
    way round the pipeline waits on slow hops and the reduction is quick."""
    units = [UnitShape("Block", 1_000_000, 0, 10_000_000, 1000, False) for _ in range(8)]
    work = Workload(tuple(units), 64, 8, 4096, 4, 2)  # 128 KiB of activations per row
    machine = _machine()
    sched = build_schedule("1f1b", 2, 4)
    split = tuple(_split(work.units)(2, sched.stages_of_rank))
    got = {}
    for order in (("pp", "dp", "ep"), ("dp", "ep", "pp")):
        layout = Layout(2, 4, 1, order, "1f1b", None, 4)
        cost = layout_cost(work, machine, 8, layout, sched, split)
        got[order[0]] = (cost, predict(cost))
    (inside, p_inside), (across, p_across) = got["pp"], got["dp"]
    assert not inside.crosses["pp"] and inside.crosses["dp"]
    assert across.crosses["pp"] and not across.crosses["dp"]
    assert p_across.makespan > p_inside.makespan  # slow hops
    assert (inside.reduce > across.reduce).all()  # slow reduction
    assert p_inside.compute == p_across.compute


def test_rank_correlation_by_hand():
    from hpcpipe.bench.layout import rank_correlation

    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: a -> [0, 1.5, 1.5, 3], b -> [0, 2, 1, 3]
    ra, rb = [-1.5, 0.0, 0.0, 1.5], [-1.5, 0.5, -0.5, 1.5]
    expect = (
        sum(x * y for x, y in zip(ra, rb, strict=True))
        / (sum(x * x for x in ra) * sum(y * y for y in rb)) ** 0.5
    )
    assert rank_correlation([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(expect)


def test_searched_schedules_are_never_slower_than_the_fixed_ones_they_start_from():
    """`auto`: the schedule search seeds with every fixed schedule, so under the same costs
    its pipeline is at most as long as theirs for the same degrees, order and m."""
    work = _work(_units(), batch=32, top_k=2)
    plain = search_layouts(work, _machine(), 8, experts=4, top=40, partition=_split(work.units))
    result = search_layouts(
        work, _machine(), 8, experts=4, top=40, partition=_split(work.units), auto=2
    )
    searched = [(p, c) for p, c in result.ranked if c.layout.schedule == "auto"]
    assert searched, "the schedule search found nothing that fits"
    for pred, cost in searched:
        lay = cost.layout
        same = [
            p.makespan
            for p, c in plain.ranked
            if (c.layout.pp, c.layout.dp, c.layout.ep, c.layout.order, c.layout.m)
            == (lay.pp, lay.dp, lay.ep, lay.order, lay.m)
        ]
        assert same and pred.makespan <= min(same) * (1 + 1e-9)
        assert cost.memory.max() <= _machine().memory_bytes
    steps = [p.step for p, _ in result.ranked]
    assert steps == sorted(steps)


def test_groups_that_must_stay_inside_a_node_rule_orders_out():
    work = _work(_units(), batch=32, top_k=2)
    result = search_layouts(
        work, _machine(), 16, experts=4, top=50, partition=_split(work.units),
        keep_inside=("ep",),
    )  # fmt: skip
    assert result.rejected["intra_node"].count > 0
    assert "ep groups cross nodes" in result.rejected["intra_node"].example
    assert all(not c.crosses["ep"] or c.layout.ep == 1 for _, c in result.ranked)
