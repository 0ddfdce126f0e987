"""Whole models: gradients, partitions, stages run in any order, identical init in any layout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpipe.config import ConfigError, parse_section
from hpcpipe.model import (
    Embedding,
    LossHead,
    ModelConfig,
    Stage,
    accumulate,
    balance,
    boundary_shape,
    build_model,
    describe,
    init_params,
    partition,
    zeros_like,
)

GPT = ModelConfig(kind="gpt", layers=2, d_model=8, n_heads=2, d_ff=12, vocab=7, seq_len=5)
MLP = ModelConfig(kind="mlp", layers=3, d_model=6, d_ff=10, vocab=7, seq_len=5)


def batch(cfg: ModelConfig, rows: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, cfg.vocab, (rows, cfg.seq_len)),
        rng.integers(0, cfg.vocab, (rows, cfg.seq_len)),
    )


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("cfg", [GPT, MLP], ids=["gpt", "mlp"])
def test_model_gradients_match_finite_differences(cfg: ModelConfig) -> None:
    """Every entry of every parameter by central differences; relative error per tensor."""
    units = build_model(cfg)
    stage = Stage(units, range(len(units)))
    params = stage.init(0, np, "float64")
    x, t = batch(cfg)
    _, ctx = stage.forward(params, x, t)
    dx, wctx = stage.backward_input(params, ctx, 1.0)
    assert dx is None  # the first unit takes token ids
    grads = stage.backward_weight(params, wctx)
    h = 1e-5
    for i, p in params.items():
        for k, a in p.items():
            num = np.zeros_like(a)
            flat, out = a.reshape(-1), num.reshape(-1)
            for j in range(flat.size):
                old = flat[j]
                flat[j] = old + h
                lp = float(stage.forward(params, x, t)[0])
                flat[j] = old - h
                lm = float(stage.forward(params, x, t)[0])
                flat[j] = old
                out[j] = (lp - lm) / (2 * h)
            assert rel_err(grads[i][k], num) < 1e-6, (i, k, rel_err(grads[i][k], num))


def test_build_model_units() -> None:
    for cfg in (GPT, MLP):
        units = build_model(cfg)
        assert len(units) == cfg.layers + 2
        assert isinstance(units[0], Embedding) and isinstance(units[-1], LossHead)
    assert "wpe" in build_model(GPT)[0].param_shapes()
    assert "wpe" not in build_model(MLP)[0].param_shapes()
    assert boundary_shape(GPT, 4) == (4, GPT.seq_len, GPT.d_model)


def test_model_config_checks_heads() -> None:
    with pytest.raises(ConfigError, match=r"model\.n_heads = 3 must divide d_model = 8"):
        parse_section(ModelConfig, {"d_model": 8, "n_heads": 3}, "deck.toml", "model")
    assert parse_section(ModelConfig, {"kind": "mlp", "d_model": 8, "n_heads": 3}, "d", "model")


@pytest.mark.parametrize("cfg", [GPT, MLP], ids=["gpt", "mlp"])
def test_stages_compose_to_the_whole_model(cfg: ModelConfig) -> None:
    """Any partition gives the same loss and gradients, bit for bit, from the same init."""
    units = build_model(cfg)
    whole = Stage(units, range(len(units)))
    params = whole.init(3, np, "float64")
    x, t = batch(cfg)
    loss, ctx = whole.forward(params, x, t)
    _, ref = whole.backward(params, ctx, 0.5)
    for sizes in ([1, 1, len(units) - 2], [len(units) - 1, 1], [2, len(units) - 2]):
        stages = [Stage(units, r) for r in partition(units, len(sizes), by=sizes)]
        sp = [s.init(3, np, "float64") for s in stages]
        for p in sp:
            for i in p:
                for k in p[i]:
                    np.testing.assert_array_equal(p[i][k], params[i][k])
        h, ctxs = x, []
        for s, p in zip(stages, sp, strict=True):
            h, c = s.forward(p, h, t if s.is_last else None)
            ctxs.append(c)
        assert float(h) == float(loss)
        dy, grads = 0.5, {}
        for s, p, c in reversed(list(zip(stages, sp, ctxs, strict=True))):
            dy, g = s.backward(p, c, dy)
            grads.update(g)
        assert dy is None
        for i in ref:
            for k in ref[i]:
                np.testing.assert_array_equal(grads[i][k], ref[i][k])


def test_microbatches_in_flight_and_delayed_w() -> None:
    """Interleaved F/B/W of several microbatches (as in ZB schedules) equals fused, in order."""
    units = build_model(GPT)
    stage = Stage(units, range(len(units)))
    params = stage.init(0, np, "float64")
    mbs = [batch(GPT, rows=2, seed=s) for s in range(3)]
    fused = zeros_like(params)
    for x, t in mbs:
        _, ctx = stage.forward(params, x, t)
        accumulate(fused, stage.backward(params, ctx, 1 / 3)[1])
    ctxs = [stage.forward(params, x, t)[1] for x, t in mbs]  # three F in flight
    live = sum(Stage.activation_bytes(c) for c in ctxs)
    assert live > 0
    wctxs = [stage.backward_input(params, ctxs[k], 1 / 3)[1] for k in (2, 0, 1)]
    del ctxs
    split = zeros_like(params)
    for w in reversed(wctxs):  # W long after B, in another order
        accumulate(split, stage.backward_weight(params, w))
    for i in fused:
        for k in fused[i]:
            np.testing.assert_allclose(split[i][k], fused[i][k], rtol=1e-13, atol=1e-15)


def test_last_stage_needs_targets() -> None:
    units = build_model(MLP)
    stage = Stage(units, range(len(units)))
    with pytest.raises(ValueError, match="needs targets"):
        stage.forward(stage.init(0), batch(MLP)[0])
    with pytest.raises(ValueError):
        Stage(units, range(2, 2))


def brute_force_best(weights: list[int], k: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        worst = max(sum(weights[b[i] : b[i + 1]]) for i in range(k))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balance_is_optimal_and_contiguous(weights: list[int], k: int) -> None:
    if k > len(weights):
        with pytest.raises(ValueError):
            balance(weights, k)
        return
    ranges = balance(weights, k)
    assert len(ranges) == k
    assert ranges[0].start == 0 and ranges[-1].stop == len(weights)
    assert all(len(r) >= 1 for r in ranges)
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    worst = max(sum(weights[i] for i in r) for r in ranges)
    assert worst == brute_force_best(weights, k)


def test_partition_by_params_flops_and_explicit() -> None:
    cfg = ModelConfig(kind="gpt", layers=8, d_model=32, n_heads=4, d_ff=128, vocab=64, seq_len=32)
    units = build_model(cfg)
    for by in ("params", "flops"):
        cost = [u.n_params if by == "params" else u.flops_per_token() for u in units]
        ranges = partition(units, 4, by=by)
        stage_cost = [sum(cost[i] for i in r) for r in ranges]
        assert max(stage_cost) == brute_force_best(cost, 4)
        assert max(stage_cost) <= 1.5 * sum(cost) / 4  # identical blocks balance well
    assert partition(units, 3, by=[2, 5, 3]) == [range(0, 2), range(2, 7), range(7, 10)]
    with pytest.raises(ValueError, match="sum to 10"):
        partition(units, 2, by=[2, 2])
    with pytest.raises(ValueError, match="by ="):
        partition(units, 2, by="memory")
    text = describe(units, partition(units, 2))
    assert "TransformerBlock" in text and "stage 1:" in text


def test_init_params_identical_across_partitions() -> None:
    units = build_model(GPT)
    full = init_params(units, 11, np, "float32")
    for r in partition(units, 3, by="params"):
        part = Stage(units, r).init(11, np, "float32")
        assert set(part) == set(r)
        for i in r:
            for k in full[i]:
                np.testing.assert_array_equal(part[i][k], full[i][k])
    # identical blocks at different global indices get different weights
    assert not np.array_equal(full[1]["mlp.fc.w"], full[2]["mlp.fc.w"])


def test_weight_gradients_unit_by_unit_in_buffer_order() -> None:
    """W unit by unit gives W's gradients in the order the gradient buffers lay the units out,
    so a bucket wholly below a finished unit's end holds only final gradients."""
    from hpcpipe.mpi.collectives import FlatBuffer
    from hpcpipe.train.pipeline import _unit_ends

    units = build_model(GPT)
    stage = Stage(units, range(1, len(units)))
    params = stage.init(0, np, "float64")
    x, t = batch(GPT, rows=2, seed=1)
    first = Stage(units, range(0, 1))
    h, _ = first.forward(first.init(0, np, "float64"), x)
    _, ctx = stage.forward(params, h, t)
    _, wctx = stage.backward_input(params, ctx, 1.0)
    each = list(stage.backward_weight_units(params, wctx))
    assert [i for i, _ in each] == list(params) == list(stage.indices)
    whole = stage.backward_weight(params, wctx)
    for i, g in each:
        for k, v in g.items():
            np.testing.assert_array_equal(v, whole[i][k])
    shapes = {(i, k): v.shape for i, p in params.items() for k, v in p.items()}
    dense = FlatBuffer.like(np, shapes, np.float64)
    ends = _unit_ends(dense, FlatBuffer.like(np, {}, np.float64))
    for i in stage.indices:  # everything below a unit's end belongs to it or an earlier unit
        below = [key for key, (lo, hi) in dense.offsets.items() if hi <= ends[i][0]]
        assert below and all(j <= i for j, _ in below)
        assert ends[i][1] == 0
    assert ends[stage.indices[-1]][0] == dense.flat.size
