"""The MoE all-to-all term of the cost model: it lengthens F and B and so the predicted step."""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules import build_schedule, simulate
from hpcpipe.schedules.config import PipelineConfig, cost_model


def test_alltoall_time_is_added_to_forward_and_backward():
    cfg = PipelineConfig(t_alltoall=(0.0, 0.5, 0.5, 0.0))  # MoE blocks in the middle stages
    costs = cost_model(cfg, 4, 4).stage_arrays(4)
    assert np.allclose(costs["t_f"], [1.0, 1.5, 1.5, 1.0])
    assert np.allclose(costs["t_b"], [1.0, 1.5, 1.5, 1.0])
    assert np.allclose(costs["t_w"], 1.0)  # W has no exchange


def test_alltoall_lengthens_the_predicted_step_exactly_for_1f1b():
    sched = build_schedule("1f1b", 4, 8)
    dense = simulate(sched, cost_model(PipelineConfig(), 4, 4)).makespan
    moe = simulate(sched, cost_model(PipelineConfig(t_alltoall=(0.25,)), 4, 4)).makespan
    # 1F1B makespan = (m + p - 1) * (F + B + W) for equal stages: each F and B grows by 0.25
    assert dense == 33.0 and moe == (8 + 4 - 1) * 3.5
