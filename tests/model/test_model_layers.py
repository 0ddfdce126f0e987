"""Every layer's B and W against central finite differences (float64), and their invariants."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.model import (
    CausalSelfAttention,
    CausalSelfAttentionCore,
    Embedding,
    Gelu,
    LayerNorm,
    Linear,
    LossHead,
    Residual,
    ResidualMLP,
    TransformerBlock,
    activation_bytes,
)

B, T, D = 2, 4, 6
TOL = 1e-6


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    scale = max(np.linalg.norm(a), np.linalg.norm(b), 1e-300)
    return float(np.linalg.norm(a - b) / scale)


def numeric_grad(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """d f / d x, entry by entry, by central differences (x perturbed in place, then restored)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        fp = f()
        x[idx] = old - h
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * h)
    return g


def check_layer(layer, x: np.ndarray, seed: int = 0) -> None:
    """B against d<y, r>/dx and W against d<y, r>/dparams for a random projection r."""
    rng = np.random.default_rng(seed)
    params = layer.init(seed, 3, np, "float64")
    for k in params:  # perturb gains/biases away from 1/0 so their gradients are generic
        params[k] = params[k] + 0.1 * rng.standard_normal(params[k].shape)
    y, ctx = layer.forward(params, x)
    r = rng.standard_normal(y.shape)

    def objective() -> float:
        return float((layer.forward(params, x)[0] * r).sum())

    dx, wctx = layer.backward_input(params, ctx, r)
    grads = layer.backward_weight(params, wctx)
    assert set(grads) == set(params)
    if np.issubdtype(x.dtype, np.floating):
        assert dx.shape == x.shape
        assert rel_err(dx, numeric_grad(objective, x)) < TOL
    else:
        assert dx is None
    for k, p in params.items():
        assert grads[k].shape == p.shape, k
        assert rel_err(grads[k], numeric_grad(objective, p)) < TOL, k


def activations(shape=(B, T, D), seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


LAYERS = {
    "linear": lambda: (Linear(D, 5), activations()),
    "layernorm": lambda: (LayerNorm(D), activations()),
    "gelu": lambda: (Gelu(D), 2 * activations()),
    "attention_core": lambda: (CausalSelfAttentionCore(D, 2, T), activations((B, T, 3 * D))),
    "attention": lambda: (CausalSelfAttention(D, 3, T, n_blocks=2), activations()),
    "residual_linear": lambda: (Residual(Linear(D, D)), activations()),
    "residual_mlp": lambda: (ResidualMLP(D, 7, n_blocks=2), activations()),
    "transformer_block": lambda: (TransformerBlock(D, 2, 8, T, n_blocks=2), activations()),
    "embedding": lambda: (Embedding(5, D), np.array([[0, 1, 1, 4], [3, 0, 4, 4]])),
    "embedding_pos": lambda: (Embedding(5, D, seq_len=6), np.array([[0, 1, 1, 4], [3, 0, 4, 4]])),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_gradients_match_finite_differences(name: str) -> None:
    layer, x = LAYERS[name]()
    check_layer(layer, x)


def test_loss_head_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(2)
    head = LossHead(D, 7)
    params = head.init(0, 9, np, "float64")
    params["ln.g"] = params["ln.g"] + 0.1 * rng.standard_normal(D)
    x = activations()
    targets = rng.integers(0, 7, (B, T))
    weight = 0.37  # the microbatch's share of the global objective

    def objective() -> float:
        return weight * float(head.forward(params, x, targets)[0])

    loss, ctx = head.forward(params, x, targets)
    assert loss.shape == ()
    dx, wctx = head.backward_input(params, ctx, weight)
    grads = head.backward_weight(params, wctx)
    assert rel_err(dx, numeric_grad(objective, x)) < TOL
    for k, p in params.items():
        assert rel_err(grads[k], numeric_grad(objective, p)) < TOL, k


def test_cross_entropy_value() -> None:
    head = LossHead(3, 4)
    params = head.init(0, 0, np, "float64")
    x = activations((1, 2, 3))
    targets = np.array([[1, 3]])
    logits = head.logits(params, x).reshape(-1, 4)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    expected = -(logp[0, 1] + logp[1, 3]) / 2
    assert float(head.forward(params, x, targets)[0]) == pytest.approx(expected, rel=1e-14)


def test_attention_is_causal() -> None:
    layer = CausalSelfAttention(D, 2, T)
    params = layer.init(0, 0, np, "float64")
    x = activations()
    y0 = layer.forward(params, x)[0]
    x2 = x.copy()
    x2[:, 2] += 1.0
    y2 = layer.forward(params, x2)[0]
    np.testing.assert_array_equal(y0[:, :2], y2[:, :2])
    assert not np.allclose(y0[:, 2:], y2[:, 2:])


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_float32_stays_float32(name: str) -> None:
    layer, x = LAYERS[name]()
    if np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    params = layer.init(0, 0, np, "float32")
    assert all(p.dtype == np.float32 for p in params.values())
    y, ctx = layer.forward(params, x)
    assert y.dtype == np.float32
    dx, grads = layer.backward(params, ctx, np.ones_like(y))
    assert dx is None or dx.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads.values())


def test_init_depends_only_on_seed_and_index() -> None:
    block = TransformerBlock(D, 2, 8, T)
    same = block.init(5, 2, np, "float64")
    again = TransformerBlock(D, 2, 8, T).init(5, 2, np, "float64")
    for k in same:
        np.testing.assert_array_equal(same[k], again[k])
    other_index = block.init(5, 3, np, "float64")
    other_seed = block.init(6, 2, np, "float64")
    assert not np.array_equal(same["attn.sa.qkv.w"], other_index["attn.sa.qkv.w"])
    assert not np.array_equal(same["attn.sa.qkv.w"], other_seed["attn.sa.qkv.w"])
    f32 = block.init(5, 2, np, "float32")
    for k in same:
        np.testing.assert_array_equal(f32[k], same[k].astype(np.float32))


def test_param_shapes_match_init() -> None:
    for name, make in LAYERS.items():
        layer, _ = make()
        params = layer.init(0, 0, np, "float64")
        assert {k: v.shape for k, v in params.items()} == layer.param_shapes(), name
        assert layer.n_params == sum(v.size for v in params.values())


def test_activation_bytes_counts_each_buffer_once() -> None:
    a = np.zeros((4, 8))
    assert activation_bytes([a, a, a[1:], {"x": a.T}]) == a.nbytes
    b = np.zeros(3, dtype=np.float32)
    assert activation_bytes((a, (b, None, 1.5))) == a.nbytes + b.nbytes
    layer = Linear(D, 5)
    params = layer.init(0, 0, np, "float64")
    x = activations()
    y, ctx = layer.forward(params, x)
    _, wctx = layer.backward_input(params, ctx, np.ones_like(y))
    assert activation_bytes(ctx) == x.nbytes
    assert activation_bytes(wctx) == x.nbytes + y.nbytes


def test_embedding_gradient_without_scatter_add() -> None:
    """Array modules without `add.at` fall back to a one-hot product with the same result."""
    from types import SimpleNamespace

    from hpcpipe.model.layers import _scatter_add_rows

    idx = np.array([0, 3, 3, 1])
    vals = np.arange(8.0).reshape(4, 2)
    bare = SimpleNamespace(zeros=np.zeros, arange=np.arange, add=SimpleNamespace())
    np.testing.assert_array_equal(
        _scatter_add_rows(bare, 5, idx, vals), _scatter_add_rows(np, 5, idx, vals)
    )
    assert _scatter_add_rows(np, 5, idx, vals)[3].tolist() == [6.0, 8.0]


def test_buffers_resolves_views_and_keeps_nothing_alive():
    """`buffers` counts a base once for all its views, and drops its references on return:
    with the cyclic collector off, the arrays die with the tree (a recursive closure would
    have kept them until a collection, growing the resident set step after step)."""
    import gc
    import weakref

    from hpcpipe.model.layers import activation_bytes, buffers

    base = np.ones((4, 8))
    tree = {"a": base[1:], "b": [base.T, (np.zeros(3), base)], "c": None}
    found = buffers(tree)
    assert set(found) == {id(base), id(tree["b"][1][0])}
    assert activation_bytes(tree) == base.nbytes + 3 * 8
    alive = weakref.ref(base)
    gc.disable()
    try:
        del found, tree, base
        assert alive() is None
    finally:
        gc.enable()
