"""Pipelines without a flush: update points, weight versions, memory and steady state.

The version tables are checked against a plain walk over each rank's actions written here (a
second derivation, by counting, of what the module computes with array operations), and
against the published facts of weight stashing: under 1F1B with an update per microbatch
stage s keeps p - s versions (PipeDream, Narayanan et al. 2019), and with a window as long as
the pipeline two (PipeDream-2BW, Narayanan et al. 2021).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.schedules import SCHEDULE_NAMES, CostModel, Kind, build_schedule, simulate
from hpcpipe.schedules.flushfree import flush_free, plan_updates, steady_state


def walk(schedule, window):
    """(version, landing, peak versions) by stepping through every rank's actions in order."""
    m, n = schedule.num_microbatches, schedule.num_stages
    version = np.full((n, m), -1)
    landing = [[] for _ in range(n)]
    peak = [1] * n
    for rank in range(schedule.num_ranks):
        compute = [
            a for a in schedule.rank_actions(rank) if a.kind in (Kind.F, Kind.B, Kind.W, Kind.BW)
        ]
        newest = {s: 0 for s in schedule.stages_of_rank[rank]}
        grads = {s: {} for s in newest}  # window -> weight gradients done
        in_flight = {s: {} for s in newest}  # microbatch -> version it reads
        for pos, a in enumerate(compute):
            s, j = a.stage, a.microbatch
            if a.kind == Kind.F:
                version[s, j] = newest[s]
                in_flight[s][j] = newest[s]
            if a.kind in (Kind.W, Kind.BW):
                del in_flight[s][j]
                grads[s][j // window] = grads[s].get(j // window, 0) + 1
                while grads[s].get(newest[s], 0) == window:  # complete and next in order
                    landing[s].append(pos)
                    newest[s] += 1
            peak[s] = max(peak[s], len(set(in_flight[s].values()) | {newest[s]}))
    return version, np.array(landing), np.array(peak)


def cases():
    for name in SCHEDULE_NAMES:
        for p in (2, 3, 4):
            for window, updates in ((1, 2 * p), (2, p), (p, 3)):
                yield pytest.param(name, p, window, updates, id=f"{name}-p{p}-w{window}")


@pytest.mark.parametrize(("name", "p", "window", "updates"), list(cases()))
def test_versions_and_updates_match_a_walk_over_the_actions(name, p, window, updates):
    schedule = build_schedule(name, p, window * updates)  # every generator builds these
    plan = plan_updates(schedule, window)
    version, landing, peak = walk(schedule, window)
    np.testing.assert_array_equal(plan.version, version)
    np.testing.assert_array_equal(plan.landing, landing)
    np.testing.assert_array_equal(plan.peak_versions, peak)
    assert (plan.delay >= 0).all()


def test_two_stage_1f1b_by_hand():
    plan = flush_free("1f1b", 2, window=1, updates=4)
    # rank 0: F0 F1 BW0 F2 BW1 F3 BW2 BW3; rank 1: F0 BW0 F1 BW1 F2 BW2 F3 BW3
    np.testing.assert_array_equal(plan.version, [[0, 0, 1, 2], [0, 1, 2, 3]])
    np.testing.assert_array_equal(plan.landing, [[2, 4, 6, 7], [1, 3, 5, 7]])
    np.testing.assert_array_equal(plan.delay, [[0, 1, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(plan.peak_versions, [2, 1])


@pytest.mark.parametrize("p", [2, 4, 8])
def test_weight_stashing_keeps_one_version_per_microbatch_in_flight(p):
    plan = flush_free("1f1b", p, window=1, updates=4 * p)
    np.testing.assert_array_equal(plan.peak_versions, [p - s for s in range(p)])
    np.testing.assert_array_equal(plan.delay.max(axis=1), [p - 1 - s for s in range(p)])


@pytest.mark.parametrize("p", [3, 4, 8])
def test_a_window_as_long_as_the_pipeline_needs_two_versions(p):
    """(p = 2 stashes two versions even with an update per microbatch.)"""
    plan = flush_free("1f1b", p, window=p, updates=6, max_versions=2)
    assert plan.peak_versions.max() == 2
    assert plan.delay.max() == 1  # 2BW: the gradient of version k - 1 updates version k
    with pytest.raises(ValueError, match=r"holds \d+ weight versions.*longer window"):
        flush_free("1f1b", p, window=1, updates=6, max_versions=2)


def test_version_bytes_add_up_the_stages_of_each_rank():
    plan = flush_free("zb-v", 4, window=8, updates=4)
    per_rank = plan.version_bytes(np.full(plan.num_stages, 1000.0))
    expected = np.zeros(4)
    for s, r in enumerate(plan.schedule.rank_of_stage):
        expected[r] += 1000.0 * plan.peak_versions[s]
    np.testing.assert_allclose(per_rank, expected)


def test_without_a_flush_1f1b_runs_at_the_no_bubble_bound_and_beats_every_flush():
    """The issue's target: 8 ranks, a window of m = 2p, synthetic unit costs."""
    p, m = 8, 16
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)
    plan = flush_free("1f1b", p, window=m, updates=8, max_versions=2)
    ours = steady_state(plan, costs).efficiency
    assert ours >= 0.97
    stream_peak = simulate(plan.schedule, costs).peak_memory.max()
    for name in SCHEDULE_NAMES:
        try:
            sync = simulate(build_schedule(name, p, m), costs)
        except ValueError:
            continue
        synchronous = float(sync.busy.max() / sync.makespan)  # steps back to back, each flushed
        if sync.peak_memory.max() <= stream_peak:
            assert ours > synchronous, name


def test_uneven_stages_are_held_to_the_bound_of_the_slowest():
    costs = CostModel(t_f=[1, 1, 2, 1], t_b=[1, 1, 2, 1], t_w=[1, 1, 2, 1])
    plan = flush_free("1f1b", 4, window=8, updates=8)
    state = steady_state(plan, costs)
    assert state.efficiency == pytest.approx(1.0, abs=0.02)
    assert state.microbatches_per_time == pytest.approx(1 / 6, rel=0.02)


def test_window_must_divide_the_stream():
    with pytest.raises(ValueError, match="window = 3 must divide"):
        plan_updates(build_schedule("1f1b", 2, 8), 3)
    with pytest.raises(ValueError, match="must both be >= 1"):
        flush_free("1f1b", 2, window=0, updates=4)
