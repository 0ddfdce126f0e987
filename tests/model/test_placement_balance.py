"""Stage partitioning balanced over ranks for multi-stage placements (V shapes, interleaved)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpipe.model.models import balance, balance_placement


def rank_max(weights, ranges, placement):
    loads = [sum(sum(weights[i] for i in ranges[s]) for s in row) for row in placement]
    return max(loads)


def brute_force(weights, n_stages, placement):
    n = len(weights)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = [0, *cuts, n]
        ranges = [range(a, b) for a, b in itertools.pairwise(bounds)]
        best = min(best, rank_max(weights, ranges, placement))
    return best


def v_placement(p):
    return [(r, 2 * p - 1 - r) for r in range(p)]


@pytest.mark.parametrize(("p", "blocks"), [(2, 6), (2, 10), (3, 10), (4, 14), (4, 22)])
def test_transformer_shapes_reach_the_optimum(p, blocks):
    # light embedding and loss head around uniform blocks: the shape that unbalances V ranks
    weights = [0.05, *([1.0] * blocks), 0.3]
    ranges = balance_placement(weights, 2 * p, v_placement(p))
    assert [len(r) for r in ranges] and all(len(r) >= 1 for r in ranges)
    assert rank_max(weights, ranges, v_placement(p)) == pytest.approx(
        brute_force(weights, 2 * p, v_placement(p))
    )


def test_v_placement_fixes_the_middle_rank_overload():
    weights = [0.05, 1, 1, 1, 1, 1, 1, 0.3]
    per_stage = balance(weights, 4)
    assert rank_max(weights, per_stage, v_placement(2)) == pytest.approx(4.0)  # rank 1: 4 blocks
    balanced = balance_placement(weights, 4, v_placement(2))
    assert rank_max(weights, balanced, v_placement(2)) == pytest.approx(3.35)  # the optimum


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=4, max_size=9), st.sampled_from([2, 3, 4]))
def test_never_worse_than_per_stage_balance(weights, n_stages):
    if n_stages > len(weights):
        return
    placement = [tuple(range(r, n_stages, 2)) for r in range(2)] if n_stages > 2 else [(0,), (1,)]
    placement = [row for row in placement if row]
    ranges = balance_placement(weights, n_stages, placement)
    assert ranges[0].start == 0 and ranges[-1].stop == len(weights)
    assert all(len(r) >= 1 for r in ranges)
    assert (
        rank_max(weights, ranges, placement)
        <= rank_max(weights, balance(weights, n_stages), placement) + 1e-9
    )
