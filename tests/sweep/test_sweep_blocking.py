"""The KBA blocking model: its closed form equals the plan simulator, the choice keeps what
the deck gives, picks what the costs call for, and is what a deck with 0 gets; Kripke's deck
is Kripke's problem. Pure: no MPI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpipe.config import load_config
from hpcpipe.sweep.blocking import (
    KERNEL_COSTS,
    MAX_TASKS,
    SweepCost,
    choose_blocking,
    describe_blocking,
    predict_makespan,
)
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.plan import blocking_for, build_plan, plan_for, simulate
from hpcpipe.sweep.problems import KRIPKE_BOXES, kripke_config

INPUTS = Path(__file__).resolve().parents[2] / "inputs"


@settings(max_examples=60, deadline=None)
@given(
    px=st.integers(1, 4),
    py=st.integers(1, 4),
    z_blocks=st.sampled_from([1, 2, 4]),
    angle_blocks=st.sampled_from([1, 3]),
    order=st.sampled_from(["nearest", "yx", "xy"]),
    per_task=st.floats(0.0, 1e-3),
    per_unknown=st.floats(1e-10, 1e-8),
    message=st.floats(0.0, 1e-3),
)
def test_closed_form_equals_the_simulator(
    px, py, z_blocks, angle_blocks, order, per_task, per_unknown, message
):
    shape, directions, groups = (2 * px, 3 * py, 4), 3, 2
    zb, ab = 4 // z_blocks, directions // angle_blocks
    cost = SweepCost(per_unknown=per_unknown, per_task=per_task, message=message, per_byte=1e-9)
    plan = build_plan(px, py, shape, directions, zb, ab, order)
    local = plan.local_shape
    t = cost.task_seconds((local[0], local[1], zb), ab, groups)
    face = max(local[1] if px > 1 else 0, local[0] if py > 1 else 0) * zb
    m = cost.message_seconds(face, ab, groups) if px * py > 1 else 0.0
    want = simulate(plan, t, m).makespan
    got = predict_makespan(px, py, local, directions, groups, zb, ab, cost, order)
    if order != "nearest" or m <= t:
        assert got == pytest.approx(want, rel=1e-12)
    else:  # a face slower than a task: the corners' meeting waits longer than the hops say
        assert got <= want * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(
    px=st.integers(1, 5),
    py=st.integers(1, 5),
    z_blocks=st.sampled_from([1, 2, 4]),
    order=st.sampled_from(["nearest", "yx", "xy"]),
    copy=st.floats(1e-11, 1e-9),
    message=st.floats(0.0, 1e-5),
)
def test_face_copies_in_the_model_match_the_simulator(px, py, z_blocks, order, copy, message):
    """A face's copy into the receiving rank, charged to every task that receives one: the
    closed form equals the simulator on up to 2 x 2 ranks under `nearest` and bounds it
    within 6% from above everywhere else."""
    shape, directions, groups = (2 * px, 3 * py, 4), 3, 2
    zb = 4 // z_blocks
    cost = SweepCost(per_unknown=1e-9, per_task=1e-5, message=message, copy_per_byte=copy)
    plan = build_plan(px, py, shape, directions, zb, directions, order)
    bx, by, _ = plan.local_shape
    t = cost.task_seconds((bx, by, zb), directions, groups)
    face = max(by if px > 1 else 0, bx if py > 1 else 0) * zb
    m = cost.message_seconds(face, directions, groups) if px * py > 1 else 0.0
    copies = (
        cost.copy_seconds(by * zb, directions, groups),
        cost.copy_seconds(bx * zb, directions, groups),
    )
    want = simulate(plan, t, m, copies).makespan
    got = predict_makespan(
        px, py, plan.local_shape, directions, groups, zb, directions, cost, order
    )
    assert m <= t  # the regime the closed form is exact in (test above)
    if order == "nearest" and px <= 2 and py <= 2:
        assert got == pytest.approx(want, rel=1e-12)
    else:
        assert want * (1 - 1e-12) <= got <= 1.06 * want


def test_one_rank_takes_whole_octants_and_given_sizes_are_kept():
    cost = KERNEL_COSTS["numba"]
    one = choose_blocking(1, 1, (32, 32, 32), 10, 8, cost)
    assert (one.z_block, one.angle_block, one.chosen) == (32, 10, True)
    kept = choose_blocking(4, 1, (32, 32, 32), 10, 8, cost, z_block=4, angle_block=5)
    assert (kept.z_block, kept.angle_block, kept.chosen) == (4, 5, False)
    half = choose_blocking(4, 1, (32, 32, 32), 10, 8, cost, z_block=8)
    assert half.z_block == 8 and 10 % half.angle_block == 0 and half.chosen


def test_the_choice_follows_the_costs():
    free_tasks = SweepCost(per_unknown=1e-9, per_task=0.0)
    dear_tasks = SweepCost(per_unknown=1e-9, per_task=1.0)
    fine = choose_blocking(8, 1, (64, 32, 32), 10, 8, free_tasks)
    coarse = choose_blocking(8, 1, (64, 32, 32), 10, 8, dear_tasks)
    assert (fine.z_block, fine.angle_block) == (1, 1)  # fill costs, tasks do not: smallest
    assert (coarse.z_block, coarse.angle_block) == (32, 10)
    assert 0 < coarse.busy <= 1 and coarse.seconds > fine.seconds


def test_the_choice_never_needs_more_tags_than_mpi_guarantees():
    b = choose_blocking(2, 1, (4, 4, 4096), 80, 1, SweepCost(per_unknown=1e-9, per_task=0.0))
    assert 8 * (4096 // b.z_block) * (80 // b.angle_block) <= MAX_TASKS


def test_a_deck_with_zero_gets_the_models_blocking():
    cfg = dataclasses.replace(kripke_config(), px=2)
    problem = build_problem(cfg)
    blocking = blocking_for(cfg, problem, "numba")
    plan = plan_for(cfg, problem, blocking)
    assert (plan.z_block, plan.angle_block) == (
        plan_for(cfg, problem).z_block,
        blocking.angle_block,
    )
    assert (plan.z_block, plan.angle_block) == (blocking.z_block, blocking.angle_block)
    # two ranks under `nearest`: each starts at its own corner, nothing to fill, whole octants
    assert blocking.chosen and plan.tasks_per_octant == 1 and plan.order == "nearest"
    one_at_a_time = blocking_for(dataclasses.replace(cfg, octant_order="yx"), problem, "numba")
    assert one_at_a_time.z_block < 32  # the same corner on both ranks: pipelined, not whole
    assert one_at_a_time.seconds > blocking.seconds
    assert blocking.kernel == "numba" and "numba kernel" in describe_blocking(blocking)
    gpu = blocking_for(cfg, problem, device="cuda")  # the deck's auto runs the cuda kernel there
    assert gpu.kernel == "cuda" and "cuda kernel" in describe_blocking(gpu)
    numpy = blocking_for(cfg, problem, "numpy")
    assert numpy.seconds > blocking.seconds  # the NumPy kernel's costs


def test_kripke_deck_is_kripkes_problem():
    deck = load_config(INPUTS / "sweep_kripke.toml")
    assert deck.sweep == kripke_config()
    ids = build_problem(deck.sweep).material_ids(slice(None), slice(None))
    # 32^3 zones of 3.75 x 6.25 x 3.75 cm: the 20 cm source cube holds 6 x 4 x 6 centres
    assert (ids == 0).sum() == 144 and len(KRIPKE_BOXES) == 16
    assert (ids == 1).sum() > 0 and (ids == 2).sum() > 0.9 * ids.size
