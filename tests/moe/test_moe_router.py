"""Routing of one microbatch against hand computations: top-k, capacity, drops, aux and z-loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcpipe.moe.router import (
    aux_loss_grad,
    expert_capacity,
    gate_grad,
    load_balancing_loss,
    route,
    z_loss,
)

# 5 tokens x 3 experts; rows sum to 1
PROBS = np.array(
    [
        [0.6, 0.3, 0.1],
        [0.5, 0.2, 0.3],
        [0.7, 0.2, 0.1],
        [0.1, 0.8, 0.1],
        [0.4, 0.4, 0.2],  # tie between experts 0 and 1: the lower index wins
    ]
)


@pytest.mark.parametrize(
    "tokens,k,experts,factor,expected",
    [
        (16, 2, 4, 1.25, 10),  # 8 * 1.25
        (12, 1, 4, 1.0, 3),
        (10, 2, 4, 1.1, 6),  # 5.5 -> 6
        (20, 1, 8, 1.1, 3),  # 2.75 -> 3
        (10, 1, 1, 1.1, 11),  # 10 * 1.1 = 11.000000000000002 in binary: still 11
        (3, 1, 8, 0.5, 1),  # 0.1875 -> 1
        (0, 2, 4, 1.0, 0),
    ],
)
def test_capacity_is_the_documented_ceiling(tokens, k, experts, factor, expected):
    assert expert_capacity(tokens, k, experts, factor) == expected


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_capacity_factor_must_be_positive(factor):
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(8, 1, 2, factor)


def test_top1_with_capacity_drops_the_least_probable():
    r = route(PROBS, 1, capacity=2)
    assert r.topk[:, 0].tolist() == [0, 0, 0, 1, 0]
    assert r.routed.tolist() == [4, 1, 0]
    # expert 0 got tokens 0 (0.6), 1 (0.5), 2 (0.7), 4 (0.4): keeps 2 and 0, drops 1 and 4
    assert list(zip(r.expert.tolist(), r.token.tolist(), strict=True)) == [(0, 0), (0, 2), (1, 3)]
    assert r.kept.tolist() == [2, 1, 0] and r.dropped == 2 and r.capacity == 2
    assert r.slot.tolist() == [0, 0, 0]


def test_top2_choices_ties_and_dispatch_order():
    r = route(PROBS, 2, capacity=None)
    assert r.topk.tolist() == [[0, 1], [0, 2], [0, 1], [1, 0], [0, 1]]
    assert r.dropped == 0 and r.capacity == 5
    # dispatch order: by expert, then token
    assert r.expert.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert r.token.tolist() == [0, 1, 2, 3, 4, 0, 2, 3, 4, 1]
    assert r.slot.tolist() == [0, 0, 0, 1, 0, 1, 1, 0, 1, 1]


def test_top2_capacity_priority_is_router_probability_then_token():
    r = route(PROBS, 2, capacity=2)
    # expert 0 candidates: 0.6, 0.5, 0.7, 0.1, 0.4 -> keeps tokens 2, 0
    # expert 1 candidates (tokens 0, 2, 3, 4): 0.3, 0.2, 0.8, 0.4 -> keeps 3, 4
    # expert 2 candidate token 1 (0.3): kept
    kept = sorted(zip(r.expert.tolist(), r.token.tolist(), strict=True))
    assert kept == [(0, 0), (0, 2), (1, 3), (1, 4), (2, 1)]
    assert r.kept.tolist() == [2, 2, 1] and r.routed.tolist() == [5, 4, 1]
    # equal probabilities within one expert: the earlier token is kept
    tie = route(np.full((4, 2), 0.5), 1, capacity=1)
    assert tie.token.tolist() == [0]


def test_dropless_and_zero_capacity_and_empty_microbatch():
    assert route(PROBS, 2, capacity=None).kept.sum() == 10
    assert route(PROBS, 2, capacity=5).dropped == 0  # capacity >= tokens keeps all
    none = route(PROBS, 2, capacity=0)
    assert none.token.size == 0 and none.kept.tolist() == [0, 0, 0] and none.dropped == 10
    empty = route(np.zeros((0, 3)), 2, capacity=0)
    assert empty.token.size == 0 and empty.routed.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="top_k"):
        route(PROBS, 4, capacity=None)


def test_load_balancing_loss_by_hand():
    r = route(PROBS, 1, capacity=None)
    f = np.array([4, 1, 0]) / 5
    p_mean = PROBS.mean(axis=0)
    assert float(load_balancing_loss(PROBS, r)) == pytest.approx(3 * float(f @ p_mean), 1e-15)
    uniform = np.full((6, 3), 1 / 3)
    assert float(load_balancing_loss(uniform, route(uniform, 1, None))) == pytest.approx(1.0)
    # f counts top-k choices before dropping: dropping changes nothing
    assert float(load_balancing_loss(PROBS, route(PROBS, 1, capacity=1))) == pytest.approx(
        float(load_balancing_loss(PROBS, r))
    )
    assert float(load_balancing_loss(np.zeros((0, 3)), route(np.zeros((0, 3)), 1, 0))) == 0.0


def test_aux_loss_gradient_is_experts_times_f_over_tokens():
    r = route(PROBS, 2, capacity=1)
    g = aux_loss_grad(PROBS, r)
    f = r.routed / (5 * 2)
    np.testing.assert_allclose(g, 3 * f / 5, rtol=1e-15)
    # and it is the derivative of the loss along any direction of the probabilities
    d = np.random.default_rng(0).standard_normal(PROBS.shape)
    h = 1e-7
    num = (load_balancing_loss(PROBS + h * d, r) - load_balancing_loss(PROBS - h * d, r)) / (2 * h)
    assert float(num) == pytest.approx(float((g[None, :] * d).sum()), rel=1e-8)


def test_z_loss_by_hand():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lse = np.array([math.log(math.e + math.e**2 + math.e**3), math.log(3.0)])
    assert float(z_loss(lse)) == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2, 1e-15)
    shifted = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1)[:, None]).sum(1))
    np.testing.assert_allclose(shifted, lse, rtol=1e-15)
    assert float(z_loss(np.zeros(0))) == 0.0


@pytest.mark.parametrize("normalize", [False, True])
def test_gate_gradient_matches_finite_differences(normalize):
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(4), size=6)
    topk = route(probs, 2, None).topk
    dgate = rng.standard_normal((6, 2))

    def objective(p):
        top = np.take_along_axis(p, topk, axis=1)
        gates = top / top.sum(axis=1, keepdims=True) if normalize else top
        return float((gates * dgate).sum())

    g = gate_grad(probs, topk, dgate, normalize)
    h = 1e-7
    num = np.zeros_like(probs)
    for idx in np.ndindex(probs.shape):
        plus, minus = probs.copy(), probs.copy()
        plus[idx] += h
        minus[idx] -= h
        num[idx] = (objective(plus) - objective(minus)) / (2 * h)
    np.testing.assert_allclose(g, num, atol=1e-8)
    unchosen = np.ones(probs.shape, dtype=bool)
    np.put_along_axis(unchosen, topk, False, axis=1)
    assert not g[unchosen].any()
