"""The layout cost model against hand-computed cases and the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.layout.cost import (
    Layout,
    Workload,
    alltoall,
    crossings,
    layout_cost,
    peak_live,
    predict,
    ring,
)
from hpcpipe.layout.machine import Link, Machine
from hpcpipe.layout.shapes import UnitShape
from hpcpipe.schedules import CostModel, build_schedule, simulate

INTRA = Link(latency=1e-6, bandwidth=100e9, alltoall_bandwidth=50e9)
INTER = Link(latency=5e-6, bandwidth=10e9, alltoall_bandwidth=5e9)
MACHINE = Machine(ranks_per_node=4, memory_bytes=1e12, flops=1e12, intra=INTRA, inter=INTER)


def _unit(flops: int, params: int = 1000, expert: int = 0, act: int = 100) -> UnitShape:
    return UnitShape("U", params, expert, flops, act, moe=expert > 0)


def _work(units: list[UnitShape], batch: int = 16, top_k: int = 0) -> Workload:
    return Workload(
        units=tuple(units),
        global_batch=batch,
        seq_len=8,
        d_model=32,
        dtype_bytes=4,
        optimizer_states=2,
        top_k=top_k,
    )


def test_ring_and_alltoall_formulas():
    assert ring(1, 1e9, INTRA) == 0.0
    assert ring(4, 4e9, INTRA) == pytest.approx(6 * 1e-6 + 1.5 * 4e9 / 100e9)
    assert alltoall(1, 1e6, INTER) == 0.0
    assert alltoall(4, 4e6, INTER) == pytest.approx(3 * 5e-6 + 0.75 * 4e6 / 5e9)


@pytest.mark.parametrize(
    "order, expect",
    [
        # world 8 = pp 2 x dp 4 on nodes of 4: the innermost dim gets consecutive ranks
        (("pp", "dp", "ep"), {"pp": False, "dp": True, "ep": False, "edp": True}),
        (("dp", "ep", "pp"), {"pp": True, "dp": False, "ep": False, "edp": False}),
    ],
)
def test_crossings_follow_the_order(order, expect):
    layout = Layout(pp=2, dp=4, ep=1, order=order, schedule="1f1b", v=None, m=2)
    assert crossings(8, 4, layout) == expect


def test_crossings_with_experts_agree_with_the_rank_map():
    from hpcpipe.topology import RankMap

    for order in (("ep", "dp", "pp"), ("pp", "ep", "dp"), ("dp", "pp", "ep")):
        layout = Layout(pp=2, dp=8, ep=2, order=order, schedule="1f1b", v=None, m=2)
        got = crossings(16, 4, layout)
        rm = RankMap.build(16, 4, pp=2, dp=8, ep=2, order=",".join(order))
        assert got["pp"] == rm.crosses_nodes("pp")
        assert got["dp"] == rm.crosses_nodes("dp")
        assert got["ep"] == rm.crosses_nodes("ep")
        nodes = np.arange(16) // 4
        edp = any(
            len({int(nodes[r]) for r in rm.expert_data_group(rank)}) > 1 for rank in range(16)
        )
        assert got["edp"] == edp


def test_two_stage_costs_by_hand():
    """pp 2 x dp 2, 1F1B, m 2: 16 rows / (2 x 2) = 4 rows of 8 tokens per microbatch."""
    units = [_unit(10, params=100), _unit(30, params=300, expert=800, act=50), _unit(20)]
    work = _work(units, top_k=2)
    layout = Layout(pp=2, dp=2, ep=2, order=("ep", "dp", "pp"), schedule="1f1b", v=None, m=2)
    sched = build_schedule("1f1b", 2, 2)
    cost = layout_cost(work, MACHINE, 4, layout, sched, (range(0, 1), range(1, 3)))
    tokens = 4 * 8
    np.testing.assert_allclose(cost.compute, [tokens * 10 / 1e12, tokens * 50 / 1e12])
    # one MoE block on stage 1: dispatch + combine of 32 tokens x top 2 x 32 floats, ep 2
    a2a = 2 * (1e-6 + 0.5 * tokens * 2 * 32 * 4 / 50e9)
    np.testing.assert_allclose(cost.alltoall, [0.0, a2a])
    assert cost.costs.message_bytes == tokens * 32 * 4
    assert cost.crosses == {"pp": False, "dp": False, "ep": False, "edp": False}
    # dense over dp 2, experts / ep over the 1 replica of each shard (nothing to reduce)
    np.testing.assert_allclose(cost.reduce, [ring(2, 100 * 4, INTRA), ring(2, 1300 * 4, INTRA)])
    per_param = 4 * (2 + 2)
    np.testing.assert_allclose(cost.static_bytes, [100 * per_param, (1300 + 400) * per_param])
    np.testing.assert_allclose(cost.activation, [tokens * 100, tokens * 150])
    # 1F1B at p 2: rank 0 holds 2 microbatches at most, rank 1 one
    np.testing.assert_allclose(cost.peak_activation, [2 * tokens * 100, tokens * 150])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min"])
def test_peak_live_equals_the_simulators_peak(name):
    sched = build_schedule(name, 4, 8)
    act = np.arange(1.0, sched.num_stages + 1.0)
    sim = simulate(sched, CostModel(activation=act))
    np.testing.assert_allclose(peak_live(sched, act), sim.peak_memory)


def test_prediction_is_the_simulation_plus_exposed_reductions():
    units = [_unit(1_000_000, params=10**9) for _ in range(4)]
    work = _work(units)
    layout = Layout(pp=2, dp=2, ep=1, order=("dp", "ep", "pp"), schedule="1f1b", v=None, m=4)
    sched = build_schedule("1f1b", 2, 4)
    cost = layout_cost(work, MACHINE, 4, layout, sched, (range(0, 2), range(2, 4)))
    pred = predict(cost)
    sim = simulate(sched, cost.costs)
    assert pred.makespan == sim.makespan
    # each rank's reduction starts at its last W: rank 1 (last stage) finishes its W first
    last_w = [float(sim.end[sim.offsets[r + 1] - 1]) for r in range(2)]
    ends = [last_w[r] + cost.reduce[r] for r in range(2)]
    assert pred.step == pytest.approx(max(max(ends), sim.makespan))
    assert pred.reduce_exposed == pytest.approx(pred.step - sim.makespan)
    assert pred.compute == pytest.approx(3 * 4 * cost.compute[0])
    assert pred.idle == pytest.approx(sim.makespan - pred.compute)


def test_message_wait_is_what_free_messages_would_save():
    from hpcpipe.layout.report import _message_wait

    units = [_unit(1_000_000, params=10) for _ in range(4)]
    work = _work(units)
    layout = Layout(pp=2, dp=2, ep=1, order=("dp", "ep", "pp"), schedule="1f1b", v=None, m=4)
    sched = build_schedule("1f1b", 2, 4)
    split = (range(0, 2), range(2, 4))
    cost = layout_cost(work, MACHINE, 4, layout, sched, split)
    pred = predict(cost)
    free = simulate(sched, CostModel(t_f=cost.costs.t_f, t_b=cost.costs.t_b, t_w=cost.costs.t_w))
    assert _message_wait(cost, pred) == pytest.approx(pred.makespan - free.makespan)
    assert _message_wait(cost, pred) > 0  # pp crosses nodes here: 8 tokens x 32 floats, slowly
