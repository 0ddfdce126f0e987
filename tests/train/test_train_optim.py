"""AdamW and SGD against updates worked out by hand; clipping and schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcpipe.config import ConfigError, parse_section
from hpcpipe.train.optim import (
    OptimConfig,
    adamw_update,
    apply_update,
    clip_scale,
    grad_sq_norm,
    init_state,
    learning_rate,
    sgd_update,
)


def test_adamw_two_steps_by_hand() -> None:
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-8, 0.01
    p, m, v = np.array([1.0]), np.array([0.0]), np.array([0.0])
    p, m, v = adamw_update(
        p, np.array([0.5]), m, v, t=1, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd
    )
    # m = 0.05, v = 0.00025, mhat = 0.5, vhat = 0.25: the step is lr * 0.5 / (0.5 + eps)
    assert m[0] == pytest.approx(0.05) and v[0] == pytest.approx(0.00025)
    p1 = 1.0 * (1 - lr * wd) - lr * 0.5 / (0.5 + eps)
    assert p[0] == pytest.approx(p1, rel=1e-15)
    p, m, v = adamw_update(
        p, np.array([-1.0]), m, v, t=2, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd
    )
    m2 = 0.9 * 0.05 + 0.1 * -1.0  # -0.055
    v2 = 0.999 * 0.00025 + 0.001 * 1.0  # 0.00124975
    mhat, vhat = m2 / (1 - 0.9**2), v2 / (1 - 0.999**2)
    p2 = p1 * (1 - lr * wd) - lr * mhat / (math.sqrt(vhat) + eps)
    assert m[0] == pytest.approx(m2, rel=1e-15) and v[0] == pytest.approx(v2, rel=1e-15)
    assert p[0] == pytest.approx(p2, rel=1e-15)


def test_sgd_momentum_and_nesterov_by_hand() -> None:
    p, buf = np.array([2.0]), np.array([0.0])
    p, buf = sgd_update(p, np.array([1.0]), buf, lr=0.1, momentum=0.9, weight_decay=0.5)
    # d = 1 + 0.5 * 2 = 2; buf = 2; p = 2 - 0.2
    assert buf[0] == pytest.approx(2.0) and p[0] == pytest.approx(1.8)
    p, buf = sgd_update(p, np.array([1.0]), buf, lr=0.1, momentum=0.9, weight_decay=0.5)
    # d = 1 + 0.9 = 1.9; buf = 0.9 * 2 + 1.9 = 3.7; p = 1.8 - 0.37
    assert buf[0] == pytest.approx(3.7) and p[0] == pytest.approx(1.43)
    q, nbuf = sgd_update(
        np.array([2.0]),
        np.array([1.0]),
        np.array([1.0]),
        lr=0.1,
        momentum=0.5,
        weight_decay=0.0,
        nesterov=True,
    )
    # buf = 0.5 + 1 = 1.5; d = 1 + 0.5 * 1.5 = 1.75
    assert nbuf[0] == pytest.approx(1.5) and q[0] == pytest.approx(2.0 - 0.175)
    plain, none = sgd_update(
        np.array([2.0]), np.array([3.0]), None, lr=0.1, momentum=0.0, weight_decay=0.0
    )
    assert none is None and plain[0] == pytest.approx(1.7)


def tree() -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        0: {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)},
        5: {"g": rng.standard_normal(4)},
    }


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_apply_update_is_pure_and_matches_kernels(kind: str) -> None:
    cfg = OptimConfig(kind=kind, lr=0.05, weight_decay=0.1, momentum=0.8)
    params, grads = tree(), tree()
    for g in grads.values():
        for k in g:
            g[k] = g[k] * 0.3 + 0.1
    before = {i: {k: v.copy() for k, v in p.items()} for i, p in params.items()}
    state = init_state(cfg, params)
    new, state1 = apply_update(cfg, params, grads, state, lr=0.05, grad_scale=0.5)
    for i in params:
        for k in params[i]:
            np.testing.assert_array_equal(params[i][k], before[i][k])  # inputs untouched
    assert state1.step == 1 and state.step == 0
    for i in params:
        for k, p in params[i].items():
            wd = 0.1 if p.ndim >= 2 else 0.0  # only matrices decay
            if kind == "adamw":
                want = adamw_update(
                    p,
                    grads[i][k],
                    0 * p,
                    0 * p,
                    t=1,
                    lr=0.05,
                    beta1=0.9,
                    beta2=0.95,
                    eps=1e-8,
                    weight_decay=wd,
                    grad_scale=0.5,
                )[0]
            else:
                want = sgd_update(
                    p, grads[i][k], 0 * p, lr=0.05, momentum=0.8, weight_decay=wd, grad_scale=0.5
                )[0]
            np.testing.assert_array_equal(new[i][k], want)
    # grad_scale is the same as scaling the gradients
    halved = {i: {k: v * 0.5 for k, v in g.items()} for i, g in grads.items()}
    new2, _ = apply_update(cfg, params, halved, init_state(cfg, params), lr=0.05)
    for i in params:
        for k in params[i]:
            np.testing.assert_allclose(new2[i][k], new[i][k], rtol=1e-14)
    _, state2 = apply_update(cfg, new, grads, state1, lr=0.05)
    assert state2.step == 2 and set(state2.slots) == set(state1.slots)


def test_sgd_without_momentum_keeps_no_state() -> None:
    cfg = OptimConfig(kind="sgd", lr=0.1, momentum=0.0)
    params = tree()
    state = init_state(cfg, params)
    assert state.slots == {}
    new, _ = apply_update(cfg, params, params, state, lr=0.1)
    np.testing.assert_allclose(new[0]["w"], 0.9 * params[0]["w"])


def test_clipping_from_a_reduced_norm() -> None:
    grads = tree()
    sq = grad_sq_norm(grads)
    assert sq == pytest.approx(sum(float((v**2).sum()) for g in grads.values() for v in g.values()))
    # partial norms of two "ranks" add up to the global one
    part_a, part_b = {0: grads[0]}, {5: grads[5]}
    assert grad_sq_norm(part_a) + grad_sq_norm(part_b) == pytest.approx(sq)
    assert clip_scale(sq, 0.0) == 1.0
    assert clip_scale(sq, 1e9) == 1.0
    assert clip_scale(16.0, 2.0) == pytest.approx(0.5, rel=1e-6)
    assert math.isnan(clip_scale(math.inf, 1.0)) and math.isnan(clip_scale(math.nan, 0.0))


def test_learning_rate_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup=4, schedule="cosine", min_lr_ratio=0.1)
    assert [learning_rate(cfg, s, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(cfg, 4, 14) == pytest.approx(1.0)
    assert learning_rate(cfg, 9, 14) == pytest.approx(0.55)
    assert learning_rate(cfg, 14, 14) == pytest.approx(0.1)
    assert learning_rate(OptimConfig(lr=0.3), 100, 10) == 0.3


def test_optim_config_checks() -> None:
    with pytest.raises(ConfigError, match=r"optim.betas = \[0.9\] must be two numbers"):
        parse_section(OptimConfig, {"betas": [0.9]}, "deck", "optim")
    with pytest.raises(ConfigError, match=r"optim.nesterov = true needs momentum > 0"):
        parse_section(OptimConfig, {"nesterov": True, "momentum": 0}, "deck", "optim")
    with pytest.raises(ConfigError, match=r"optim\.kind"):
        parse_section(OptimConfig, {"kind": "lion"}, "deck", "optim")
