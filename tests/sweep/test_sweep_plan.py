"""The KBA plan as data: closed-form stage counts, validation, deadlock detection (no MPI)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpipe.sweep.plan import (
    PlanError,
    build_plan,
    closed_form_stages,
    corner_distance,
    simulate,
    validate,
)
from hpcpipe.sweep.plan_view import plan_text, stage_chart, wavefront
from hpcpipe.sweep.quadrature import OCTANTS


def _plan(px, py, z_blocks, angle_blocks, **kw):
    # 2 x 2 cells per rank in x-y; nz and the direction count chosen to give the block counts
    return build_plan(px, py, (2 * px, 2 * py, 2 * z_blocks), 3 * angle_blocks, 2, 3, **kw)


@settings(max_examples=40, deadline=None)
@given(
    px=st.integers(1, 6),
    py=st.integers(1, 6),
    z_blocks=st.integers(1, 3),
    angle_blocks=st.integers(1, 2),
)
def test_simulated_stages_match_closed_forms(px, py, z_blocks, angle_blocks):
    m = z_blocks * angle_blocks
    for order in ("nearest", "yx", "xy"):
        plan = _plan(px, py, z_blocks, angle_blocks, octant_order=order)
        assert plan.tasks_per_octant == m
        sim = validate(plan)
        assert sim.stages == closed_form_stages(px, py, m, order)
        assert sim.efficiency == pytest.approx(8 * m / sim.stages)
    for octant in range(8):
        one = _plan(px, py, z_blocks, angle_blocks, octants=(octant,))
        assert simulate(one).stages == m + (px - 1) + (py - 1)


def test_issue_closed_form_and_auto_order():
    # 8M + 2(Px-1) + 3(Py-1) for the yx order; auto = nearest: 8M + 2(ceil(Px/2)-1) + ...
    assert closed_form_stages(4, 2, 5, "yx") == 40 + 6 + 3
    assert validate(_plan(4, 2, 5, 1, octant_order="yx")).stages == 49
    assert validate(_plan(2, 4, 5, 1, octant_order="xy")).stages == 8 * 5 + 3 + 6
    assert validate(_plan(4, 2, 5, 1)).stages == 40 + 2
    assert validate(_plan(2, 2, 5, 1)).stages == 40  # four corners at once: no fill at all
    assert validate(_plan(8, 8, 1, 1)).stages == 8 + 12  # 8 + 35 one corner at a time


@pytest.mark.parametrize("px,py", [(2, 1), (3, 2), (4, 4), (5, 3)])
def test_nearest_starts_every_rank_at_its_closest_corner(px, py):
    plan = _plan(px, py, 2, 2)
    assert plan.order == "nearest" and "nearest corners" in plan.describe()
    keys = {str(t): t.tag for t in plan.tasks[0]}
    for r, tasks in enumerate(plan.tasks):
        ix, iy = plan.coords(r)
        distance = [corner_distance(ix, iy, px, py, t.octant) for t in tasks]
        assert distance == sorted(distance) and distance[0] == min(
            corner_distance(ix, iy, px, py, o) for o in range(8)
        )
        assert {str(t): t.tag for t in tasks} == keys  # one tag per task on every rank
        for o, a in {(t.octant, t.angle_block) for t in tasks}:  # z-blocks back to back
            at = [i for i, t in enumerate(tasks) if (t.octant, t.angle_block) == (o, a)]
            assert at == list(range(at[0], at[0] + len(at)))
            assert [tasks[i].z_block for i in at] == sorted(tasks[i].z_block for i in at)


def test_octants_of_a_corner_are_back_to_back():
    plan = _plan(2, 2, 1, 1)
    corners = [OCTANTS[o][:2] for o in plan.octants]
    assert corners[0::2] == corners[1::2]
    assert len(set(corners)) == 4


def test_neighbours_and_tags():
    plan = _plan(3, 2, 2, 1)
    assert plan.coords(4) == (1, 1) and plan.rank_of(1, 1) == 4
    for rank, tasks in enumerate(plan.tasks):
        ix, iy = plan.coords(rank)
        assert len({t.tag for t in tasks}) == len(tasks)
        for t in tasks:
            sx, sy, _ = OCTANTS[t.octant]
            assert (t.recv_x < 0) == (ix - sx not in range(3))
            assert (t.send_y < 0) == (iy + sy not in range(2))
            if t.recv_x >= 0:
                assert plan.coords(t.recv_x) == (ix - sx, iy)
    assert plan.max_tag == 2 * len(plan.tasks[0]) - 1
    assert str(plan.tasks[0][1]) == "o0a0z1"


def test_z_ranges_follow_the_sweep_direction():
    plan = _plan(1, 1, 3, 1)
    up = [plan.z_range(z, 0) for z in range(3)]
    down = [plan.z_range(z, 4) for z in range(3)]  # octant 4 sweeps -z
    assert up == [(0, 2), (2, 4), (4, 6)]
    assert down == up[::-1]


def test_validate_catches_a_missing_receiver():
    plan = _plan(2, 1, 1, 1)
    tasks = [list(ts) for ts in plan.tasks]
    first = next(i for i, t in enumerate(tasks[1]) if t.recv_x >= 0)  # one that receives
    tasks[1][first] = dataclasses.replace(tasks[1][first], recv_x=-1)
    broken = dataclasses.replace(plan, tasks=tuple(tuple(ts) for ts in tasks))
    with pytest.raises(PlanError, match="does not expect it"):
        validate(broken)


def test_simulate_reports_a_deadlock():
    # 2 x 1 ranks; octant 0 flows rank 0 -> 1, octant 1 flows rank 1 -> 0
    plan = _plan(2, 1, 1, 1, octants=(0, 1))
    tasks = [list(ts) for ts in plan.tasks]
    tasks[0].reverse()
    tasks[1].reverse()  # both run octant 1 first: fine, rank 1 starts it
    ok = dataclasses.replace(plan, tasks=tuple(tuple(ts) for ts in tasks))
    assert simulate(ok).stages == 4
    tasks[1].reverse()  # rank 1 wants octant 0 first, rank 0 wants octant 1 first: stuck
    dead = dataclasses.replace(plan, tasks=tuple(tuple(ts) for ts in tasks))
    with pytest.raises(PlanError, match="deadlocks: rank 0 at task 0"):
        simulate(dead)


def test_message_time_lowers_predicted_efficiency():
    plan = _plan(4, 2, 2, 1)
    free = simulate(plan)
    slow = simulate(plan, task_time=1.0, message_time=0.5)
    assert slow.makespan > free.makespan
    assert slow.efficiency < free.efficiency <= 1.0


def test_describe_and_stage_chart_are_readable():
    plan = _plan(2, 2, 2, 1, octant_order="yx")
    text = plan.describe()
    assert "2 x 2 ranks" in text and "M = 2" in text and "octant order" in text
    sim = simulate(plan)
    chart = stage_chart(sim).splitlines()
    assert chart[1].split()[:2] == ["rank", "0"] and len(chart) == 2 + 4
    rows = [line.split()[1] for line in chart[2:]]
    assert rows[0].startswith("00")  # rank 0 starts at once
    assert rows[3].startswith("..0")  # the far corner waits for the wavefront
    assert all(len(r) == sim.stages for r in rows)
    assert wavefront(sim).tolist() == [[0, 1], [1, 2]]
    squeezed = stage_chart(sim, max_width=5).splitlines()
    assert "one column = " in squeezed[0] and all(len(r.split()[1]) <= 5 for r in squeezed[2:])
    nearest = stage_chart(simulate(_plan(2, 2, 2, 1))).splitlines()[2:]
    assert all("." not in line.split()[1] for line in nearest)  # all four corners at once


def test_plan_text_names_the_closed_form_and_efficiency():
    plan = _plan(4, 2, 2, 1)
    text = plan_text(plan, simulate(plan))
    assert "closed form" in text and "parallel efficiency" in text
    assert max(len(line) for line in text.splitlines()) <= 120


@pytest.mark.parametrize(
    "args,match",
    [
        ((3, 1, (8, 4, 4), 3), "nx = 8 cells cannot be split evenly over 3 ranks"),
        ((1, 3, (8, 4, 4), 3), "ny = 4 cells cannot be split evenly over 3 ranks"),
        ((1, 1, (8, 4, 4), 3, 3), "z_block = 3 does not divide nz = 4"),
        ((1, 1, (8, 4, 4), 3, 0, 2), "angle_block = 2 does not divide the 3 directions"),
    ],
)
def test_bad_blocking_is_a_clear_error(args, match):
    with pytest.raises(PlanError, match=match):
        build_plan(*args)
